"""`HFGenerate`: transformers' `model.generate` on one padded batch; any model, any device. What TRL itself does."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel

from inference.engine import Completion, finish


class HFGenerate:
    """`model.generate` on one left-padded batch (dynamic cache, the model's attention implementation); each sampled
    token's log-probability from the step's raw logits scaled by the temperature."""

    name = "hf"

    def load(self, model: PreTrainedModel) -> None:
        """Nothing to do: every call reads the model's weights."""

    def sleep(self) -> None:
        """Nothing is kept between calls."""

    def release(self) -> None:
        """Nothing is kept between calls."""

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
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        device = next(model.parameters()).device
        sampling: dict[str, Any] = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
        if temperature <= 0:
            sampling = {"do_sample": False}
        recorder = _LogprobRecorder(temperature if temperature > 0 else 1.0)
        tokens = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            max_new_tokens=max(max_new_tokens),
            pad_token_id=pad_id,
            eos_token_id=sorted(eos_ids),
            repetition_penalty=1.0,  # sample from the policy itself, whatever the checkpoint's generation_config says
            logits_processor=LogitsProcessorList([recorder]),
            **sampling,
        )[:, width:]
        logprobs = recorder.finish(tokens[:, -1]).tolist()
        rows = zip(tokens.tolist(), max_new_tokens, logprobs, prompts, strict=True)
        # every prompt prefilled whole: nothing is cached between calls
        return [finish(ids, n, eos_ids, lps, prefilled=len(p)) for ids, n, lps, p in rows]


class _LogprobRecorder(LogitsProcessor):
    """Records log p(token) under logits / temperature for each sampled token, one step late (a processor sees the
    logits before the token is drawn, and the drawn token at the next step). Runs before transformers' warpers, so it
    sees the model's logits; keeps one step's row per sequence, not the whole history `output_logits` would."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.steps: list[torch.Tensor] = []
        self.previous: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self.steps.append(self.previous.gather(1, input_ids[:, -1:])[:, 0])
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """(batch, steps) log-probs, given the last step's tokens."""
        assert self.previous is not None, "generate ran no step"
        self.steps.append(self.previous.gather(1, last_tokens[:, None])[:, 0])
        return torch.stack(self.steps, dim=1).cpu()
