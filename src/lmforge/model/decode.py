"""The decode path: generation's KV cache, the fused T = 1 decode step and the weights it computes from.
The model (`transformer.py`) computes any T with `forward`/`hidden`, writing into a `KVCache`
when it is given one (the prefill). The steps after it, one token per row, go through
`decode_step`: the same model computed from `DecodeWeights` (the parameters laid out for small
matrix products, on CPU prepacked for oneDNN), with few small ops, for latency-bound decoding.
`generate` uses one shared cache slot per step; `lmforge serve` per-row slots (continuous
batching). `Transformer.decode_step`, `decode_weights` and `new_cache` are these functions.

The step is built from the mechanisms the forward calls (`functional.py`: the norm with its
offset, QK-norm, the rotary embedding or none, the window mask, soft-caps, the embedding scale,
and `sublayer`, the one body of every norm placement), read from the model's own modules: an
absent norm is the model's `nn.Identity`, a bias is the model's `nn.Linear` bias. What differs
is only the layout: the pre-norm's gain folded into the matrix after it (`FoldedNorm`), q, k and
v in one product, the rotary embedding of q and k in one multiply-add (`SignedRope`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from lmforge.model import lora
from lmforge.model.functional import (Folded, FoldedNorm, SignedRope, apply_rope, identity, key_allowed, norm_gain,
                                      norm_of, qk_norm, softcap, sublayer)
from lmforge.runtime import compute_dtype

# `model` below is a `lmforge.model.Transformer`, not imported (the model imports this module).


class KVCache:
    """Per-layer key/value cache for generation.

    k[l], v[l]: (B, n_kv_heads, max_len, head_dim). `length` slots are filled.
    `key_mask` (B, max_len) bool marks real (non-padding) slots, for left-padded batches.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, key_mask: torch.Tensor | None = None):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.length, self.max_len, self.key_mask = 0, max_len, key_mask
        self.weights: DecodeWeights | None = None  # built by the first `decode_step`

    def rows(self, start: int, stop: int, span: int | None = None) -> "KVCache":
        """A cache over rows [start, stop) and slots [0, span) (default: all) of this one: views
        of the same tensors (writes go through), sharing the decode weights; `length` 0 when
        start > 0 (a row prefilled alone), else this cache's. For a batch smaller than the
        cache's, attending over fewer slots (serve/engine.py)."""
        span = self.max_len if span is None else span
        view = object.__new__(KVCache)
        view.k, view.v = [k[start:stop, :, :span] for k in self.k], [v[start:stop, :, :span] for v in self.v]
        view.length = self.length if start == 0 else 0
        view.max_len, view.weights = span, self.weights
        view.key_mask = None if self.key_mask is None else self.key_mask[start:stop]
        return view

    def gather_rows(self, index: torch.Tensor, key_mask: torch.Tensor | None = None) -> "KVCache":
        """A cache of len(index) rows, row i a copy of this cache's row index[i] (its filled slots,
        its length, its decode weights): a prompt prefilled once, continued by several rows.
        `key_mask` (len(index), max_len): the new rows' valid slots (None: this cache's, gathered)."""
        out = object.__new__(KVCache)
        out.k, out.v = [k.index_select(0, index) for k in self.k], [v.index_select(0, index) for v in self.v]
        out.length, out.max_len, out.weights = self.length, self.max_len, self.weights
        out.key_mask = key_mask if key_mask is not None or self.key_mask is None else self.key_mask[index]
        return out

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = k.shape[2]
        end = self.length + T
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def linear(mm: Callable, h: torch.Tensor | Folded, m: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """h (B, in), or `Folded` (its pre-norm's 1/rms scaling the product's rows), @ m (in, out) + bias;
    `mm` the step's matrix product."""
    y = mm(h[0], m).mul_(h[1]) if type(h) is Folded else mm(h, m)
    return y if bias is None else y.add_(bias)


def fuse(linears, norm: torch.nn.Module | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`linears`' weights concatenated along out, (in, out) contiguous in `dtype`, the gain of `norm` (the
    pre-norm before them; nn.Identity or None: none) folded into the rows, and their biases (zeros for a
    Linear without; None if none has one). A lone weight in `dtype` wider in than out: its view, no copy."""
    w = torch.cat([m.weight for m in linears]).t() if len(linears) > 1 else linears[0].weight.t()
    if norm is None and w.shape[0] > w.shape[1] and w.dtype == dtype and w.t().is_contiguous():
        return w, None if linears[0].bias is None else linears[0].bias.to(dtype)
    if norm is not None and not isinstance(norm, torch.nn.Identity):
        w = norm_gain(norm.weight, norm.offset)[:, None] * w
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return w.to(dtype).contiguous(), None
    bias = torch.cat([m.weight.new_zeros(m.weight.shape[0]) if b is None else b for m, b in zip(linears, biases)])
    return w.to(dtype).contiguous(), bias.to(dtype)


@dataclass(slots=True)
class DecodeLayer:
    """One layer in the decode layout (`DecodeWeights`), read from the model's `Block` (slots: a
    step reads these fields a few dozen times)."""

    mats: tuple  # (wqkv, wo, w13, w2), (in, out) each (DecodeWeights)
    biases: tuple  # each matrix's bias, or None
    norms: tuple  # (before attention, after it, before the MLP, after it): FoldedNorm, `norm_of` or identity
    qk_norms: tuple  # (q's, k's) `norm_of` in the compute dtype, or (identity, identity)
    qk_scope: str | bool  # "head", "projection" or False (`functional.qk_norm`)
    rope: str | None  # "full", "sliding" or None (a NoPE layer)
    window: int  # the sliding window, 0: full attention
    scale: float  # the attention scores' scale
    softcap: float  # the attention scores' soft-cap (0: none)
    act: Callable  # the MLP's activation (the model's `FeedForward.act`)
    residual_scale: float  # each sublayer's output times this before the residual add (1: none)

    @staticmethod
    def of(block: torch.nn.Module, dtype: torch.dtype) -> "DecodeLayer":
        a, f = block.attention, block.feed_forward
        (wqkv, bqkv), (wo, bo) = fuse((a.wq, a.wk, a.wv), block.attention_norm, dtype), fuse((a.wo,), None, dtype)
        (w13, b13), (w2, b2) = fuse((f.w1, f.w3), block.ffn_norm, dtype), fuse((f.w2,), None, dtype)

        def pre(norm):  # folded into the matrix after it (`fuse`), or absent
            return identity if isinstance(norm, torch.nn.Identity) else FoldedNorm(norm.eps)

        norms = (pre(block.attention_norm), norm_of(block.attention_post_norm, float32=True),
                 pre(block.ffn_norm), norm_of(block.ffn_post_norm, float32=True))
        return DecodeLayer((wqkv, wo, w13, w2), (bqkv, bo, b13, b2), norms,
                           (norm_of(a.q_norm, dtype), norm_of(a.k_norm, dtype)), a.qk_norm, block.rope, block.window,
                           a.scale or 1.0 / math.sqrt(a.head_dim), a.softcap, f.act, block.residual_scale)


class DecodeWeights:
    """The model's weights laid out for T = 1 decode steps, computed from its parameters (which
    keep their names and layout: checkpoints and export do not change).

    `layers`: one `DecodeLayer` a layer, its matrices (in, out) so a step computes `x @ w`, contiguous
    along out (MKL's batch-1 product on CPU reads a matrix up to 3x faster along its longer side:
    SmolLM2's w13 12 against 7.6 GB/s; its w2, 1,536 in to 576 out, 11.9 against 8.0 the other way):
    `wqkv` (dim, H*hd + 2*KV*hd) = cat(wq, wk, wv).T and `w13` (dim, 2*ffn) = cat(w1, w3).T, one
    product for q, k and v and one for the MLP's inputs, the pre-norm's gain folded into their rows
    (`FoldedNorm`: the norm is one per-row scale); `wo` (H*hd, dim), `w2` (ffn, dim): when in > out and
    in the compute dtype, the model's own weights seen transposed (no copy); biases alongside.
    `head` is (dim, vocab_size) likewise when its copy is at most HEAD_COPY_LIMIT bytes, else
    `out_head`, the sliced output weight (vocab_size, dim) for F.linear; `norm` the final norm. `tables`: each
    rotary kind's (cos, sin_signed), (max_seq_len, 1, hd), rotate_half's minus sign folded into the
    sine (`SignedRope`). Matrices are in the compute dtype (the autocast dtype under autocast); the
    residual stream's norm weights stay as they are.

    On CPU in float32, `packed` holds the same matrices (and the head) prepacked for oneDNN's linear
    (`torch.ops.mkldnn._reorder_linear_weight`, the layout Inductor's CPU path uses): MKL's small-batch matmul
    re-packs the weight on every call (Gemma 3's 671 MB head at batch 8: 190 against oneDNN's 80 ms a step, for one
    more copy of it), and oneDNN's result for a row does not depend on the batch size at all, which the server needs
    (see `decode_step`). None where unavailable or the head passes PACK_LIMIT bytes (several rows then take F.linear
    on the output weight itself).

    Made once per parameter version (`Transformer.decode_weights`): copies of the weights, valid
    while the parameters do not change.
    """

    #: Largest output matrix (bytes) copied into the (dim, V) layout (SmolLM2-135M's: 15.3 against 14.9 tok/s)
    HEAD_COPY_LIMIT = 256 << 20
    PACK_LIMIT = 1 << 30  #: largest output matrix (bytes) prepacked for oneDNN with the layers

    def __init__(self, model: "Transformer", dtype: torch.dtype):
        live = [n for n, m in lora.lora_layers(model) if not (m.merged or m.disabled)]
        if live:  # the fused step reads `weight` directly: an adapter beside it would be left out silently
            raise ValueError(f"{live[0]} has an unmerged LoRA adapter, which the fused decode step would ignore: "
                             f"merge it first (lmforge.model.lora.merge), or load the checkpoint with load_model, "
                             f"which merges")
        with torch.no_grad():
            self.layers = [DecodeLayer.of(b, dtype) for b in model.layers]
            self.norm = norm_of(model.norm, float32=True)  # the final norm
            self.windows = {L.window for L in self.layers} | {0}  # 0: full attention
            w = model.output.weight[: model.vocab_size]
            self.head_t = w.numel() * dtype.itemsize <= self.HEAD_COPY_LIMIT
            self.out_head = w.to(dtype)  # (V, dim): the weight itself in its own dtype
            self.head = w.t().to(dtype).contiguous() if self.head_t else self.out_head
            hd = model.config.resolved_head_dim()
            sign = torch.ones(hd, device=w.device)
            sign[: hd // 2] = -1
            # (max_seq_len, 1, hd): a step's rows (B, 1, hd) broadcast over the heads
            self.tables = {"full": (model.rope_cos.to(dtype)[:, None], (model.rope_sin * sign).to(dtype)[:, None])}
            if hasattr(model, "rope_cos_sliding"):  # the sliding layers' own RoPE base
                self.tables["sliding"] = (model.rope_cos_sliding.to(dtype)[:, None],
                                          (model.rope_sin_sliding * sign).to(dtype)[:, None])
            self.dtype, self.packed, self.packed_head = dtype, None, None
            if w.device.type == "cpu" and dtype == torch.float32 and w.numel() * 4 <= self.PACK_LIMIT:
                head = self.head if self.head_t else self.out_head.t()  # (dim, V) either way
                self.packed, self.packed_head = _onednn_pack([L.mats for L in self.layers], head)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """(B, in) @ a matrix prepacked by `_onednn_pack` -> (B, out)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _onednn_pack(layers: list[tuple], head: torch.Tensor):
    """(layers, head) with every (in, out) matrix prepacked for oneDNN, or (None, None) when this
    torch has no oneDNN linear or it disagrees with a plain matmul on a probe (these are the
    private ops of Inductor's CPU path: checked, never trusted blindly)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return None, None

        def pack(m):  # (in, out) -> oneDNN's blocked layout of the (out, in) weight
            return torch.ops.mkldnn._reorder_linear_weight(m.t().contiguous())

        packed = [tuple(pack(m) for m in layer) for layer in layers]
        packed_head = pack(head)
        probe = torch.randn(3, head.shape[0], generator=torch.Generator().manual_seed(0))
        if not torch.allclose(_onednn_linear(probe, packed_head), probe @ head, rtol=1e-4, atol=1e-4):
            return None, None
        return packed, packed_head
    except (RuntimeError, AttributeError, NotImplementedError):
        return None, None


def new_cache(model: "Transformer", batch: int, max_len: int, key_mask: torch.Tensor | None = None) -> KVCache:
    """An empty KVCache for `batch` rows of `max_len` slots, in the compute dtype of `model`'s device
    (the autocast dtype under autocast); `key_mask` (batch, max_len) bool, see KVCache."""
    p = model.output.weight
    dtype = compute_dtype(p.device, p.dtype)
    c = model.config
    return KVCache(c.n_layers, batch, c.n_kv_heads, max_len, c.resolved_head_dim(), dtype, p.device, key_mask)


def decode_weights(model: "Transformer", dtype: torch.dtype | None = None) -> DecodeWeights:
    """The decode layout of `model`'s current parameters in `dtype` (default: theirs), made once and
    kept until a parameter changes (its storage or version) or another dtype is asked for."""
    dtype = dtype or model.output.weight.dtype
    key = (dtype, tuple((p.data_ptr(), 0 if p.is_inference() else p._version)  # inference tensors: no version
                        for p in model.parameters()))
    w = model.__dict__.get("_decode_weights")
    if w is None or w.key != key:
        w = DecodeWeights(model, dtype)
        w.key = key
        model.__dict__["_decode_weights"] = w  # a plain attribute: not a buffer, never saved
    return w


def cache_weights(model: "Transformer", cache: KVCache, device: torch.device) -> DecodeWeights:
    """The cache's decode weights in the compute dtype of `device`, made on first use."""
    dtype = compute_dtype(device, model.output.weight.dtype)
    if cache.weights is None or cache.weights.dtype != dtype:
        cache.weights = decode_weights(model, dtype)
    return cache.weights


class Step:
    """What the layers of one decode step share: the batch's attention biases (by window), rotary
    tables (by kind), cache slots, and the matrix product (oneDNN's prepacked, or torch.matmul)."""

    def __init__(self, model: "Transformer", w: DecodeWeights, positions: torch.Tensor, cache: KVCache,
                 slots: torch.Tensor | None, batch_invariant: bool):
        c, B, dev = model.config, positions.shape[0], positions.device
        self.B, self.H, self.KV, self.hd = B, c.n_heads, c.n_kv_heads, c.resolved_head_dim()
        self.w, self.cache, self.slots = w, cache, slots
        self.ropes = {None: None}  # a NoPE layer's
        for kind, (cos, sin) in w.tables.items():
            self.ropes[kind] = SignedRope(cos[positions], sin[positions])  # (B, 1, hd)
        # under torch.compile (compiled_decode_step) inductor picks its own matmuls: the prepacked
        # weights are oneDNN's opaque layout, which it takes only as frozen constants
        self.packed = w.packed is not None and (B > 1 or batch_invariant) and not torch.compiler.is_compiling()
        self.mm = _onednn_linear if self.packed else torch.matmul
        if slots is None:  # every row writes slot `at` and sees slots [0, at] its key_mask allows (left padding)
            self.at = cache.length
            self.S = self.at + 1
        else:  # row b writes slots[b] and sees slots [0, slots[b]] over the whole cache
            self.S, self.rows = cache.max_len, torch.arange(B, device=dev)
        key_mask = None if cache.key_mask is None else cache.key_mask[:, :self.S]  # (B, S)
        self.biases = {}
        for window in w.windows:
            allowed = key_mask
            if slots is not None or window:  # (the newest slot's query sees every slot before it)
                query = slots[:, None] if slots is not None else torch.full((1, 1), self.at, device=dev)
                allowed = key_allowed(query, torch.arange(self.S, device=dev)[None], window)  # (B or 1, S)
                allowed = allowed if key_mask is None else allowed & key_mask
            self.biases[window] = None if allowed is None else self.bias(allowed, w.dtype)

    def bias(self, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B or 1, S) bool -> (B*KV or 1, 1, S) additive: 0 where attended, -inf elsewhere."""
        bias = torch.zeros(allowed.shape[0], 1, self.S, dtype=dtype, device=allowed.device)
        bias.masked_fill_(~allowed[:, None], float("-inf"))
        return bias.repeat_interleave(self.KV, 0) if bias.shape[0] == self.B else bias

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """(B, dim) -> (B, vocab_size): h @ output.weight[:vocab_size].T (`Transformer.logits`' product)."""
        if self.packed or (self.w.head_t and self.B == 1):  # (several rows: F.linear reads the weight once for all)
            return self.mm(h, self.w.packed_head) if self.packed else h @ self.w.head
        return F.linear(h, self.w.out_head)

    def layer(self, x: torch.Tensor, L: DecodeLayer, layer: int) -> torch.Tensor:
        """One layer on the residual stream x (B, dim): `functional.sublayer` twice, as `Block.forward`.
        (A step is latency-bound: the attention of one query is written out here, not in helpers.)"""
        B, H, KV, hd, S, mm = self.B, self.H, self.KV, self.hd, self.S, self.mm
        wqkv, wo, w13, w2 = self.w.packed[layer] if self.packed else L.mats
        bqkv, bo, b13, b2 = L.biases

        def attention(h):  # h: (B, dim), or Folded -> (B, dim)
            qkv = linear(mm, h, wqkv, bqkv)  # (B, (H + 2 KV) hd)
            if L.qk_scope == "projection":  # (`qk_norm` at each stage: the slices and the cat only where it acts)
                q, k = qk_norm(qkv[:, :H * hd], qkv[:, H * hd:(H + KV) * hd], L.qk_norms, L.qk_scope, "projection")
                qkv = torch.cat((q, k, qkv[:, (H + KV) * hd:]), 1)
            qkv = qkv.view(B, H + 2 * KV, hd)
            qk, v = qkv[:, :H + KV], qkv[:, H + KV:]  # q and k side by side: one rotary product
            if L.qk_scope == "head":
                qk = torch.cat(qk_norm(qk[:, :H], qk[:, H:], L.qk_norms, L.qk_scope, "head"), 1)
            qk = apply_rope(qk, self.ropes[L.rope])  # (B, H + KV, hd)
            ck, cv = self.cache.k[layer], self.cache.v[layer]  # (B, KV, max_len, hd)
            if self.slots is None:
                ck[:, :, self.at], cv[:, :, self.at] = qk[:, H:], v
            else:
                ck[self.rows, :, self.slots], cv[self.rows, :, self.slots] = qk[:, H:], v
            # grouped-query attention of one query: (B*KV, G, hd) @ (B*KV, hd, S); no K/V repeat
            q, keys = qk[:, :H].reshape(B * KV, H // KV, hd), ck[:, :, :S].reshape(B * KV, S, hd).transpose(1, 2)
            bias = self.biases[L.window]
            if L.softcap:  # Gemma 2: c tanh(s / c) after scaling, before the mask
                scores = softcap(torch.bmm(q, keys).mul_(L.scale), L.softcap)
                scores = scores if bias is None else scores + bias
            else:
                scores = (torch.baddbmm(bias, q, keys, alpha=L.scale) if bias is not None
                          else torch.bmm(q, keys).mul_(L.scale))  # (B*KV, G, S)
            y = torch.bmm(scores.softmax(-1), cv[:, :, :S].reshape(B * KV, S, hd))  # (B*KV, G, hd)
            y = mm(y.view(B, H * hd), wo)
            return y if bo is None else y.add_(bo)

        def feed_forward(h):  # h: (B, dim), or Folded -> (B, dim)
            gate, up = linear(mm, h, w13, b13).chunk(2, -1)  # (B, ffn) each
            y = mm(L.act(gate).mul_(up), w2)
            return y if b2 is None else y.add_(b2)

        x = sublayer(x, attention, L.norms[0], L.norms[1], L.residual_scale)
        return sublayer(x, feed_forward, L.norms[2], L.norms[3], L.residual_scale)


@torch.no_grad()
def decode_step(model: "Transformer", tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                slots: torch.Tensor | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """One T = 1 decode step on the cache: the same model as `Transformer.forward`, computed with fused
    weights (`DecodeWeights`) and few small ops, for latency-bound generation.

    Args:
        tokens: (B,) int64, one new token per row.
        positions: (B,) int64 rotary positions of those tokens.
        cache: the KVCache (B rows) after a prefill through `forward`/`hidden`.
        slots: None: every row writes cache slot `cache.length` (then length += 1) and
            attends to slots [0, length] where `cache.key_mask` (left padding) allows;
            (B,) int64: row b writes slot `slots[b]` and attends to slots [0, slots[b]]
            over the whole cache (continuous batching: rows at different lengths).
        batch_invariant: use the oneDNN matmuls (DecodeWeights.packed) at every batch size,
            batch 1 included. A row's numbers never depend on the other rows' values (every
            op is row-wise); with the oneDNN matmuls they do not depend on the batch size
            either, nor on the span of masked cache slots beyond the row's own (in multiples
            of 64; tests/test_decode_step.py). Without it, batch 1 uses MKL's faster
            matrix-vector product, whose sums are ordered differently (about 1e-6 relative).
    Returns:
        logits (B, vocab_size) in the compute dtype.
    """
    w = cache_weights(model, cache, tokens.device)
    step = Step(model, w, positions, cache, slots, batch_invariant)
    x = model.embed(tokens)  # (B, dim); the residual stays in the parameters' dtype
    for layer, L in enumerate(w.layers):
        x = step.layer(x, L, layer)
    if slots is None:
        cache.length += 1
    return model.logits(w.norm(x), step.head)


def compiled_decode_step(model: "Transformer"):
    """`decode_step` (one shared cache slot per step, as `generate` calls it) through
    torch.compile: a function (tokens, positions, cache) -> logits, made once per model.

    The compiled step always attends over the cache's whole length with a mask (the `slots` form
    of `decode_step`, the slot a tensor), so one graph serves every step, batch size and cache
    length (dynamic shapes), and fuses the small elementwise ops that dominate a small model's
    step (with inductor's C++ wrapper: no Python between its kernels). Masked slots add exact
    zeros. On the speedrun-sized model at batch 1, one thread: 2.0 ms a token against 3.3 ms
    eagerly (bench/RESULTS.md, "compiled decode"); the first call compiles (~25 s on an empty
    cache, seconds with inductor's cache warm), so it pays for long generation only.
    """
    step = model.__dict__.get("_compiled_decode")
    if step is None:
        compiled = torch.compile(decode_step, dynamic=True, options={"cpp_wrapper": True})

        def step(tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
            cache_weights(model, cache, tokens.device)  # made eagerly, outside the graph
            slots = torch.full((tokens.shape[0],), cache.length, dtype=torch.long, device=tokens.device)
            logits = compiled(model, tokens, positions, cache, slots)
            cache.length += 1
            return logits

        model.__dict__["_compiled_decode"] = step  # a plain attribute: never saved
    return step


__all__ = ["DecodeWeights", "KVCache", "compiled_decode_step", "decode_step", "decode_weights", "new_cache"]
