"""A trained reward model behind an HTTP API: the scorer, the FastAPI app that serves it, and the reward that asks it.

    POST /score        {prompt, response}              -> {score}
    POST /score-pair   {prompt, chosen, rejected}      -> {chosen_score, rejected_score, preferred}
    POST /get_reward   {query: [text, ...]}            -> {rewards: [...]}      (OpenRLHF's remote RM shape)
    GET  /health

Texts are scored as TRL's RewardTrainer saw them in training: prompt + response + EOS, cut to `max_length` tokens
(from the left, keeping the response). Requests arriving together are scored in one batch; if a batch fails, its
items are scored one by one, so one bad item fails only its own request. Malformed input (a missing field, a number
or NaN where text belongs, a lone UTF-16 surrogate, text over `MAX_TEXT_CHARS`) is a 422 with the reason, checked per
request before batching; the reply names the field and never echoes the input.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agent.trajectory import Trajectory
from foundation.schema import number

MAX_TEXT_CHARS = 100_000


Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]  # pydantic also refuses lone surrogates: no valid Unicode


class ScoreRequest(BaseModel):
    prompt: Text
    response: Text


class PairRequest(BaseModel):
    prompt: Text
    chosen: Text
    rejected: Text


class RewardRequest(BaseModel):
    query: list[Text] = Field(min_length=1, max_length=1024)


class Scorer:
    """Batched scoring with a sequence-classification reward model (one logit)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_length: int) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self._lock = threading.Lock()

    def text(self, prompt: str, response: str) -> str:
        eos = self.tokenizer.eos_token or ""
        return prompt + response + ("" if response.endswith(eos) else eos)

    @torch.no_grad()
    def score_texts(self, texts: list[str]) -> list[float]:
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"][-self.max_length :] for t in texts]
        width = max(len(i) for i in ids)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        attention = torch.zeros((len(ids), width), dtype=torch.long)
        for row, seq in enumerate(ids):  # right padding: the classifier reads the last non-pad token
            input_ids[row, : len(seq)] = torch.tensor(seq)
            attention[row, : len(seq)] = 1
        device = next(self.model.parameters()).device
        with self._lock:
            logits = self.model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
        return logits[:, 0].float().tolist()

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return self.score_texts([self.text(p, r) for p, r in zip(prompts, responses, strict=True)])


def create_app(scorer: Scorer, max_batch_size: int = 64, batch_wait_s: float = 0.005) -> FastAPI:
    """The HTTP API; requests that arrive within `batch_wait_s` of each other share one forward pass."""
    app = FastAPI(title="reward model")

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes the input, which fails to encode when it holds NaN or a surrogate (a 500).
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        return JSONResponse(status_code=422, content={"detail": errors})

    pending: list[tuple[str, asyncio.Future[float]]] = []
    running: set[asyncio.Task[None]] = set()  # keeps the flush tasks referenced until they finish
    flush_scheduled = False

    async def flush() -> None:
        nonlocal flush_scheduled
        await asyncio.sleep(batch_wait_s)
        flush_scheduled = False
        while pending:
            batch = [pending.pop(0) for _ in range(min(max_batch_size, len(pending)))]
            try:
                scores = await asyncio.to_thread(scorer.score_texts, [text for text, _ in batch])
                for (_, future), value in zip(batch, scores, strict=True):
                    future.set_result(value)
            except Exception as exc:
                if len(batch) == 1:
                    batch[0][1].set_exception(exc)
                    continue
                for text, future in batch:  # one bad item must not fail the others: each one apart
                    try:
                        (value,) = await asyncio.to_thread(scorer.score_texts, [text])
                        future.set_result(value)
                    except Exception as item_exc:
                        future.set_exception(item_exc)

    async def score_all(texts: list[str]) -> list[float]:
        nonlocal flush_scheduled
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in texts]
        pending.extend(zip(texts, futures, strict=True))
        if not flush_scheduled:
            flush_scheduled = True
            task = loop.create_task(flush())
            running.add(task)
            task.add_done_callback(running.discard)
        return list(await asyncio.gather(*futures))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "max_length": scorer.max_length}

    @app.post("/score")
    async def score(request: ScoreRequest) -> dict[str, float]:
        (value,) = await score_all([scorer.text(request.prompt, request.response)])
        return {"score": value}

    @app.post("/score-pair")
    async def score_pair(request: PairRequest) -> dict[str, Any]:
        chosen, rejected = await score_all(
            [scorer.text(request.prompt, request.chosen), scorer.text(request.prompt, request.rejected)]
        )
        return {
            "chosen_score": chosen,
            "rejected_score": rejected,
            "preferred": "chosen" if chosen >= rejected else "rejected",
        }

    @app.post("/get_reward")
    async def get_reward(request: RewardRequest) -> dict[str, list[float]]:
        return {"rewards": await score_all(list(request.query))}

    return app


@dataclass
class RewardModelReward:
    """Reward from a served reward model (`conf/reward/reward_model.yaml`); missing when the server is unreachable."""

    base_url: str
    name: str = "reward_model"
    timeout_s: float = number(30.0, gt=0)  # per request

    def __call__(self, task: dict[str, Any], trajectory: Trajectory) -> float | None:
        response = trajectory.answer if trajectory.answer is not None else trajectory.final_sql
        if response is None:
            return 0.0
        try:
            reply = httpx.post(
                self.base_url.rstrip("/") + "/score",
                json={"prompt": task["question"] + "\n", "response": response},
                timeout=self.timeout_s,
            )
            reply.raise_for_status()
        except httpx.HTTPError:
            return None
        return float(reply.json()["score"])
