"""`VLLMEngine`: vLLM's engine inside the training process (colocated, as TRL's `vllm_mode="colocate"`).

- Token ids in, token ids and log-probs out: prompts are `TokensPrompt`s and vLLM has no tokenizer
  (`skip_tokenizer_init`); the sampled token's log-prob comes after the temperature (`logprobs_mode=
  "processed_logprobs"`, the engine contract of `inference/engine.py`); the checkpoint's generation_config is ignored
  (`generation_config="vllm"`), so the request's temperature and top_p are what sample; eos ids are the request's.
  With top_p < 1 vLLM's processed log-probs are renormalized over the nucleus (the static and HF engines report the
  full distribution's): training samples with top_p = 1, where both agree.
- Continuous batching: `submit` hands one request to the engine thread the moment an agent sends it; the thread adds
  it to vLLM's running batch before the next `step()` (a decode step for the running requests, prefill chunks for the
  new ones) and returns each finished request to its waiting coroutine. No request waits for another turn to end.
- Prefix caching: every turn re-sends the conversation and every group shares its task prompt; vLLM's prefix cache
  keeps those blocks. It is reset after every weight load (blocks computed with the old weights are stale). A
  completion's `prefilled` is its prompt less the tokens vLLM served from that cache (`num_cached_tokens`).
- With `live_loads` (partial rollouts, `algorithm.partial_rollouts`) a load may come while requests are in flight:
  it runs on the engine thread between two engine steps, and the running requests are preempted with the cache
  (`reset_prefix_cache(reset_running_requests=True)`) and resume under the new weights, their prompt and the tokens
  sampled so far recomputed; every token keeps the log-prob it was sampled with. An engine core in its own process
  (`own_process`) steps by itself, also between a load's buckets: its scheduler is paused for the load (vLLM's
  `sleep(level=0, mode="keep")`, which returns once no step is in flight; requests stay) and resumed after the reset
  (`wake_up(tags=["scheduling"])`), so no token is sampled from half-loaded weights. Before vLLM 0.22.0 its
  asynchronous scheduling is then off: there that preemption drops the next token of a request that had none in
  flight while the model still reads it (vllm-project/vllm#42043, fixed by #42117 in 0.22.0, which keeps vLLM's
  default). The recomputation is mostly not in
  `prefilled` (a preempted request's is not). Without `live_loads` a load with requests in flight is refused.
- Weights: vLLM starts with dummy weights built from the model's config; `load(model)` copies the trainer's current
  weights in through vLLM's own `load_weights` (the checkpoint's names and its q/k/v, gate/up stacking), before every
  rollout phase (`inference/weights.py`). LoRA: each adapted weight is sent merged, W + B·A·scaling computed into a
  copy; the trainer's weights are never touched (merging and unmerging in place in bf16 would drift
  them a little every step). Merged weights rather than vLLM's LoRA adapters because generation then runs plain
  matrix products, as with full fine-tuning; the price is sending the full weights once per step, device to device.
- Process: by default vLLM's engine runs inside this process (vLLM's external launcher, as TRL's colocate mode), its
  scheduler and model runner sharing the trainer's Python interpreter lock. With `own_process` (`VLLMProcessEngine`,
  which `vllm_engine` builds) its engine core runs in a process of its own on the same GPU (vLLM's multiprocess
  engine), and a weight load sends CUDA IPC handles of the trainer's tensors (`inference/vllm_worker.py` loads them
  there, in buckets of `IPC_BUCKET_BYTES`): generation then competes with the update for the GPU only, not for the
  interpreter (asynchronous rollouts). On several ranks each rank's engine process starts seeing only that rank's GPU
  (`engine_process_environment`: vLLM 0.20.2's takes the first it sees; torchrun's store variable left out), opens
  the handles on it and checks by UUID that it is the trainer's. The engine thread runs on the rank's GPU
  (`VLLMSettings.device`; on one GPU, the first).
- Memory: vLLM takes `gpu_memory_utilization` of the GPU for its weights and KV cache. With `sleep`, `sleep()` after a
  rollout phase frees all of it (level 2: weights and KV cache), so the update has it; the next `load` wakes vLLM.

One thread owns vLLM: it is created, stepped, loaded, put to sleep and woken there, so nothing else touches it
concurrently. Installed by the `vllm` extra (pinned to the set verified on the GPU machine: README, "Versions").
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import itertools
import logging
import os
import pickle
import queue
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from packaging.version import Version
from transformers import PreTrainedModel

from inference.engine import Completion, finish
from inference.vllm_worker import gpu_uuid
from inference.weights import full_weights

log = logging.getLogger(__name__)

IPC_BUCKET_BYTES = 1 << 30  # backend.vllm_own_process: weights sent per call to the engine process
ASYNC_PREEMPTION_FIXED = "0.22.0"  # the first vLLM release with vllm-project/vllm#42117 (fixes #42043)


def share(tensor: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    """A CUDA tensor as another process rebuilds it without a copy: torch.multiprocessing's reduction (IPC handles)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(tensor)


# torchrun's: a rank's process group connects to the agent's store. vLLM's engine process, a new process group of
# one on a port of its own, would inherit it and wait for a store nobody serves (pytorch/pytorch#192113)
AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"


@contextlib.contextmanager
def engine_process_environment(device: torch.device) -> Iterator[None]:
    """The environment a vLLM engine process started meanwhile inherits (this process's own CUDA is started already
    and keeps every GPU); restored after: CUDA_VISIBLE_DEVICES narrowed to `device` (as this process numbers its GPUs;
    no index: the current one), and torchrun's AGENT_STORE_VARIABLE unset. Without CUDA, the variable alone."""
    before = {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", AGENT_STORE_VARIABLE)}
    try:
        os.environ.pop(AGENT_STORE_VARIABLE, None)
        if device.type == "cuda" and torch.cuda.is_available():
            index = torch.cuda.current_device() if device.index is None else device.index
            visible = (before["CUDA_VISIBLE_DEVICES"] or "").split(",")
            if visible != [""] and index >= len(visible):
                raise RuntimeError(f"GPU {index} for vLLM's engine process: CUDA_VISIBLE_DEVICES={visible} lists fewer")
            os.environ["CUDA_VISIBLE_DEVICES"] = visible[index] if visible != [""] else str(index)
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


INSTALL_HINT = "pip install -e '.[vllm]' -c constraints-vllm.txt"


def vllm_available() -> bool:
    """True when vLLM can be imported here (it is not installed on CPU machines)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def require_vllm(device: str) -> None:
    """Raise a clear error when vLLM cannot run here: no CUDA device, or the extra is not installed."""
    if not device.startswith("cuda"):
        raise RuntimeError(f"the vLLM engine needs a CUDA device (backend.device resolves to {device!r})")
    if not vllm_available():
        raise RuntimeError(f"the vLLM engine needs vLLM, which is not installed: {INSTALL_HINT}")


@dataclass
class VLLMSettings:
    max_model_len: int  # the longest sequence: a rollout's first prompt + its whole response budget
    gpu_memory_utilization: float = 0.5  # share of the GPU's memory vLLM takes for weights and KV cache
    max_num_seqs: int = 256  # requests decoded together at most
    prefix_caching: bool = True  # reuse KV blocks of shared prefixes (turns re-send the conversation)
    sleep: bool = True  # free vLLM's GPU memory during the update (sleep level 2); woken by the next load
    enforce_eager: bool = False  # no CUDA graphs, no torch.compile (faster start, slower decode)
    own_process: bool = False  # vLLM's engine core in a process of its own (`vllm_engine`: a VLLMProcessEngine)
    max_num_batched_tokens: int = 8192  # tokens per engine step (prefill chunks + decodes)
    seed: int = 0
    dtype: torch.dtype | None = None  # the weights' dtype in vLLM (None: the model's; FSDP2 trains fp32 masters)
    live_loads: bool = False  # a load may come with requests in flight (partial rollouts; module docstring)
    device: str = "cuda"  # the trainer's GPU on this rank (cuda:1): the engine thread's, and its own process's


@dataclass
class _Request:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    eos_ids: set[int]
    done: Callable[[Completion | BaseException], None]


def _start_llm(
    model: PreTrainedModel,
    settings: VLLMSettings,
    executor: Callable[[torch.device], contextlib.AbstractContextManager[dict[str, Any]]],
) -> Any:
    """vLLM's `LLM` for `model`'s architecture, dummy weights (the first `load` sends the real ones); `executor`,
    given the settings' device, prepares where the engine runs while `LLM` starts and gives it the arguments that say
    so."""
    from vllm import LLM

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dtype = settings.dtype or next(base.parameters()).dtype
    config_dir = tempfile.mkdtemp(prefix="vllm-config-")
    config = copy.deepcopy(base.config)
    # a model built from a config has none; vLLM picks its class by it (FSDP2 renames a sharded model's class)
    config.architectures = [architecture(base)]
    config.save_pretrained(config_dir)
    with executor(torch.device(settings.device)) as where:
        return LLM(
            model=config_dir,
            runner="generate",
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=dtype,
            max_model_len=settings.max_model_len,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=max(settings.max_num_batched_tokens, settings.max_model_len),
            enable_prefix_caching=settings.prefix_caching,
            enable_sleep_mode=settings.sleep,
            enforce_eager=settings.enforce_eager,
            **where,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            seed=settings.seed,
            # vLLM's own default (on where its executor allows it) unless loads come mid-batch on a vLLM whose
            # preemption then drops a token (module docstring)
            **({"async_scheduling": False} if settings.live_loads and not preempts_exactly(vllm_version()) else {}),
        )


def vllm_version() -> str:
    """The installed vLLM's version."""
    import vllm

    return vllm.__version__


def preempts_exactly(version: str) -> bool:
    """Whether vLLM `version` keeps every token of a request preempted at a cache reset under its asynchronous
    scheduling: releases before 0.22.0 drop the next token of a request that had none in flight (vllm#42043); its
    release candidates and dev builds are not known to have the fix, and count as before it."""
    return Version(version) >= Version(ASYNC_PREEMPTION_FIXED)


def architecture(model: PreTrainedModel) -> str:
    """The model's class name as its checkpoint names it (`Qwen2ForCausalLM`), also when FSDP2 has sharded it (its
    class is then `FSDPQwen2ForCausalLM`, a subclass)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def _sampling_params(request: _Request) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    greedy = request.temperature <= 0
    stop_ids = sorted(t for t in request.eos_ids if t >= 0)  # a negative id (no token has it) stops nothing
    return SamplingParams(
        max_tokens=request.max_new_tokens,
        temperature=0.0 if greedy else request.temperature,
        top_p=1.0 if greedy else request.top_p,
        top_k=0,
        stop_token_ids=stop_ids,
        ignore_eos=not stop_ids,  # no eos ids: run to the budget (benchmarks)
        logprobs=0,  # the sampled token's own log-prob
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


class VLLMEngine:
    """vLLM in this process, continuously batched; see the module docstring."""

    name = "vllm"

    def __init__(
        self,
        settings: VLLMSettings,
        start: Callable[[PreTrainedModel, VLLMSettings], Any] | None = None,
        sampling_params: Callable[[_Request], Any] = _sampling_params,
    ) -> None:
        if settings.own_process != isinstance(self, VLLMProcessEngine):  # the class is what runs it: vllm_engine picks
            raise ValueError(
                f"VLLMSettings.own_process={settings.own_process}: build it with vllm_engine(settings), "
                f"not {type(self).__name__}"
            )
        self.settings = settings
        # builds the LLM (the tests pass a fake one)
        self._start = start or functools.partial(_start_llm, executor=self._executor)
        self._sampling_params = sampling_params
        self._llm: Any = None
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._pending: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._asleep = False
        self._broken: BaseException | None = None
        self._lock = threading.Lock()  # a command is queued before the engine breaks, or refused: never stranded
        self._thread: threading.Thread | None = None
        self.weight_loads = 0
        # weight loads with requests in flight (partial rollouts): those resumed under them (a request vLLM finished
        # whose output this thread had not read yet counts as in flight)
        self.live_loads = 0
        self.steps = 0  # engine steps run (each a decode step of the running batch, with any prefill chunks)
        self.max_running = 0  # the most requests in flight at once

    # ---- the engine interface ----------------------------------------------------------------------------------
    def load(self, model: PreTrainedModel) -> None:
        """Start vLLM (the first time), wake it, and copy `model`'s current weights in; with `live_loads`, requests
        in flight resume under them (module docstring)."""
        self._call(lambda: self._load(model), while_running=self.settings.live_loads)

    def sleep(self) -> None:
        """Free vLLM's weights and KV cache for the update (with `settings.sleep`); the next `load` wakes it."""
        if self.settings.sleep and self._llm is not None:
            self._call(self._sleep)

    def release(self) -> None:
        """What vLLM holds on the GPU is freed by sleeping; the engine itself stays (restarting it costs a minute)."""
        self.sleep()

    async def submit(
        self, prompt_ids: list[int], max_new_tokens: int, *, temperature: float, top_p: float, eos_ids: set[int]
    ) -> Completion:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Completion] = loop.create_future()

        def done(result: Completion | BaseException) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's event loop has closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, future, result)

        request = _Request(list(prompt_ids), max_new_tokens, temperature, top_p, set(eos_ids), done)
        request_id = str(next(self._ids))
        self._send(lambda: self._add(request_id, request))
        try:
            return await future
        except asyncio.CancelledError:  # the agent gave up on this call: stop generating for it
            with contextlib.suppress(RuntimeError):  # a broken engine runs nothing to abort
                self._send(lambda: self._abort(request_id))
            raise

    def generate(
        self,
        model: PreTrainedModel,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        *,
        temperature: float,
        top_p: float,
        eos_ids: set[int],
        pad_id: int,
    ) -> list[Completion]:
        """All prompts submitted at once; the weights are the last `load`'s (the model argument is not read)."""
        futures: list[Future[Completion]] = []
        for prompt, max_new in zip(prompts, max_new_tokens, strict=True):
            future: Future[Completion] = Future()
            request = _Request(list(prompt), max_new, temperature, top_p, set(eos_ids), _resolver(future))
            request_id = str(next(self._ids))
            self._send(lambda r=request, i=request_id: self._add(i, r))
            futures.append(future)
        return [f.result() for f in futures]

    def close(self) -> None:
        """Stop the engine thread once the requests in flight are answered (vLLM is freed with the process; an engine
        in its own process ends with the thread that started it: inference/vllm_worker.py)."""
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout=60)
            self._thread = None
        for request in self._pending.values():
            request.done(RuntimeError("the vLLM engine was closed"))
        self._pending.clear()

    # ---- the engine thread --------------------------------------------------------------------------------------
    def _send(self, command: Callable[[], None]) -> None:
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(f"the vLLM engine failed earlier: {self._broken!r}") from self._broken
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
                self._thread.start()
            self._inbox.put(command)

    def _call(self, fn: Callable[[], None], while_running: bool = False) -> None:
        """Run `fn` on the engine thread, between two steps, and wait for it (sleep: only while no request is in
        flight; a weight load, `while_running`, also with requests in flight). A refused call leaves the engine as it
        was; `fn` failing leaves vLLM in an unknown state (weights half loaded, an engine process paused), so it
        breaks the engine: its error goes to the caller, to every running request and to every later call."""
        future: Future[None] = Future()

        def command() -> None:
            try:
                if self._broken is not None:
                    raise RuntimeError(f"the vLLM engine failed earlier: {self._broken!r}") from self._broken
                if self._pending and not while_running:
                    raise RuntimeError(f"{len(self._pending)} requests are still running")
            except RuntimeError as exc:
                future.set_exception(exc)
                return
            try:
                fn()
            except BaseException as exc:
                future.set_exception(exc)
                raise  # _run fails the engine
            future.set_result(None)

        self._send(command)
        future.result()

    def _run(self) -> None:
        try:
            device = torch.device(self.settings.device)
            if device.type == "cuda" and device.index is not None and torch.cuda.is_available():
                torch.cuda.set_device(device)  # a new thread's current GPU is the first one (`cuda`'s)
        except BaseException as exc:
            self._fail(exc)
            return
        while True:
            try:  # take every command that arrived before stepping; block only when nothing runs
                command = self._inbox.get_nowait() if self._pending else self._inbox.get()
            except queue.Empty:
                command = self._step
            if command is None:
                return
            try:
                command()
            except BaseException as exc:  # vLLM is in an unknown state: fail what runs and what comes
                self._fail(exc)
                return

    def _fail(self, exc: BaseException) -> None:
        """Mark the engine broken, fail every running request and every command still queued."""
        with self._lock:  # a command sent from now on is refused; every one sent before is in the inbox
            self._broken = exc
        pending, self._pending = list(self._pending.values()), {}
        for request in pending:
            request.done(exc)
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command is not None:
                with contextlib.suppress(BaseException):
                    command()  # an _add answers its request with the error; a _call its waiter

    def _add(self, request_id: str, request: _Request) -> None:
        try:
            if self._broken is not None:
                raise RuntimeError(f"the vLLM engine failed earlier: {self._broken!r}") from self._broken
            if self._llm is None or self._asleep:
                raise RuntimeError("the vLLM engine has no weights loaded: call load(model) first")
            prompt = {"prompt_token_ids": request.prompt_ids}  # vLLM's TokensPrompt
            self._llm.llm_engine.add_request(request_id, prompt, self._sampling_params(request))
        except Exception as exc:
            request.done(exc)
            return
        self._pending[request_id] = request
        self.max_running = max(self.max_running, len(self._pending))

    def _abort(self, request_id: str) -> None:
        if self._pending.pop(request_id, None) is not None:
            self._llm.llm_engine.abort_request([request_id], internal=False)

    def _step(self) -> None:
        outputs = self._llm.llm_engine.step()  # raising here fails the engine (_run)
        self.steps += 1
        for output in outputs:
            if output.finished and output.request_id in self._pending:
                request = self._pending.pop(output.request_id)
                request.done(_completion(output, request))

    def _load(self, model: PreTrainedModel) -> None:
        if self._llm is None:
            self._llm = self._start(model, self.settings)
        elif self._asleep:
            torch.cuda.empty_cache()  # what the trainer's allocator cached goes back before vLLM takes it again
            self._llm.wake_up(tags=["weights"])
        live = bool(self._pending)
        if live:
            self._hold()
        self._load_weights(model)
        if self._asleep:
            self._llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        # blocks computed with the previous weights; requests in flight are preempted, to be recomputed as they resume
        if self._llm.reset_prefix_cache(reset_running_requests=live) is False:
            raise RuntimeError("vLLM kept blocks computed with the previous weights (its prefix cache reset failed)")
        if live:
            self._release_hold()
        self.weight_loads += 1
        self.live_loads += live

    def _hold(self) -> None:
        """No engine step until `_release_hold`: here every step is the engine thread's, which is loading."""

    def _release_hold(self) -> None:
        """Steps go on (`_hold`)."""

    @staticmethod
    @contextlib.contextmanager
    def _executor(device: torch.device) -> Iterator[dict[str, Any]]:
        """One process, one engine: vLLM's external launcher runs the engine in this process (so its model is
        reachable for load_weights), on this rank's GPU; it reads the torchrun variables, defaulted here for a single
        process."""
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        yield {"distributed_executor_backend": "external_launcher"}

    def _load_weights(self, model: PreTrainedModel) -> None:
        """`model`'s weights into vLLM's model, which runs in this process."""
        runner = self._llm.llm_engine.model_executor.driver_worker.worker.model_runner
        runner.model.load_weights(weights=full_weights(model))

    def _sleep(self) -> None:
        if not self._asleep:
            self._llm.sleep(level=2)
            self._asleep = True


class VLLMProcessEngine(VLLMEngine):
    """vLLM with its engine core in a process of its own on the same GPU (`backend.vllm_own_process`); the weights
    cross as CUDA IPC handles. See the module docstring."""

    @staticmethod
    @contextlib.contextmanager
    def _executor(device: torch.device) -> Iterator[dict[str, Any]]:
        """vLLM's multiprocess engine, its GPU worker extended to load weights from handles, started on `device`
        (vLLM 0.20.2's engine process takes the first GPU it sees: it sees only that one)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        with engine_process_environment(device):
            yield {"worker_extension_cls": "inference.vllm_worker.SharedWeights"}

    def close(self) -> None:
        super().close()
        self._llm = None  # its process ended with the engine thread (an engine that failed stays broken)

    def _hold(self) -> None:
        """The engine process steps by itself: its scheduler paused, requests kept; returns once no step is in
        flight (vLLM's level-0 sleep, mode "keep")."""
        self._llm.sleep(level=0, mode="keep")

    def _release_hold(self) -> None:
        self._llm.wake_up(tags=["scheduling"])

    def _load_weights(self, model: PreTrainedModel) -> None:
        """The weights to vLLM's engine process as CUDA IPC handles, in buckets of about IPC_BUCKET_BYTES (a LoRA
        layer's merged copy lives until its bucket is loaded); each bucket is loaded when the call returns."""
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        # a parameter is shared through a copy: torch wraps a storage anew each time it is shared, for as long as
        # the storage lives, so sharing the trainer's own parameters every step would pile those wrappers up
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        for name, tensor in full_weights(model):
            bucket.append((name, tensor.clone() if tensor.untyped_storage().data_ptr() in own else tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= IPC_BUCKET_BYTES:
                self._send_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            self._send_bucket(bucket)
        torch.cuda.ipc_collect()  # what the engine process no longer holds is freed here

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        gpu = bucket[0][1].device  # every tensor of a rank is on its GPU
        torch.cuda.synchronize(gpu)  # the tensors (copies, merged copies, gathers) are written, on any stream
        payload = pickle.dumps((gpu_uuid(gpu), [(name, share(tensor)) for name, tensor in bucket]))
        self._llm.collective_rpc("load_shared_weights", args=(payload,))


def vllm_engine(settings: VLLMSettings, **kwargs: Any) -> VLLMEngine:
    """The vLLM engine `settings` describe: in this process, or with `own_process` in a process of its own."""
    return (VLLMProcessEngine if settings.own_process else VLLMEngine)(settings, **kwargs)


def _completion(output: Any, request: _Request) -> Completion:
    sample = output.outputs[0]
    ids = list(sample.token_ids)
    logprobs = None
    if sample.logprobs is not None:
        logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs, ids, strict=True)]
    # the prompt tokens vLLM computed: those its prefix cache did not hold when the request was first scheduled
    # (`num_cached_tokens`, None or -1 before then; a preempted request's recomputation is not in it)
    cached = max(0, output.num_cached_tokens or 0)
    return finish(ids, request.max_new_tokens, request.eos_ids, logprobs, prefilled=len(request.prompt_ids) - cached)


def _settle(future: asyncio.Future[Completion], result: Completion | BaseException) -> None:
    if future.done():  # cancelled meanwhile
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _resolver(future: Future[Completion]) -> Callable[[Completion | BaseException], None]:
    def done(result: Completion | BaseException) -> None:
        with contextlib.suppress(Exception):  # already settled
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    return done
