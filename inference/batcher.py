"""The policy server's generation: one request at a time in, generated together with the other rollouts' requests.

- Requests from concurrent rollouts are generated together. A continuous engine (vLLM) gets each request the moment
  it arrives and adds it to its running batch. Any other engine gets batches: a batch starts when every active
  rollout is waiting on the model (or once no new request has come for `batch_wait_s`), so the agents of one
  training step share one `generate` call per turn. A request whose caller is gone (cancelled) is not generated for.
- The tokens, and each one's log-probability, come from a generation engine (`inference/`). `load(model)` before a
  rollout phase gives the engine the model's current weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from inference.engine import Completion, ContinuousEngine, Engine


@dataclass
class _Pending:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    future: asyncio.Future[Completion]


class Batcher:
    """Generates each request with `engine`: submitted at once to a continuous engine, batched for any other."""

    def __init__(
        self,
        engine: Engine | ContinuousEngine,
        model: PreTrainedModel | None,
        *,
        eos_ids: set[int],
        pad_id: int,
        max_batch_size: int = 256,
        batch_wait_s: float = 0.02,
    ) -> None:
        self.engine = engine
        self.model = model  # None: the engine holds the weights (it is never handed the model)
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.generate_calls = 0
        self._pending: list[_Pending] = []
        self._active: int | None = None
        self._busy = False
        self._timer: asyncio.TimerHandle | None = None
        self._batch_task: asyncio.Task[None] | None = None  # referenced so it is not collected mid-batch

    def load(self, model: PreTrainedModel) -> None:
        """Generate with `model`'s current weights (an engine that keeps its own copy gets them now)."""
        self.model = model
        self.engine.load(model)

    async def generate(
        self, prompt_ids: list[int], max_new_tokens: int, *, temperature: float, top_p: float
    ) -> Completion:
        """One request's completion, generated with the requests of the other rollouts."""
        if isinstance(self.engine, ContinuousEngine):
            return await self.engine.submit(
                prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p, eos_ids=self.eos_ids
            )
        pending = _Pending(prompt_ids, max_new_tokens, temperature, top_p, asyncio.get_running_loop().create_future())
        self._pending.append(pending)
        self._maybe_flush()
        return await pending.future

    @contextmanager
    def active_rollouts(self, count: int) -> Iterator[None]:
        """Know how many rollouts are running, so a batch starts as soon as all of them are waiting."""
        self._active = count
        try:
            yield
        finally:
            self._active = None

    def rollout_finished(self) -> None:
        if self._active is not None:
            self._active -= 1
            self._maybe_flush()

    def _maybe_flush(self) -> None:
        if self._busy or not self._pending:
            return
        if self._active is not None and len(self._pending) >= self._active:
            self._start_batch()
            return
        if self._timer is not None:  # a new arrival restarts the wait: rollouts still starting up join this batch
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self.batch_wait_s, self._start_batch)

    def _start_batch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # a request whose caller is gone (cancelled: a stop signal ends the rollouts) is not generated for; without
        # this, every cancelled batch's end started the next, and a stopped run generated its whole queue first
        self._pending = [item for item in self._pending if not item.future.done()]
        if self._busy or not self._pending:
            return
        batch, self._pending = self._pending[: self.max_batch_size], self._pending[self.max_batch_size :]
        self._busy = True
        self._batch_task = asyncio.get_running_loop().create_task(self._run_batch(batch))

    async def _run_batch(self, batch: list[_Pending]) -> None:
        try:
            results = await asyncio.to_thread(self._generate, batch)
            for item, result in zip(batch, results, strict=True):
                if not item.future.done():  # its caller may have been cancelled meanwhile
                    item.future.set_result(result)
        except Exception as exc:
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
        finally:
            self._busy = False
            self._maybe_flush()

    @torch.no_grad()
    def _generate(self, batch: list[_Pending]) -> list[Completion]:
        """Generate for a batch, one `generate` call per distinct sampling setting."""
        results: list[Completion | None] = [None] * len(batch)
        groups: dict[tuple[float, float], list[int]] = {}
        for i, item in enumerate(batch):
            groups.setdefault((item.temperature, item.top_p), []).append(i)
        was_training = self.model.training
        self.model.eval()
        try:
            for (temperature, top_p), indices in groups.items():
                outputs = self._generate_group([batch[i] for i in indices], temperature, top_p)
                for i, output in zip(indices, outputs, strict=True):
                    results[i] = output
        finally:
            self.model.train(was_training)
        self.generate_calls += len(groups)
        return [r for r in results if r is not None]

    def _generate_group(self, items: list[_Pending], temperature: float, top_p: float) -> list[Completion]:
        return self.engine.generate(
            self.model,
            [item.prompt_ids for item in items],
            [item.max_new_tokens for item in items],
            temperature=temperature,
            top_p=top_p,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
        )
