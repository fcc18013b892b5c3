"""Generation engines behind the policy server: token id prompts in, sampled completions out.

- `HFGenerate`: `model.generate` (transformers), one padded batch; any model, any device. What TRL itself does.
- `StaticGenerate`: a decode loop of its own for Llama-style decoders (Qwen2, Qwen3, Llama): a static KV cache
  allocated once, the prompt prefilled in one pass, then one token per step. On CUDA each decode step is captured as
  a CUDA graph (one per batch bucket and attended length), so a step costs one graph launch instead of hundreds of
  kernel launches from Python. It calls the model's own modules (norms, projections, MLP, rotary embedding, LoRA
  layers included), so it computes what the model computes; the trainer's log-probabilities still come from the
  model's own forward. Other architectures, sliding-window or length-dependent rotary models go to `HFGenerate`.

The graphs read the parameters where they are, so in-place optimizer updates are seen by the next rollout; a
different model object (or reallocated weights) drops the graphs and the cache.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from transformers import PreTrainedModel

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str  # "stop" (ended with an eos id) or "length"
    logprobs: list[float] | None = None  # log p of each token under the sampling temperature (StaticGenerate)


class Engine(Protocol):
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
    ) -> list[Completion]: ...


def _finish(ids: list[int], max_new: int, eos_ids: set[int], logprobs: list[float] | None = None) -> Completion:
    """Cut a row at its own budget and at its first eos id (kept, as the model produced it)."""
    ids = ids[:max_new]
    stop = next((k for k, t in enumerate(ids) if t in eos_ids), None)
    end = len(ids) if stop is None else stop + 1
    lps = None if logprobs is None else logprobs[:end]
    return Completion(ids[:end], "length" if stop is None else "stop", lps)


class HFGenerate:
    """`model.generate` on one left-padded batch (dynamic cache, the model's attention implementation)."""

    name = "hf"

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
        generated = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            max_new_tokens=max(max_new_tokens),
            pad_token_id=pad_id,
            eos_token_id=sorted(eos_ids),
            **sampling,
        )[:, width:].tolist()
        return [_finish(ids, n, eos_ids) for ids, n in zip(generated, max_new_tokens, strict=True)]


@dataclass
class _Layout:
    """Where a Llama-style decoder keeps its parts (a PEFT model's LoRA layers included), and its attention shape."""

    embed: nn.Module
    layers: list[nn.Module]
    norm: nn.Module
    lm_head: nn.Module
    rotary: nn.Module
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scaling: float


def _layout(model: PreTrainedModel) -> _Layout | None:
    """The decoder's parts, or None when StaticGenerate does not support the model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    decoder = getattr(base, "model", None)
    if config.model_type not in SUPPORTED_MODEL_TYPES or decoder is None or not hasattr(decoder, "rotary_emb"):
        return None
    rope_type = getattr(decoder.rotary_emb, "rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":  # rotary frequencies that depend on the length
        return None
    attn = decoder.layers[0].self_attn
    if any(getattr(layer.self_attn, "sliding_window", None) for layer in decoder.layers):
        return None
    head_dim = attn.head_dim
    return _Layout(
        embed=decoder.embed_tokens,
        layers=list(decoder.layers),
        norm=decoder.norm,
        lm_head=base.get_output_embeddings(),
        rotary=decoder.rotary_emb,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        scaling=attn.scaling,
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Decoder:
    """The forward pass over a static cache. `cache[l]` holds keys and values: (2, batch, kv_heads, capacity, dim)."""

    def __init__(self, layout: _Layout, cache: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.m = layout
        self.cache = cache
        self.cos, self.sin = cos, sin  # (capacity, dim), indexed by position

    def _qkv(self, attn: nn.Module, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Projections of x (batch, seq, hidden) with rotary at positions pos (batch, seq): (batch, heads, seq, dim)."""
        b, s, _ = x.shape
        d = self.m.head_dim
        q = attn.q_proj(x).view(b, s, -1, d)
        k = attn.k_proj(x).view(b, s, -1, d)
        v = attn.v_proj(x).view(b, s, -1, d)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _layer(self, i: int, x: torch.Tensor, attend: Any) -> torch.Tensor:
        layer = self.m.layers[i]
        h = layer.input_layernorm(x)
        h = attend(i, layer.self_attn, h)
        x = x + layer.self_attn.o_proj(h)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.m.lm_head(self.m.norm(x)).float()

    def prefill(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, rows: slice) -> torch.Tensor:
        """Prompt pass for cache rows `rows`: ids, pos (batch, width); allowed (batch, 1, width, width). Last logits."""
        width = ids.shape[1]
        groups = self.m.n_heads // self.m.n_kv_heads

        def attend(i: int, attn: nn.Module, h: torch.Tensor) -> torch.Tensor:
            q, k, v = self._qkv(attn, h, pos)
            self.cache[i][0, rows, :, :width] = k
            self.cache[i][1, rows, :, :width] = v
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.m.scaling)
            return out.transpose(1, 2).reshape(h.shape[0], width, -1)

        x = self.m.embed(ids)
        for i in range(len(self.m.layers)):
            x = self._layer(i, x, attend)
        return self._logits(x[:, -1])

    def decode(self, tok: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """One token per row: tok, pos (batch,) at cache index slot (1,); allowed (batch, 1, 1, span). Logits."""
        b, span = tok.shape[0], allowed.shape[-1]
        kv, groups, d = self.m.n_kv_heads, self.m.n_heads // self.m.n_kv_heads, self.m.head_dim

        def attend(i: int, attn: nn.Module, h: torch.Tensor) -> torch.Tensor:
            q, k, v = self._qkv(attn, h, pos[:, None])
            keys, values = self.cache[i][0, :b], self.cache[i][1, :b]
            keys.index_copy_(2, slot, k)
            values.index_copy_(2, slot, v)
            q = q.reshape(b, kv, groups, d)  # heads of one kv group together: no copies of the cache
            scores = torch.matmul(q, keys[:, :, :span].transpose(2, 3)) * self.m.scaling
            scores = scores.masked_fill(~allowed, float("-inf"))
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(weights, values[:, :, :span]).reshape(b, 1, kv * groups * d)

        x = self.m.embed(tok[:, None])
        for i in range(len(self.m.layers)):
            x = self._layer(i, x, attend)
        return self._logits(x[:, 0])


def _sample(logits: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its log-probability under `logits / temperature` (greedy when temperature <= 0)."""
    if temperature <= 0:
        token = logits.argmax(dim=-1)
        return token, torch.log_softmax(logits, dim=-1).gather(1, token[:, None])[:, 0]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:  # nucleus: drop the tail whose mass comes after top_p, as transformers' TopPLogitsWarper
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    # probs / Exp(1) noise: argmax is a sample from probs (no host sync; capturable in a CUDA graph).
    token = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
    return token, logp.gather(1, token[:, None])[:, 0]


@dataclass
class _Rows:
    """Per-batch-bucket state the decode graphs read and write (fixed addresses)."""

    tok: torch.Tensor  # (b,) last token
    pos: torch.Tensor  # (b,) its position
    start: torch.Tensor  # (b,) first cache index of the row (left padding before it)
    step: torch.Tensor  # (1,) decode step (0-based), the same for all rows
    width: torch.Tensor  # (1,) prompt width: the token of step s sits at cache index width + s
    out: torch.Tensor  # (b, capacity) sampled tokens, by step
    logp: torch.Tensor  # (b, capacity) their log-probabilities
    done: torch.Tensor  # (b,) seen an eos id or spent its budget
    budget: torch.Tensor  # (b,) max new tokens
    eos: torch.Tensor  # (8,) eos ids, padded with -1


class StaticGenerate:
    """Static-KV-cache decoding; CUDA-graph replay per step on CUDA. See the module docstring."""

    name = "static"

    def __init__(
        self, cuda_graphs: bool = True, compile: bool = False, block: int = 256, check_every: int = 16
    ) -> None:
        self.cuda_graphs = cuda_graphs
        self.compile = compile  # torch.compile the decode step (fuses the small ops; compiles once per model)
        self.block = block  # cache capacity and attended spans are multiples of this
        self.check_every = check_every  # decode steps between checks whether every row is done (a host sync)
        self.fallback = HFGenerate()
        self.graph_captures = 0
        self._owner: tuple[Any, ...] | None = None
        self._cache: list[torch.Tensor] = []
        self._rows: dict[int, _Rows] = {}
        self._graphs: dict[tuple[int, int, float, float], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        self._decoder: _Decoder | None = None
        self._decode: Any = None

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
        layout = _layout(model)
        if layout is None or len(eos_ids) > 8:
            return self.fallback.generate(
                model, prompts, max_new_tokens, temperature=temperature, top_p=top_p, eos_ids=eos_ids, pad_id=pad_id
            )
        with torch.no_grad(), torch.autocast(next(model.parameters()).device.type, enabled=False):
            return self._generate(model, layout, prompts, max_new_tokens, temperature, top_p, eos_ids, pad_id)

    # ---- state ---------------------------------------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        return 1 << max(0, n - 1).bit_length() if n <= 8 else 8 * math.ceil(n / 8)

    def _prepare(self, model: PreTrainedModel, layout: _Layout, batch: int, length: int) -> None:
        """Make sure the cache holds `batch` rows of `length` positions for this model; drop graphs if it moves."""
        param = next(model.parameters())
        owner = (id(model), layout.embed.weight.data_ptr(), layout.lm_head.weight.data_ptr(), str(param.dtype))
        have_rows = self._cache[0].shape[1] if self._cache else 0
        have_len = self._cache[0].shape[3] if self._cache else 0
        if owner == self._owner and batch <= have_rows and length <= have_len:
            return
        self.release()
        rows, capacity = max(batch, have_rows), self.block * math.ceil(max(length, have_len) / self.block)
        shape = (2, rows, layout.n_kv_heads, capacity, layout.head_dim)
        dtype = layout.embed.weight.dtype
        self._cache = [torch.zeros(shape, dtype=dtype, device=param.device) for _ in layout.layers]
        positions = torch.arange(capacity, device=param.device)[None]
        cos, sin = layout.rotary(torch.zeros(1, dtype=dtype, device=param.device), positions)
        self._decoder = _Decoder(layout, self._cache, cos[0], sin[0])
        self._decode = torch.compile(self._decoder.decode, dynamic=True) if self.compile else self._decoder.decode
        self._owner = owner

    def release(self) -> None:
        """Free the cache and the graphs (they are rebuilt on the next call)."""
        self._cache, self._rows, self._graphs, self._decoder, self._decode, self._owner = [], {}, {}, None, None, None
        self._pool = None

    def _rows_for(self, batch: int, device: torch.device) -> _Rows:
        if batch not in self._rows:
            capacity = self._cache[0].shape[3]

            def longs(*shape: int) -> torch.Tensor:
                return torch.zeros(shape, dtype=torch.long, device=device)

            self._rows[batch] = _Rows(
                tok=longs(batch),
                pos=longs(batch),
                start=longs(batch),
                step=longs(1),
                width=longs(1),
                out=longs(batch, capacity),
                logp=torch.zeros(batch, capacity, device=device),
                done=torch.zeros(batch, dtype=torch.bool, device=device),
                budget=longs(batch),
                eos=longs(8),
            )
        return self._rows[batch]

    # ---- one decode step (what a graph holds) ----------------------------------------------------------------------
    def _step(self, r: _Rows, span: int, temperature: float, top_p: float) -> None:
        slot = r.width + r.step
        index = torch.arange(span, device=r.tok.device)
        allowed = ((index[None] >= r.start[:, None]) & (index[None] <= slot))[:, None, None]
        logits = self._decode(r.tok, r.pos, slot, allowed)
        token, logp = _sample(logits, temperature, top_p)
        column = r.step + 1
        r.out.index_copy_(1, column, token[:, None])
        r.logp.index_copy_(1, column, logp[:, None])
        r.done.logical_or_(torch.isin(token, r.eos) | (column >= r.budget - 1))
        r.tok.copy_(token)
        r.pos.add_(1)
        r.step.add_(1)

    def _graph(self, r: _Rows, batch: int, span: int, temperature: float, top_p: float) -> torch.cuda.CUDAGraph:
        key = (batch, span, temperature, top_p)
        if key not in self._graphs:
            saved = [t.clone() for t in (r.tok, r.pos, r.step, r.done)]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up (library handles, workspaces) off the capture
                self._step(r, span, temperature, top_p)
            torch.cuda.current_stream().wait_stream(stream)
            for t, s in zip((r.tok, r.pos, r.step, r.done), saved, strict=True):
                t.copy_(s)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._step(r, span, temperature, top_p)
            self._graphs[key] = graph
            self.graph_captures += 1
        return self._graphs[key]

    # ---- a call ------------------------------------------------------------------------------------------------------
    def _generate(
        self,
        model: PreTrainedModel,
        layout: _Layout,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        temperature: float,
        top_p: float,
        eos_ids: set[int],
        pad_id: int,
    ) -> list[Completion]:
        device = next(model.parameters()).device
        n, batch = len(prompts), self._bucket(len(prompts))
        width = max(len(p) for p in prompts)
        steps = max(max_new_tokens)
        self._prepare(model, layout, batch, width + steps)
        assert self._decoder is not None
        r = self._rows_for(batch, device)
        use_graphs = self.cuda_graphs and device.type == "cuda"

        lengths = torch.tensor([len(p) for p in prompts] + [1] * (batch - n), device=device)
        ids = torch.full((batch, width), pad_id, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
        ids = ids.to(device)
        start = width - lengths
        r.start.copy_(start)
        r.width.fill_(width)
        r.step.zero_()
        r.budget.copy_(torch.tensor(max_new_tokens + [0] * (batch - n), device=device))
        r.eos.fill_(-1)
        r.eos[: len(eos_ids)] = torch.tensor(sorted(eos_ids), device=device)

        # Prefill, in row chunks of about 16k tokens. A row sees its own prompt causally; a padding position sees
        # only itself (so its values stay finite and nothing real attends to it).
        index = torch.arange(width, device=device)
        pos = (index[None] - start[:, None]).clamp(min=0)
        causal = index[None, :] <= index[:, None]
        itself = torch.eye(width, dtype=torch.bool, device=device)
        chunk = max(1, 16384 // width)
        first = torch.empty(batch, dtype=torch.long, device=device)
        first_logp = torch.empty(batch, device=device)
        for lo in range(0, batch, chunk):
            rows = slice(lo, min(batch, lo + chunk))
            allowed = (causal[None] & (index[None, None] >= start[rows, None, None])) | itself
            logits = self._decoder.prefill(ids[rows], pos[rows], allowed[:, None], rows)
            first[rows], first_logp[rows] = _sample(logits, temperature, top_p)
        r.out[:, 0] = first
        r.logp[:, 0] = first_logp
        r.tok.copy_(first)
        r.pos.copy_(lengths)
        r.done.copy_(torch.isin(first, r.eos) | (r.budget <= 1))

        taken = 1
        for s in range(steps - 1):
            span = self.block * math.ceil((width + s + 1) / self.block)
            if use_graphs:
                self._graph(r, batch, span, temperature, top_p).replay()
            else:
                self._step(r, span, temperature, top_p)
            taken += 1
            if taken % self.check_every == 0 and bool(r.done[:n].all()):
                break
        out = r.out[:n, :taken].tolist()
        logp = r.logp[:n, :taken].tolist()
        return [_finish(ids_, m, eos_ids, lp) for ids_, m, lp in zip(out, max_new_tokens, logp, strict=True)]


ENGINES = {"hf": HFGenerate, "static": StaticGenerate}


def make_engine(name: str, device: str, cuda_graphs: bool = True, compile: bool = False) -> Engine:
    """`auto`: StaticGenerate on CUDA (it falls back to HFGenerate for models it does not support), else HFGenerate."""
    if name == "auto":
        name = "static" if device == "cuda" else "hf"
    if name == "static":
        return StaticGenerate(cuda_graphs=cuda_graphs, compile=compile)
    if name == "hf":
        return HFGenerate()
    raise ValueError(f"unknown generation engine {name!r} (known: auto, {', '.join(ENGINES)})")
