"""The tiny model builds offline, and round-trips through save and load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.tiny import TinyModel
from tests.conftest import micro_tiny

CORPUS = ["SELECT count(*) FROM students WHERE age > 20", "How many students are there?"] * 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyModel, str]:
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = micro_tiny(tmp_path_factory.mktemp("models"))
    yield spec, spec.prepare(CORPUS)
    monkeypatch.undo()


def test_builds_once_into_the_cache(tiny: tuple[TinyModel, str]) -> None:
    spec, source = tiny
    assert Path(source).parent == Path(spec.cache_dir) and (Path(source) / "config.json").is_file()
    mtime = (Path(source) / "config.json").stat().st_mtime
    assert spec.prepare(CORPUS) == source and (Path(source) / "config.json").stat().st_mtime == mtime
    assert spec.prepare([*CORPUS, "other text"]) != source  # a different corpus is a different tokenizer


def test_is_a_qwen3_with_a_qwen_chat_template(tiny: tuple[TinyModel, str]) -> None:
    spec, source = tiny
    model = spec.load_model(source, "cpu")
    tokenizer = spec.load_tokenizer(source)
    assert model.config.model_type == "qwen3"
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer("WHERE age > 20")["input_ids"]
    assert tokenizer.decode(ids) == "WHERE age > 20"
    assert [tokenizer.decode([i]) for i in tokenizer(" 20")["input_ids"]][-2:] == ["2", "0"]  # digits one by one


def test_round_trips_through_save_and_load(tiny: tuple[TinyModel, str], tmp_path: Path) -> None:
    spec, source = tiny
    model = spec.load_model(source, "cpu")
    tokenizer = spec.load_tokenizer(source)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids = torch.tensor([tokenizer("SELECT count(*) FROM students")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert reloaded_tokenizer.chat_template == tokenizer.chat_template
    assert reloaded_tokenizer.eos_token == "<|im_end|>" and reloaded_tokenizer.pad_token == "<|endoftext|>"
