"""The vLLM engine's wiring, without vLLM: a fake `LLM` with vLLM's interface (add_request / step / abort_request,
sleep / wake_up, the worker's model.load_weights) records the order of events. What it checks: requests join the
running batch as they arrive (continuous batching through the policy server), the trainer's weights go in under the
checkpoint's names with LoRA merged into copies, sleep and wake around the update, cancelled calls are aborted, and
the config's errors name the key and the extra; with the engine in its own process, weights in buckets, a live load
paused against its steps, a failed one breaking the engine. vLLM's own behaviour is checked on the GPU (bench/README.md:
the vLLM smoke and log-prob gap runs)."""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
import threading
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from peft import LoraConfig, get_peft_model

from backends.samples import flatten
from foundation.errors import ConfigError
from inference import make_engine, resolve_engine
from inference.policy_server import PolicyServer
from inference.vllm import VLLMEngine, VLLMSettings, _start_llm, preempts_exactly, vllm_engine
from inference.weights import full_weights
from jobs.config import build_components
from tests.conftest import micro_tiny

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ["You are a helpful assistant.", "What is in the table?", "SELECT name FROM people"] * 10


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class FakeLLM:
    """vLLM's LLM as VLLMEngine uses it. Each step adds one token to every running request: token = (prompt length
    + position) % vocab, log-prob -0.5 - position / 100; a request ends at its max tokens or a stop id. Its prefix
    cache: a request finds the longest prefix of its prompt that an earlier one since the last reset had (at most all
    but its last token, which vLLM always computes), and reports it as `num_cached_tokens`."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.events: list[tuple[Any, ...]] = []
        self.running: dict[str, dict[str, Any]] = {}
        self.loaded: list[str] = []
        self.step_no = 0
        self.batch_sizes: list[int] = []
        self.cached_prompts: list[list[int]] = []
        self.cached: dict[str, int] = {}  # by request id: the prompt tokens it found in the prefix cache
        self.hold_long_until_adds = 0  # a request of over 10 tokens does not end before this many requests came
        self.threads: set[str] = set()  # the threads that stepped it or loaded weights into it
        self.llm_engine = self
        model = SimpleNamespace(load_weights=self._load_weights)
        self.model_executor = SimpleNamespace(
            driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)))
        )

    def _load_weights(self, weights: Any) -> None:
        self.loaded = [name for name, _ in weights]
        self.events.append(("load_weights",))
        self.threads.add(threading.current_thread().name)  # the engine thread's, between two steps

    def add_request(self, request_id: str, prompt: dict[str, list[int]], params: Any) -> None:
        self.events.append(("add", request_id, self.step_no))
        ids = prompt["prompt_token_ids"]
        self.running[request_id] = {"prompt": ids, "params": params, "out": []}
        shared = max((common_prefix(ids, p) for p in self.cached_prompts), default=0)
        self.cached[request_id] = min(shared, len(ids) - 1)
        self.cached_prompts.append(ids)

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        for request_id in request_ids:
            self.events.append(("abort", request_id))
            self.running.pop(request_id, None)

    def step(self) -> list[Any]:
        self.threads.add(threading.current_thread().name)
        self.step_no += 1
        self.batch_sizes.append(len(self.running))
        finished = []
        for request_id, r in list(self.running.items()):
            token = (len(r["prompt"]) + len(r["out"])) % self.vocab
            r["out"].append(token)
            params = r["params"]
            held = params.max_new_tokens > 10 and sum(e[0] == "add" for e in self.events) < self.hold_long_until_adds
            if held and len(r["out"]) >= params.max_new_tokens - 1:
                r["out"].pop()
                continue
            if token in params.eos_ids or len(r["out"]) >= params.max_new_tokens:
                del self.running[request_id]
                self.events.append(("finish", request_id, self.step_no))
                logprobs = [{t: SimpleNamespace(logprob=-0.5 - i / 100)} for i, t in enumerate(r["out"])]
                sample = SimpleNamespace(token_ids=r["out"], logprobs=logprobs)
                cached = self.cached[request_id]
                finished.append(
                    SimpleNamespace(request_id=request_id, finished=True, outputs=[sample], num_cached_tokens=cached)
                )
        return finished

    def sleep(self, level: int) -> None:
        self.events.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.events.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's: with running requests it succeeds only by preempting them (they resume, recomputed, and go on)."""
        self.events.append(("reset_prefix_cache", reset_running_requests))
        if self.running and not reset_running_requests:
            return False
        self.cached_prompts = []
        return True


def fake_engine(vocab: int = 300, **settings: Any) -> tuple[VLLMEngine, list[FakeLLM]]:
    started: list[FakeLLM] = []

    def start(model: Any, s: VLLMSettings) -> FakeLLM:
        started.append(FakeLLM(vocab))
        started[-1].events.append(("start", s.max_model_len))
        return started[-1]

    engine = vllm_engine(VLLMSettings(max_model_len=512, **settings), start=start, sampling_params=lambda r: r)
    return engine, started


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    spec = micro_tiny(tmp_path_factory.mktemp("models"))
    source = spec.prepare(CORPUS)
    return spec.load_model(source, "cpu"), spec.load_tokenizer(source)


def test_requests_join_the_running_batch_as_they_arrive(tiny) -> None:
    """Rollout A asks for a long reply; rollout B's two short turns start and finish while A's is still running.
    (The fake holds A's last token until B's second turn has been added, so the order does not depend on speed.)"""
    model, tokenizer = tiny
    engine, started = fake_engine()
    server = PolicyServer(model, tokenizer, max_prompt_tokens=128, max_response_tokens=96, engine=engine)
    server.load(model)
    started[0].hold_long_until_adds = 3
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"}]

    async def rollout_a() -> None:
        await server.chat_model("a", {"temperature": 1.0, "max_tokens": 60}).chat(messages)

    async def rollout_b() -> None:
        for _ in range(1000):  # A's request is in the engine first (a hang guard of 10 s)
            if started[0].running:
                break
            await asyncio.sleep(0.01)
        chat = server.chat_model("b", {"temperature": 1.0, "max_tokens": 3})
        first = await chat.chat(messages)
        await chat.chat([*messages, {"role": "assistant", "content": first}, {"role": "user", "content": "More?"}])

    async def both() -> None:
        await asyncio.gather(rollout_a(), rollout_b())

    asyncio.run(asyncio.wait_for(both(), timeout=60))
    events = started[0].events
    adds = [e for e in events if e[0] == "add"]
    finishes = {e[1]: e[2] for e in events if e[0] == "finish"}
    a_id = adds[0][1]
    b_turns = adds[1:]
    assert len(adds) == 3
    assert all(step < finishes[a_id] for _, _, step in b_turns)  # B's second turn was added while A still ran
    assert max(started[0].batch_sizes) == 2 and engine.max_running == 2
    # the records are token exact: B's second prompt continues its first call, log-probs as the engine gave them
    first, second = server.pop_records("b")
    assert second.continues and second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    sample = flatten([first, second], max_completion_tokens=1000)
    assert not isinstance(sample, str)
    assert [lp for lp, m in zip(sample.logprobs, sample.env_mask, strict=True) if m] == [-0.5, -0.51, -0.52] * 2
    # compute: each call prefilled what vLLM's prefix cache did not hold; B's first prompt is A's, all of it cached
    # but the last token; its second continues its first, whose prompt the cache holds
    cached = [started[0].cached[request_id] for _, request_id, _ in b_turns]
    assert [first.prefilled, second.prefilled] == [
        len(first.prompt_ids) - cached[0],
        len(second.prompt_ids) - cached[1],
    ]
    assert first.prefilled == 1 and len(first.prompt_ids) <= cached[1] < len(second.prompt_ids)
    engine.close()


def test_weights_load_wake_and_sleep_in_order(tiny) -> None:
    model, _ = tiny
    engine, started = fake_engine()
    engine.load(model)  # starts vLLM, sends the weights
    engine.sleep()  # the update
    engine.load(model)  # the next rollout phase
    engine.sleep()
    names = [e[0] if e[0] != "wake_up" else f"wake_up{e[1]}" for e in started[0].events]
    assert names == [
        "start",
        "load_weights",
        "reset_prefix_cache",
        "sleep",
        "wake_up('weights',)",
        "load_weights",
        "wake_up('kv_cache',)",
        "reset_prefix_cache",
        "sleep",
    ]
    assert started[0].events[3] == ("sleep", 2) and engine.weight_loads == 2
    # asleep, the engine refuses work instead of sampling from freed weights
    with pytest.raises(RuntimeError, match="no weights loaded"):
        engine.generate(model, [[1, 2, 3]], [4], temperature=1.0, top_p=1.0, eos_ids={2}, pad_id=0)
    engine.close()


def test_no_sleep_keeps_vllm_awake(tiny) -> None:
    model, _ = tiny
    engine, started = fake_engine(sleep=False)
    engine.load(model)
    engine.sleep()
    engine.load(model)
    assert [e[0] for e in started[0].events].count("sleep") == 0
    assert [e[0] for e in started[0].events].count("load_weights") == 2
    out = engine.generate(model, [[5, 6, 7], [1] * 10], [4, 2], temperature=1.0, top_p=1.0, eos_ids=set(), pad_id=0)
    assert [c.token_ids for c in out] == [[3, 4, 5, 6], [10, 11]]
    assert [c.finish_reason for c in out] == ["length", "length"]
    engine.close()


def test_full_weights_go_under_checkpoint_names(tiny) -> None:
    model, _ = tiny
    sent = dict(full_weights(model))
    assert sent.keys() == dict(model.named_parameters()).keys()
    assert all(sent[k] is p.detach() or torch.equal(sent[k], p) for k, p in model.named_parameters())


def test_lora_weights_go_merged_into_copies_and_the_trainer_weights_stay(tiny) -> None:
    model, _ = tiny
    peft_model = get_peft_model(
        type(model)(model.config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    )
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    before = {k: v.clone() for k, v in peft_model.named_parameters()}
    sent = dict(full_weights(peft_model))
    base = dict(peft_model.get_base_model().named_parameters())
    assert sent.keys() == {k.replace(".base_layer", "") for k in base if ".lora_" not in k}
    q = "model.layers.0.self_attn.q_proj"
    layer = peft_model.get_base_model().model.layers[0].self_attn.q_proj
    expected = layer.base_layer.weight + layer.lora_B["default"].weight @ layer.lora_A["default"].weight * 2.0
    assert torch.allclose(sent[f"{q}.weight"], expected, atol=1e-6)
    assert sent[f"{q}.weight"].dtype == layer.base_layer.weight.dtype
    assert not torch.allclose(sent[f"{q}.weight"], layer.base_layer.weight)
    k = "model.layers.0.self_attn.k_proj.weight"  # not adapted: the weight itself
    assert torch.equal(sent[k], base[k])
    assert all(torch.equal(before[k], v) for k, v in peft_model.named_parameters())  # nothing modified


def test_a_cancelled_call_is_aborted_in_the_engine(tiny) -> None:
    model, _ = tiny
    engine, started = fake_engine()
    engine.load(model)
    fake = started[0]
    fake.step = list  # never finishes anything

    async def cancel_one() -> None:
        task = asyncio.ensure_future(engine.submit([1, 2, 3], 50, temperature=1.0, top_p=1.0, eos_ids={2}))
        for _ in range(200):  # until the engine thread took it
            await asyncio.sleep(0.01)
            if fake.running:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(cancel_one(), timeout=30))
    engine.close()
    assert ("abort", "0") in fake.events and not fake.running


def test_a_reply_that_comes_after_its_caller_left_does_not_stop_the_engine(tiny) -> None:
    """A call cancelled while vLLM runs the step that finishes it: the reply finds the caller's event loop closed.
    The engine must drop it and keep serving (it used to die there, and every later call hung)."""
    model, _ = tiny
    engine, started = fake_engine()
    engine.load(model)
    fake, stepping, release = started[0], threading.Event(), threading.Event()
    real_step = fake.step

    def held_step() -> list[Any]:
        stepping.set()
        assert release.wait(timeout=60), "the test never released the step"
        return real_step()

    fake.step = held_step

    async def leave() -> None:
        task = asyncio.ensure_future(engine.submit([1, 2, 3], 1, temperature=1.0, top_p=1.0, eos_ids=set()))
        while not stepping.is_set():  # bounded by the wait_for below
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(leave(), timeout=30))  # the loop is closed from here on
    release.set()
    fake.step = real_step
    engine.sleep()  # answered by the engine thread: it is alive
    engine.load(model)
    out = engine.generate(model, [[1, 2, 3]], [2], temperature=1.0, top_p=1.0, eos_ids=set(), pad_id=0)
    assert out[0].token_ids == [3, 4]
    engine.close()


def test_a_failed_engine_step_fails_its_requests_and_every_later_one(tiny) -> None:
    model, _ = tiny
    engine, started = fake_engine()
    engine.load(model)

    def boom() -> list[Any]:
        raise RuntimeError("CUDA error: an illegal memory access")

    started[0].step = boom
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.generate(model, [[1, 2]], [4], temperature=1.0, top_p=1.0, eos_ids={2}, pad_id=0)
    with pytest.raises(RuntimeError, match="failed earlier"):
        engine.generate(model, [[1, 2]], [4], temperature=1.0, top_p=1.0, eos_ids={2}, pad_id=0)
    with pytest.raises(RuntimeError, match="failed earlier"):
        engine.load(model)


def test_vllm_errors_name_the_key_and_the_extra() -> None:
    assert resolve_engine("auto", "cpu") == "hf"
    assert resolve_engine("auto", "cuda") == "static"  # vLLM is not installed here
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        make_engine("vllm", "cpu")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["backend.generation_engine=vllm"])
    with pytest.raises(ConfigError, match=r"backend\.generation_engine=vllm.*CUDA"):
        build_components(cfg)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["backend.generation_engine=vllm", "backend.device=cuda"])
    with pytest.raises(ConfigError, match=r"backend\.generation_engine=vllm.*pip install -e '\.\[vllm\]'"):
        build_components(cfg)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["backend.vllm_gpu_memory_utilization=1.5"])
    with pytest.raises(ConfigError, match=r"backend\.vllm_gpu_memory_utilization"):
        build_components(cfg)


class FakeEngineProcess(FakeLLM):
    """vLLM's engine core in a process of its own as VLLMProcessEngine uses it: weights arrive bucket by bucket through
    `collective_rpc` into the worker extension (inference/vllm_worker.py, run here on the fake's model), which
    records each bucket's weights; and the core steps by itself while its scheduler is not paused, here once before
    each call that reaches it (the real one steps on between two calls). Those steps' finished requests reach the
    engine thread with its next `step()`. `sleep(level=0, mode="keep")` pauses the scheduler, requests kept;
    `wake_up(tags=["scheduling"])` resumes it; paused, it gives nothing. `fail_at_bucket`: the bucket of that number
    (counting every bucket since it started, from 1) fails."""

    def __init__(self, vocab: int, events: list[Any]) -> None:
        from inference.vllm_worker import SharedWeights

        super().__init__(vocab)
        self.events = events
        self.paused = False
        self.outbox: list[Any] = []
        self.buckets = 0  # buckets loaded so far
        self.fail_at_bucket = 0
        self.loaded_weights: dict[str, torch.Tensor] = {}
        self.worker = SharedWeights()
        self.worker.model_runner = self.model_executor.driver_worker.worker.model_runner
        self.worker.model_runner.model.load_weights = self._load_bucket

    def _load_bucket(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.loaded_weights.update(weights)
        self.buckets += 1
        self.events.append(("load_weights", len(weights)))

    def _reached(self) -> None:
        if self.running and not self.paused:
            self.events.append(("core_step", self.buckets))
            self.outbox += FakeLLM.step(self)

    def step(self) -> list[Any]:
        if self.paused:
            return []
        out, self.outbox = self.outbox, []
        return out + super().step()

    def collective_rpc(self, method: str, args: tuple[Any, ...]) -> list[int]:
        self._reached()
        self.events.append(method)
        if self.buckets + 1 == self.fail_at_bucket:
            raise RuntimeError("the bucket failed in the engine process")
        return [getattr(self.worker, method)(*args)]

    def sleep(self, level: int, mode: str = "abort") -> None:
        self._reached()
        if (level, mode) == (0, "keep"):
            self.paused = True
            self.events.append(("pause",))
        else:
            super().sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        self._reached()
        super().wake_up(tags)
        self.paused = self.paused and "scheduling" not in tags

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self._reached()
        return super().reset_prefix_cache(reset_running_requests)


def engine_process(
    monkeypatch: pytest.MonkeyPatch, events: list[Any], engine_gpu: str = "GPU-0", **settings: Any
) -> tuple[VLLMEngine, list[FakeEngineProcess]]:
    """A VLLMProcessEngine on FakeEngineProcess, its weights in 40 kB buckets. CUDA IPC itself needs a GPU: here a
    tensor's "handle" is its values (the GPU run checks the real one: the sampler's log-probs match the trainer's);
    the handles shared are recorded in `events` as ("share", storage pointer); CUDA's synchronizations as events.
    The trainer's GPU is GPU-0, the engine process's `engine_gpu`."""
    import inference.vllm as vllm_module
    import inference.vllm_worker as worker_module

    monkeypatch.setattr(vllm_module, "gpu_uuid", lambda device: "GPU-0")
    monkeypatch.setattr(worker_module, "gpu_uuid", lambda device: engine_gpu)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def share(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
        events.append(("share", tensor.untyped_storage().data_ptr()))
        return torch.tensor, (tensor.tolist(),)

    monkeypatch.setattr(vllm_module, "share", share)
    monkeypatch.setattr(vllm_module, "IPC_BUCKET_BYTES", 40_000)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    stream = SimpleNamespace(synchronize=lambda: events.append("worker sync"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: events.append("ipc_collect"))
    engine, _ = fake_engine(own_process=True, **settings)
    started: list[FakeEngineProcess] = []
    engine._start = lambda model, s: started.append(FakeEngineProcess(300, events)) or started[-1]
    return engine, started


@pytest.mark.parametrize("lora", [False, True])
def test_an_engine_in_its_own_process_gets_every_weight_once_in_buckets(
    tiny, lora: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """backend.vllm_own_process: the weights cross to vLLM's engine process as handles, bucket by bucket, through
    collective_rpc into the worker extension; each bucket's tensors are finished on the GPU before their handles go,
    and no handle is of the trainer's own parameters (torch would keep a wrapper per share for the parameter's
    life): copies, or LoRA's merged copies."""
    model, _ = tiny
    if lora:
        model = get_peft_model(
            type(model)(model.config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
        )
    events: list[Any] = []
    engine, started = engine_process(monkeypatch, events)
    engine.load(model)
    engine.close()
    sent = dict(full_weights(model))
    assert started[0].loaded_weights.keys() == sent.keys()
    assert all(torch.equal(started[0].loaded_weights[k].to(t.dtype), t.cpu()) for k, t in sent.items())
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert [e for e in events if e[0] == "share" and e[1] in own] == []
    names = [e if isinstance(e, str) else e[0] for e in events if e[0] != "share"]
    buckets = names.count("load_shared_weights")
    assert buckets > 1  # the 40 kB buckets split the model
    assert names == ["sync", "load_shared_weights", "load_weights", "worker sync"] * buckets + [
        "ipc_collect",
        "reset_prefix_cache",
    ]
    assert sum(e[1] for e in events if isinstance(e, tuple) and e[0] == "load_weights") == len(sent)
    assert engine._llm is None  # its process ended with the engine thread: a later load starts a new one


def test_a_live_load_pauses_the_engine_process_so_no_token_comes_from_half_loaded_weights(
    tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Partial rollouts with backend.vllm_own_process: the engine process would step on between the load's buckets
    (sampling from weights half old, half new); the load pauses its scheduler first, the request kept, and resumes it
    after the cache reset, so the request's steps come before the first bucket or after the last; it then goes on
    under the new weights and its completion holds every token it sampled."""
    model, _ = tiny
    events: list[Any] = []
    engine, started = engine_process(monkeypatch, events, sleep=False, live_loads=True)
    engine.load(model)
    fake = started[0]
    fake.buckets = 0
    first = len(events)
    long, short = long_request_in_flight(engine, fake, lambda: engine.load(model))
    assert long.token_ids == [(3 + i) % 300 for i in range(20)] and long.finish_reason == "length"
    assert long.logprobs == [-0.5 - i / 100 for i in range(20)]
    assert short.token_ids == [2, 3, 4]
    live = [e for e in events[first:] if e[0] in ("pause", "load_weights", "reset_prefix_cache", "wake_up")]
    buckets = fake.buckets
    assert buckets > 1
    assert live == [("pause",)] + [("load_weights", e[1]) for e in live[1 : 1 + buckets]] + [
        ("reset_prefix_cache", True),
        ("wake_up", ("scheduling",)),
    ]
    core_steps = [e[1] for e in events[first:] if e[0] == "core_step"]
    assert all(n in (0, buckets) for n in core_steps)  # none while the weights were half loaded
    assert (engine.weight_loads, engine.live_loads) == (2, 1)
    engine.close()


def test_a_live_load_that_fails_breaks_the_engine_and_fails_its_requests(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket that fails leaves vLLM's engine process paused with its weights half loaded: nothing may go on from
    there, and nothing may wait for it. The load's caller, the request in flight and every later call get the
    error."""
    model, _ = tiny
    events: list[Any] = []
    engine, started = engine_process(monkeypatch, events, sleep=False, live_loads=True)
    engine.load(model)
    fake = started[0]

    def failing_load() -> None:
        fake.fail_at_bucket = fake.buckets + 2
        with pytest.raises(RuntimeError, match="bucket failed"):
            engine.load(model)

    async def go() -> None:
        long = await long_request_running(engine, fake)
        await asyncio.to_thread(failing_load)
        with pytest.raises(RuntimeError, match="bucket failed"):
            await long  # answered, not left waiting for a paused engine
        with pytest.raises(RuntimeError, match="failed earlier"):
            await engine.submit([1, 2], 3, temperature=1.0, top_p=1.0, eos_ids=set())

    fake.hold_long_until_adds = 2
    asyncio.run(asyncio.wait_for(go(), timeout=60))
    assert fake.paused and ("wake_up", ("scheduling",)) not in events  # never resumed on half-loaded weights
    engine.close()


def test_an_engine_process_on_another_gpu_than_the_trainers_is_refused(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handles would open on that GPU's context (a copy across GPUs at best): the worker names both GPUs instead,
    and the engine is broken."""
    model, _ = tiny
    engine, _ = engine_process(monkeypatch, [], engine_gpu="GPU-1")
    with pytest.raises(RuntimeError, match="runs on GPU GPU-1, the trainer's weights are on GPU-0"):
        engine.load(model)
    with pytest.raises(RuntimeError, match="failed earlier"):
        engine.load(model)
    engine.close()


def fake_rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """Stands in for torch's rebuild_cuda_tensor (pickled by name): a tensor holding the device it was opened on."""
    return torch.tensor([float(args[6])])


def test_a_shared_cuda_tensor_opens_on_the_engine_process_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer numbers its GPUs otherwise than the engine process, which sees only its own: a CUDA tensor's
    reduction is opened on the engine process's device (the 7th of torch's arguments is its device index); any other
    reduction is left as it is."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    import inference.vllm_worker as worker_module
    from inference.vllm_worker import SharedWeights, on_device

    assert list(inspect.signature(rebuild_cuda_tensor).parameters).index("storage_device") == 6
    args = tuple(range(15))
    assert on_device(rebuild_cuda_tensor, args, 0) == (0, 1, 2, 3, 4, 5, 0, *range(7, 15))
    assert on_device(torch.tensor, args, 0) == args
    monkeypatch.setattr(worker_module, "rebuild_cuda_tensor", fake_rebuild_cuda_tensor)
    monkeypatch.setattr(worker_module, "gpu_uuid", lambda device: "GPU-a")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(synchronize=lambda: None))
    loaded: list[tuple[str, torch.Tensor]] = []
    worker = SharedWeights()
    worker.model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=lambda weights: loaded.extend(weights)))
    sent_on_3 = (*range(6), 3, *range(7, 15))  # the trainer's GPU 3
    assert worker.load_shared_weights(pickle.dumps(("GPU-a", [("w", (fake_rebuild_cuda_tensor, sent_on_3))]))) == 1
    assert loaded[0][0] == "w" and loaded[0][1].tolist() == [0.0]  # opened on this process's device 0


@pytest.mark.parametrize("before", [None, "4,5,6,7"])
def test_the_engine_process_starts_on_the_ranks_gpu(tiny, monkeypatch: pytest.MonkeyPatch, before: str | None) -> None:
    """backend.vllm_own_process on several ranks: vLLM 0.20.2's engine process takes the first GPU it sees, so it
    starts with CUDA_VISIBLE_DEVICES narrowed to the rank's GPU (the settings' device, rank 2's here: the third GPU
    this process sees), and without torchrun's agent-store variable (its own process group would wait for a store
    nobody serves), both restored after, also after an error; the engine's thread runs on that GPU; the config allows
    it. The GPU itself: the trainer's UUID is its weights' GPU's."""
    import inference.vllm as vllm_module
    from backends.algorithm import GRPO
    from backends.trl.backend import TRLBackend
    from inference.vllm import AGENT_STORE_VARIABLE, VLLMProcessEngine, engine_process_environment

    model, _ = tiny
    if before is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", before)
    monkeypatch.setenv(AGENT_STORE_VARIABLE, "True")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the calling thread's: not the rank's
    built: list[tuple[str | None, str | None, dict[str, Any]]] = []

    def llm(**kwargs: Any) -> None:
        built.append((os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get(AGENT_STORE_VARIABLE), kwargs))

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=llm))
    settings = VLLMSettings(max_model_len=64, own_process=True, device="cuda:2")
    _start_llm(model, settings, executor=VLLMProcessEngine._executor)
    rank_gpu = "2" if before is None else "6"
    assert built[0][:2] == (rank_gpu, None)
    assert built[0][2]["worker_extension_cls"] == "inference.vllm_worker.SharedWeights"
    assert (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ[AGENT_STORE_VARIABLE]) == (before, "True")
    with pytest.raises(ValueError, match="while"), engine_process_environment(torch.device("cuda", 1)):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ("1" if before is None else "5")
        raise ValueError("while it starts")
    assert (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ[AGENT_STORE_VARIABLE]) == (before, "True")
    if before is not None:  # a GPU the variable does not list is named, and nothing is left changed
        with (
            pytest.raises(RuntimeError, match=r"GPU 9 .* lists fewer"),
            engine_process_environment(torch.device("cuda", 9)),
        ):
            pass
        assert (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ[AGENT_STORE_VARIABLE]) == (before, "True")

    devices: list[tuple[str, Any]] = []

    def set_device(device: Any) -> None:
        torch.cuda._utils._get_device_index(device)  # torch's own check: `cuda` alone is refused
        devices.append((threading.current_thread().name, device))

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    for rank_device in ("cuda:2", "cuda"):  # on several ranks; on one (the first GPU, a new thread's own)
        engine, started = engine_process(monkeypatch, [], engine_gpu="GPU-cpu", device=rank_device)
        monkeypatch.setattr(vllm_module, "gpu_uuid", lambda device: f"GPU-{device}")  # the tensors' GPU (the CPU)
        engine.load(model)
        engine.close()
        assert started[0].loaded_weights  # the UUIDs matched: the trainer's is its weights' GPU's
    assert devices == [("vllm-engine", torch.device("cuda", 2))]
    TRLBackend(vllm_own_process=True).check_settings(ranks=2, algo=GRPO())


STARTER = """
import multiprocessing, pathlib, sys, time

def engine(marker):
    import inference.vllm_worker  # as vLLM's worker does in its engine process (backend.vllm_own_process)
    pathlib.Path(marker).write_text("imported")
    time.sleep(300)

if __name__ == "__main__":
    name, marker = sys.argv[1], sys.argv[2]
    child = multiprocessing.get_context("spawn").Process(target=engine, args=(marker,), name=name)
    child.start()
    print(child.pid, flush=True)
    time.sleep(300)
"""


@pytest.mark.parametrize("name", ["EngineCore", "SomethingElse"])
def test_vllms_engine_process_ends_when_the_trainer_is_killed(tmp_path: Path, name: str) -> None:
    """An engine process left behind would hold its share of the GPU (the next run's vLLM would not start): importing
    inference/vllm_worker.py in vLLM's engine process ties it to its parent's life, even through a SIGKILL. A process
    of another name (the control: what any child does) lives on, and is ended here."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from tests.conftest import ROOT, wait_for

    marker, script = tmp_path / "marker", tmp_path / "starter.py"  # a file: spawn imports the target from it
    script.write_text(STARTER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    starter = subprocess.Popen(
        [sys.executable, str(script), name, str(marker)], stdout=subprocess.PIPE, text=True, env=env
    )
    child = psutil.Process(int(starter.stdout.readline()))
    try:
        wait_for(marker.exists, 120, "the child to import inference.vllm_worker")
        starter.send_signal(signal.SIGKILL)
        starter.wait(timeout=30)  # the kernel sends a parent-death signal as the parent exits: sent by now

        def ended() -> bool:
            try:
                return not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:  # reaped between the two questions
                return True

        if name == "EngineCore":
            wait_for(ended, 30, "the engine process to end after its parent was killed")
        else:
            assert not ended()
    finally:
        starter.kill()
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


async def long_request_running(engine: VLLMEngine, fake: FakeLLM) -> asyncio.Future[Any]:
    """A 20-token request (with `fake.hold_long_until_adds = 2` it cannot end before a second request comes), once
    the engine runs it (at most 30 s)."""
    long = asyncio.ensure_future(engine.submit([5, 6, 7], 20, temperature=1.0, top_p=1.0, eos_ids=set()))
    for _ in range(3000):
        await asyncio.sleep(0.01)
        if fake.running:
            break
    assert fake.running, "the engine never took the request"
    return long


def long_request_in_flight(engine: VLLMEngine, fake: FakeLLM, between: Any) -> tuple[Any, Any]:
    """A 20-token request that cannot end before a second request comes; `between()` runs (in a worker thread) once
    the engine runs it, then the second request is sent. Both completions."""

    async def go() -> tuple[Any, Any]:
        long = await long_request_running(engine, fake)
        await asyncio.to_thread(between)
        short = await engine.submit([1, 2], 3, temperature=1.0, top_p=1.0, eos_ids=set())
        return await long, short

    fake.hold_long_until_adds = 2
    return asyncio.run(asyncio.wait_for(go(), timeout=60))


def test_a_load_with_a_request_in_flight_preempts_it_and_it_goes_on_under_the_new_weights(tiny) -> None:
    """Partial rollouts (`live_loads`): the load runs on the engine thread between two steps with the request
    running; the cache reset preempts it (it resumes, recomputed), and its completion holds every token it sampled
    before the load and after."""
    model, _ = tiny
    engine, started = fake_engine(sleep=False, live_loads=True)  # asynchronous rollouts keep vLLM awake
    engine.load(model)
    fake = started[0]
    long, short = long_request_in_flight(engine, fake, lambda: engine.load(model))
    assert long.token_ids == [(3 + i) % 300 for i in range(20)] and long.finish_reason == "length"
    assert long.logprobs == [-0.5 - i / 100 for i in range(20)]
    assert short.token_ids == [2, 3, 4]
    events = [e[:2] if e[0] in ("add", "finish", "reset_prefix_cache") else e[:1] for e in fake.events]
    load = events.index(("load_weights",), events.index(("add", "0")))
    assert events[load + 1] == ("reset_prefix_cache", True)  # the running request preempted with the cache
    assert events.index(("finish", "0")) > events.index(("add", "1")) > load
    assert (engine.weight_loads, engine.live_loads) == (2, 1)
    assert fake.threads == {"vllm-engine"}  # loads and steps on one thread: never a load during a step
    engine.close()


def test_without_live_loads_a_load_with_a_request_in_flight_is_refused_and_the_request_goes_on(tiny) -> None:
    model, _ = tiny
    engine, started = fake_engine(sleep=False)
    engine.load(model)
    refused: list[str] = []

    def load() -> None:
        with pytest.raises(RuntimeError, match="1 requests are still running") as raised:
            engine.load(model)
        refused.append(str(raised.value))

    long, _ = long_request_in_flight(engine, started[0], load)
    assert len(refused) == 1 and len(long.token_ids) == 20 and engine.weight_loads == 1
    engine.close()


def test_a_failed_cache_reset_fails_the_load(tiny) -> None:
    """vLLM's reset returns False when it kept blocks: generating from them after new weights would be wrong."""
    model, _ = tiny
    engine, started = fake_engine()
    engine.load(model)
    started[0].reset_prefix_cache = lambda reset_running_requests=False: False  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="prefix cache reset failed"):
        engine.load(model)
    engine.close()


def test_live_loads_turn_asynchronous_scheduling_off_before_vllm_0_22(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.20.2's preemption at a cache reset drops a token of a request without one in flight under its
    asynchronous scheduling (vllm-project/vllm#42043, fixed in 0.22.0): off with live loads on such a vLLM, vLLM's
    own default otherwise."""
    model, _ = tiny
    built: list[dict[str, Any]] = []

    def start(version: str, **settings: Any) -> dict[str, Any]:
        fake = SimpleNamespace(LLM=lambda **kwargs: built.append(kwargs), __version__=version)
        monkeypatch.setitem(sys.modules, "vllm", fake)
        _start_llm(model, VLLMSettings(max_model_len=64, **settings), executor=lambda _: nullcontext({}))
        return built[-1]

    assert start("0.20.2", live_loads=True)["async_scheduling"] is False
    assert start("0.20.2", live_loads=True, own_process=True)["async_scheduling"] is False  # its engine process too
    assert "async_scheduling" not in start("0.20.2", live_loads=False)
    for fixed in ("0.22.0", "0.22.0+cu130", "0.23.1", "1.0.0"):
        assert "async_scheduling" not in start(fixed, live_loads=True)
    for before in ("0.21.0", "0.20.2+cu130", "0.22.0rc1", "0.22.0.dev5+g1234abc"):
        assert not preempts_exactly(before), before
