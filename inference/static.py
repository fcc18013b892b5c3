"""`StaticGenerate`: a decode loop of its own for Llama-style decoders (Qwen2, Qwen3, Llama): a static KV cache,
  the prompts prefilled in one pass, then one token per step for the whole batch. On CUDA each decode step is captured
  as a CUDA graph (one per batch bucket and attended length), so a step costs one graph launch instead of a thousand
  kernel launches from Python; with `compile`, the two halves of a layer are compiled first (torch.compile fuses the
  small ops), once for all layers. It reads the model's weights as tensors and does the arithmetic of transformers'
  modules for these architectures, with q/k/v and gate/up each stacked into one matrix product. The stacked weights
  are copies, with LoRA adapters merged in (as are the other LoRA-adapted weights), refreshed from the model before
  every call, so generation runs plain matrix products and the model's weights are never modified. The trainer's
  log-probabilities still come from the model's own forward. Other models (or DoRA, sliding windows, length-dependent
  rotary) go to `HFGenerate`.

The graphs read the copies and the other weights where they are, so the optimizer's updates are seen by the next
rollout; another model object drops the graphs, the cache and the copies.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from inference.engine import Completion, finish
from inference.hf import HFGenerate

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


@dataclass
class _Linear:
    """A projection as the decode loop reads it: the module's own weight, or a copy of it (refreshed before each
    generation) where the weight is a LoRA layer's base with its adapters merged in, or a slice of a fused projection.
    Generation then runs plain matrix products."""

    module: nn.Module  # an nn.Linear, or a PEFT LoRA layer around one (`base_layer`)
    weight: torch.Tensor
    bias: torch.Tensor | None

    def refresh(self) -> None:
        base = getattr(self.module, "base_layer", self.module)
        if self.bias is not None and self.bias is not base.bias:
            self.bias.copy_(base.bias)
        if self.weight is base.weight:
            return
        lora = self.module
        adapters = [a for a in getattr(lora, "active_adapters", []) if a in lora.lora_A]
        if base is lora or lora.merged or lora.disable_adapters or not adapters:
            self.weight.copy_(base.weight)
            return
        dtype = base.weight.dtype
        for i, name in enumerate(adapters):  # W + scaling * B @ A (PEFT's merge), one pass over W per adapter
            up, down = lora.lora_B[name].weight.to(dtype), lora.lora_A[name].weight.to(dtype)
            torch.addmm(base.weight if i == 0 else self.weight, up, down, alpha=lora.scaling[name], out=self.weight)


def _linear(module: nn.Module) -> _Linear | None:
    if isinstance(module, nn.Linear):
        return _Linear(module, module.weight, module.bias)
    base = getattr(module, "base_layer", None)  # a PEFT LoRA layer
    if isinstance(base, nn.Linear) and hasattr(module, "get_delta_weight"):
        if module.fan_in_fan_out or any(module.use_dora.get(a, False) for a in module.active_adapters):
            return None
        return _Linear(module, torch.empty_like(base.weight), base.bias)
    return None


def _fuse(parts: list[_Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for projections of the same input, stacked by output rows: one matrix product instead
    of several. Each part's weight and bias become views into the stack, filled by its `refresh`."""
    weights = [p.weight for p in parts]
    weight = torch.empty(sum(w.shape[0] for w in weights), weights[0].shape[1], dtype=weights[0].dtype,
                         device=weights[0].device)  # fmt: skip
    biased = any(p.bias is not None for p in parts)
    bias = weight.new_zeros(weight.shape[0]) if biased else None
    row = 0
    for part in parts:
        rows = part.weight.shape[0]
        part.weight = weight[row : row + rows]
        if bias is not None and part.bias is not None:
            part.bias = bias[row : row + rows]
        row += rows
    return weight, bias


@dataclass
class _LayerWeights:
    ln1: torch.Tensor
    ln2: torch.Tensor
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm per head on q and k
    k_norm: torch.Tensor | None
    q: _Linear
    k: _Linear
    v: _Linear
    o: _Linear
    gate: _Linear
    up: _Linear
    down: _Linear
    qkv: tuple[torch.Tensor, torch.Tensor | None] = field(init=False)  # q, k, v stacked: one product
    gate_up: tuple[torch.Tensor, torch.Tensor | None] = field(init=False)  # gate, up stacked

    def __post_init__(self) -> None:
        self.qkv = _fuse([self.q, self.k, self.v])
        self.gate_up = _fuse([self.gate, self.up])

    def attn(self) -> tuple[torch.Tensor | None, ...]:
        return (self.ln1, self.q_norm, self.k_norm, *self.qkv)

    def rest(self) -> tuple[torch.Tensor | None, ...]:
        return (self.o.weight, self.o.bias, self.ln2, *self.gate_up, self.down.weight, self.down.bias)

    def linears(self) -> list[_Linear]:
        return [self.q, self.k, self.v, self.o, self.gate, self.up, self.down]


@dataclass
class _Layout:
    """A Llama-style decoder read as tensors: what the decode loop needs, in the order it needs it."""

    embed: torch.Tensor
    layers: list[_LayerWeights]
    norm: torch.Tensor
    lm_head: _Linear
    rotary: nn.Module
    n_kv_heads: int
    groups: int
    head_dim: int
    scaling: float
    eps: float

    def refresh(self) -> None:
        """Copy the weights the model holds into the fused projections and re-merge LoRA adapters (the optimizer
        moved both); unfused plain weights are read in place."""
        for linear in [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head]:
            linear.refresh()


def _layout(model: PreTrainedModel) -> _Layout | None:
    """The decoder's weights (copies filled), or None when StaticGenerate does not support the model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    decoder = getattr(base, "model", None)
    if config.model_type not in SUPPORTED_MODEL_TYPES or decoder is None or not hasattr(decoder, "rotary_emb"):
        return None
    rope_type = getattr(decoder.rotary_emb, "rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":  # rotary frequencies that depend on the length
        return None
    if getattr(config, "hidden_act", None) != "silu":
        return None
    layers = []
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "sliding_window", None):
            return None
        linears = [_linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)]
        linears += [_linear(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
        if any(lin is None for lin in linears):
            return None
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        layers.append(
            _LayerWeights(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                None if q_norm is None else q_norm.weight,
                None if k_norm is None else k_norm.weight,
                *linears,  # type: ignore[arg-type]
            )
        )
    lm_head = _linear(base.get_output_embeddings())
    if lm_head is None:
        return None
    attn = decoder.layers[0].self_attn
    layout = _Layout(
        embed=decoder.embed_tokens.weight,
        layers=layers,
        norm=decoder.norm.weight,
        lm_head=lm_head,
        rotary=decoder.rotary_emb,
        n_kv_heads=config.num_key_value_heads,
        groups=config.num_attention_heads // config.num_key_value_heads,
        head_dim=attn.head_dim,
        scaling=attn.scaling,
        eps=decoder.norm.variance_epsilon,
    )
    layout.refresh()
    return layout


# ---- the model's arithmetic, as transformers' Llama/Qwen2/Qwen3 modules do it -------------------------------------
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _attn_in(
    x: torch.Tensor,
    w: tuple[Any, ...],
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    kv_heads: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm, q/k/v projections (one fused product), Qwen3's q/k norms and rotary.
    x (b, s, hidden) -> q (b, heads, s, dim), k and v (b, kv_heads, s, dim)."""
    ln1, q_norm, k_norm, qkv_w, qkv_b = w
    b, s, _ = x.shape
    h = _rms(x, ln1, eps)
    qkv = nn.functional.linear(h, qkv_w, qkv_b).view(b, s, -1, head_dim)
    q, k, v = qkv.split([qkv.shape[2] - 2 * kv_heads, kv_heads, kv_heads], dim=2)
    if q_norm is not None:
        q, k = _rms(q, q_norm, eps), _rms(k, k_norm, eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q, k, v


def _attn_out_mlp(x: torch.Tensor, attn: torch.Tensor, w: tuple[Any, ...], eps: float) -> torch.Tensor:
    """o_proj and residual, post-attention norm, SiLU-gated MLP (gate and up in one product) and residual."""
    ow, ob, ln2, gate_up_w, gate_up_b, dw, db = w
    x = x + nn.functional.linear(attn, ow, ob)
    h = _rms(x, ln2, eps)
    gate, up = nn.functional.linear(h, gate_up_w, gate_up_b).chunk(2, dim=-1)
    return x + nn.functional.linear(nn.functional.silu(gate) * up, dw, db)


def _decode_attn(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scaling: float
) -> torch.Tensor:
    """One query per row over the cache's first `span` positions; the heads of a kv group read it together."""
    b, heads, _, d = q.shape
    kv, span = keys.shape[1], allowed.shape[-1]
    q = q.reshape(b, kv, heads // kv, d)
    scores = torch.matmul(q, keys[:, :, :span].transpose(2, 3)) * scaling
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, values[:, :, :span]).reshape(b, 1, heads * d)


def _decode_layer_out(
    x: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    w: tuple[Any, ...],
    scaling: float,
    eps: float,
) -> torch.Tensor:
    return _attn_out_mlp(x, _decode_attn(q, keys, values, allowed, scaling), w, eps)


class _Decoder:
    """The forward pass over a static cache. `cache[l]` holds keys and values: (2, batch, kv_heads, capacity, dim).

    With `compile`, the two halves of a decode layer (before and after the cache write) are compiled once and reused
    by every layer: they are functions of tensors only.
    """

    def __init__(
        self, m: _Layout, cache: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, compile: bool
    ) -> None:
        self.m = m
        self.cache = cache
        self.cos, self.sin = cos, sin  # (capacity, dim), indexed by position
        self.attn_in = torch.compile(_attn_in, dynamic=True) if compile else _attn_in
        self.layer_out = torch.compile(_decode_layer_out, dynamic=True) if compile else _decode_layer_out

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(
            _rms(x, self.m.norm, self.m.eps), self.m.lm_head.weight, self.m.lm_head.bias
        ).float()

    def prefill(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, rows: slice) -> torch.Tensor:
        """Prompt pass for cache rows `rows`: ids, pos (batch, width); allowed (batch, 1, width, width). Last logits."""
        m, width = self.m, ids.shape[1]
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        x = nn.functional.embedding(ids, m.embed)
        for i, layer in enumerate(m.layers):
            q, k, v = _attn_in(x, layer.attn(), cos, sin, m.head_dim, m.n_kv_heads, m.eps)
            self.cache[i][0, rows, :, :width] = k
            self.cache[i][1, rows, :, :width] = v
            if m.groups > 1:
                k, v = k.repeat_interleave(m.groups, dim=1), v.repeat_interleave(m.groups, dim=1)
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=m.scaling)
            x = _attn_out_mlp(x, out.transpose(1, 2).reshape(x.shape[0], width, -1), layer.rest(), m.eps)
        return self._logits(x[:, -1])

    def decode(self, tok: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """One token per row: tok, pos (batch,) at cache index slot (1,); allowed (batch, 1, 1, span). Logits."""
        m, b = self.m, tok.shape[0]
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]
        x = nn.functional.embedding(tok[:, None], m.embed)
        for i, layer in enumerate(m.layers):
            q, k, v = self.attn_in(x, layer.attn(), cos, sin, m.head_dim, m.n_kv_heads, m.eps)
            keys, values = self.cache[i][0, :b], self.cache[i][1, :b]
            keys.index_copy_(2, slot, k)
            values.index_copy_(2, slot, v)
            x = self.layer_out(x, q, keys, values, allowed, layer.rest(), m.scaling, m.eps)
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
        self.compile = compile  # on CUDA: torch.compile the decode layers (fuses the small ops; a one-off compile)
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
        self._layout: _Layout | None = None

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
        with torch.no_grad(), torch.autocast(next(model.parameters()).device.type, enabled=False):
            layout = self._layout_for(model)
            if layout is None or len(eos_ids) > 8:
                return self.fallback.generate(
                    model, prompts, max_new_tokens, temperature=temperature, top_p=top_p, eos_ids=eos_ids, pad_id=pad_id
                )
            return self._generate(model, layout, prompts, max_new_tokens, temperature, top_p, eos_ids, pad_id)

    # ---- state ---------------------------------------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        return 1 << max(0, n - 1).bit_length() if n <= 8 else 8 * math.ceil(n / 8)

    def _layout_for(self, model: PreTrainedModel) -> _Layout | None:
        """The model read as tensors, built once per model (its copies too); the copies refreshed on every call."""
        weight = model.get_input_embeddings().weight
        owner = (id(model), weight.data_ptr(), str(weight.dtype))
        if owner != self._owner:
            self.release()
            self._layout, self._owner = _layout(model), owner
        elif self._layout is not None:
            self._layout.refresh()
        return self._layout

    def _prepare(self, layout: _Layout, batch: int, length: int, device: torch.device) -> None:
        """Make sure the cache holds `batch` rows of `length` positions; growing it drops the graphs."""
        have_rows = self._cache[0].shape[1] if self._cache else 0
        have_len = self._cache[0].shape[3] if self._cache else 0
        if batch <= have_rows and length <= have_len:
            return
        self._cache, self._rows, self._graphs, self._decoder, self._pool = [], {}, {}, None, None
        capacity = self.block
        while capacity < length:  # doubling: a few reallocations (and recaptures) over a run, at most 2x memory
            capacity *= 2
        shape = (2, max(batch, have_rows), layout.n_kv_heads, max(capacity, have_len), layout.head_dim)
        dtype = layout.embed.dtype
        self._cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in layout.layers]
        positions = torch.arange(shape[3], device=device)[None]
        cos, sin = layout.rotary(torch.zeros(1, dtype=dtype, device=device), positions)
        self._decoder = _Decoder(layout, self._cache, cos[0], sin[0], self.compile and device.type == "cuda")

    def load(self, model: PreTrainedModel) -> None:
        """Nothing to do here: every call refreshes the copies from the model's weights."""

    def sleep(self) -> None:
        """Kept: the cache and the graphs are reused by the next rollout phase (`release` frees them)."""

    def release(self) -> None:
        """Free the cache, the graphs and the merged LoRA copies (rebuilt on the next call)."""
        self._cache, self._rows, self._graphs, self._decoder, self._pool = [], {}, {}, None, None
        self._layout, self._owner = None, None

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
        assert self._decoder is not None
        logits = self._decoder.decode(r.tok, r.pos, slot, allowed)
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
        self._prepare(layout, batch, width + steps, device)
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
        rows = zip(out, max_new_tokens, logp, prompts, strict=True)
        # every prompt prefilled whole: the cache holds one call's rows and is written over by the next
        return [finish(ids_, m, eos_ids, lp, prefilled=len(p)) for ids_, m, lp, p in rows]
