"""The fast generation path (static KV cache decode loop) against the plain one (HF generate, the model's forward).

On CPU the static engine runs the same decode step it captures as a CUDA graph on a GPU, without the capture.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from peft import LoraConfig, get_peft_model
from trl.trainer.utils import selective_log_softmax

from agent.llm import OpenAIChat
from backends.samples import Sample, flatten
from foundation.errors import ConfigError
from inference import HFGenerate, StaticGenerate, make_engine
from inference.policy_server import PolicyServer
from jobs.config import build_components
from tests.conftest import micro_tiny

CORPUS = ["You are a helpful assistant.", "What is in the table?", "SELECT name FROM people WHERE age > 30"] * 10
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    spec = micro_tiny(tmp_path_factory.mktemp("models"))
    source = spec.prepare(CORPUS)
    model = spec.load_model(source, "cpu").eval()
    return model, spec.load_tokenizer(source)


def prompts_of(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in texts]


def both(tiny, prompts, budgets, eos_ids, temperature=0.0, engine=None):
    model, tokenizer = tiny
    kwargs = {"temperature": temperature, "top_p": 1.0, "eos_ids": eos_ids, "pad_id": tokenizer.pad_token_id}
    plain = HFGenerate().generate(model, prompts, budgets, **kwargs)
    fast = (engine or StaticGenerate(block=16)).generate(model, prompts, budgets, **kwargs)
    return plain, fast


def test_greedy_static_decoding_matches_generate_across_calls_and_an_eos_stop(tiny) -> None:
    tokenizer = tiny[1]
    prompts = prompts_of(tokenizer, ["Hi", "What is in the table?", "SELECT name FROM people WHERE"])
    engine = StaticGenerate(block=16)  # one engine over calls: its cache grows and its state is reused
    plain, fast = both(tiny, prompts, [12, 5, 20], {tokenizer.eos_token_id}, engine=engine)
    assert [c.token_ids for c in fast] == [c.token_ids for c in plain]
    assert [len(c.token_ids) for c in fast] == [12, 5, 20] and {c.finish_reason for c in fast} == {"length"}

    stop = fast[2].token_ids[6]  # a token row 2 produces: as an eos id, generation stops there (and keeps it)
    plain, fast = both(tiny, prompts[::-1], [40, 30, 3], {stop}, engine=engine)
    assert [c.token_ids for c in fast] == [c.token_ids for c in plain]
    assert [c.finish_reason for c in fast] == [c.finish_reason for c in plain]
    assert fast[0].finish_reason == "stop" and fast[0].token_ids[-1] == stop and len(fast[0].token_ids) <= 7

    engine.release()  # what the backend does after validation: the next call rebuilds everything
    plain, fast = both(tiny, prompts[:2], [9, 9], {tokenizer.eos_token_id}, engine=engine)
    assert [c.token_ids for c in fast] == [c.token_ids for c in plain]


def test_both_engines_prefill_every_prompt_token_of_every_call(tiny) -> None:
    """Neither keeps a prefix cache: prompts that share a prefix, and a call that repeats one, each computed whole
    (backends/compute.py charges 2N a token for it)."""
    tokenizer = tiny[1]
    prompts = prompts_of(tokenizer, ["What is in the table?", "What is in the table? SELECT name", "Hi"])
    engine = StaticGenerate(block=16)
    for _ in range(2):  # the static engine's cache is reused by the second call: its prompts are computed again
        for completions in both(tiny, prompts, [4, 4, 4], {tokenizer.eos_token_id}, engine=engine):
            assert [c.prefilled for c in completions] == [len(p) for p in prompts]


def per_token_logps(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """What the GRPO loss uses: the model's forward over prompt + completion, TRL's selective log-softmax."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1] / temperature
    return selective_log_softmax(logits, torch.tensor([completion]))[0]


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_sampled_tokens_have_the_log_probs_the_trainer_computes(tiny, finetune: str) -> None:
    model, tokenizer = tiny
    if finetune == "lora":
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])
        model = get_peft_model(copy.deepcopy(model), config)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # zero at init: make the adapter change the output
                torch.nn.init.normal_(p, std=0.5)
    prompts = prompts_of(tokenizer, ["Hi", "What is in the table?", "SELECT name FROM"] * 3)
    torch.manual_seed(0)
    completions = StaticGenerate(block=16).generate(
        model, prompts, [24] * 9, temperature=0.7, top_p=1.0, eos_ids={tokenizer.eos_token_id}, pad_id=0
    )
    assert len({tuple(c.token_ids) for c in completions}) > 1  # sampled, not all the same
    for prompt, completion in zip(prompts, completions, strict=True):
        expected = per_token_logps(model, prompt, completion.token_ids, 0.7)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_an_optimizer_step_between_calls_is_seen_by_the_next_generation(tiny, finetune: str) -> None:
    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    if finetune == "lora":
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj", "o_proj"]))
    trained = [p for p in model.parameters() if p.requires_grad]
    prompts = prompts_of(tokenizer, ["Hi", "What is in the table?", "SELECT name FROM"])
    kwargs = {"temperature": 0.0, "top_p": 1.0, "eos_ids": set(), "pad_id": 0}
    engine = StaticGenerate(block=16)
    before = engine.generate(model, prompts, [16] * 3, **kwargs)
    torch.manual_seed(0)
    with torch.no_grad():  # what optimizer.step() does: in place, under the engine's copies of the weights
        for p in trained:
            p.add_(torch.randn_like(p) * 0.3)
    after = engine.generate(model, prompts, [16] * 3, **kwargs)
    expected = HFGenerate().generate(model, prompts, [16] * 3, **kwargs)
    assert [c.token_ids for c in after] == [c.token_ids for c in expected]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]


def test_top_p_keeps_only_the_nucleus(tiny) -> None:
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer, ["What is in the table?"] * 8)
    out = StaticGenerate(block=16).generate(
        model, prompts, [16] * 8, temperature=1.0, top_p=1e-6, eos_ids=set(), pad_id=0
    )  # a nucleus of one token: sampling is greedy
    greedy = HFGenerate().generate(model, prompts[:1], [16], temperature=0.0, top_p=1.0, eos_ids=set(), pad_id=0)
    assert all(c.token_ids == greedy[0].token_ids for c in out)


async def two_turns(chat: OpenAIChat, question: str) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": question}]
    first = await chat.chat(messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "What is in the table?"}]
    await chat.chat(messages)


def rollout_samples(tiny, engine) -> list:
    """Four concurrent two-turn rollouts through the policy server; the GRPO samples they become."""
    model, tokenizer = tiny
    server = PolicyServer(model, tokenizer, max_prompt_tokens=128, max_response_tokens=48, engine=engine)
    questions = ["Hi", "SELECT name FROM people", "What is in the table? And why?", "age > 30"]
    chats = [server.chat_model(f"r{i}", {"temperature": 0.0, "max_tokens": 10}) for i in range(len(questions))]

    async def run_all() -> None:
        with server.active_rollouts(len(chats)) as finished:

            async def one(chat: OpenAIChat, question: str) -> None:
                try:
                    await two_turns(chat, question)
                finally:
                    finished()

            await asyncio.gather(*(one(c, q) for c, q in zip(chats, questions, strict=True)))

    asyncio.run(run_all())
    assert server.generate_calls == 2
    samples = [flatten(server.pop_records(f"r{i}"), 48) for i in range(len(questions))]
    assert all(isinstance(s, Sample) for s in samples), samples
    return samples


def test_rollouts_give_the_same_samples_and_loss_masks_with_either_engine(tiny) -> None:
    plain = rollout_samples(tiny, HFGenerate())
    fast = rollout_samples(tiny, StaticGenerate(block=16))
    assert [s.completion_ids for s in fast] == [s.completion_ids for s in plain]
    assert [s.env_mask for s in fast] == [s.env_mask for s in plain]
    assert [s.prompt_ids for s in fast] == [s.prompt_ids for s in plain]
    assert all(0 in s.env_mask and 1 in s.env_mask for s in fast)  # model turns trained, the added text masked
    # both engines report each sampled token's log-probability, and agree on it (CPU float32)
    for a, b in zip(fast, plain, strict=True):
        assert len(a.logprobs) == len(b.logprobs) == len(a.completion_ids)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
        assert all(lp < 0 for lp, m in zip(a.logprobs, a.env_mask, strict=True) if m == 1)


def test_engine_choice_follows_the_device_and_bad_names_fail_at_config_time() -> None:
    assert isinstance(make_engine("auto", "cpu"), HFGenerate)
    assert isinstance(make_engine("auto", "cuda"), StaticGenerate)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["backend.generation_engine=vllm"])
    with pytest.raises(ConfigError, match=r"backend\.generation_engine"):
        build_components(cfg)
