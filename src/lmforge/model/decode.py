"""The decode path: generation's KV cache and the fused T = 1 decode step.

The model (`transformer.py`) computes any T with `forward`/`hidden`, writing into a `KVCache`
when it is given one (the prefill). The steps after it, one token per row, go through
`decode_step`: the same model computed from `DecodeWeights` (the parameters laid out for small
matrix products, on CPU prepacked for oneDNN), with few small ops, for latency-bound decoding.
`generate` uses one shared cache slot per step; `lmforge serve` per-row slots (continuous
batching). `Transformer.decode_step`, `decode_weights` and `new_cache` are these functions.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from lmforge.runtime import compute_dtype
from lmforge.model import lora
from lmforge.model.functional import ACTIVATIONS, softcap

# `model` below is a `lmforge.model.Transformer`; this module does not import it (the model
# imports this module: one direction only).


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
        self.length = 0
        self.max_len = max_len
        self.key_mask = key_mask
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



class DecodeWeights:
    """The model's weights laid out for T = 1 decode steps, computed from its parameters (which
    keep their names and layout: checkpoints and export do not change).

    Per layer, transposed and contiguous, (in, out) so a step computes `x @ w` (row-major: on CPU
    the small-batch product is up to 3x faster than F.linear's transposed access):
    `wqkv` (dim, H*hd + 2*KV*hd) = cat(wq, wk, wv).T and `w13` (dim, 2*ffn) = cat(w1, w3).T, so
    one matmul gives q, k and v and one the SwiGLU's two inputs, each with the RMSNorm weight before
    it folded into its rows (rmsnorm(x) @ W = (x @ diag(g) W) / rms(x): the norm is then one
    per-row scale); `wo` (H*hd, dim), `w2` (ffn, dim).
    `head` is (dim, vocab_size) likewise when its copy is at most HEAD_COPY_LIMIT bytes, else the
    sliced output weight (vocab_size, dim) used with F.linear. `sin_signed` folds rotate_half's
    minus sign into the sine table. Matrices are in the compute dtype (the autocast dtype under
    autocast); norm weights stay as they are.

    On CPU in float32, `packed` holds the same matrices (and the head) prepacked for oneDNN's
    linear (`torch.ops.mkldnn._reorder_linear_weight`, the layout Inductor's CPU path uses):
    MKL's small-batch matmul re-packs the weight on every call (the batch-8 head product costs
    about 4x its batch-4 oneDNN one here), and oneDNN's result for a row does not depend on the
    batch size at all, which the server needs (see `decode_step`). None where unavailable.

    Made once per parameter version (`Transformer.decode_weights`): copies of the weights, valid
    while the parameters do not change.
    """

    #: Largest output matrix (bytes) copied into the (dim, V) layout.
    HEAD_COPY_LIMIT = 64 << 20

    def __init__(self, model: "Transformer", dtype: torch.dtype):
        def t(*ws, norm=None):  # cat along out, then (in, out) contiguous; a norm's weight folded in
            w = torch.cat(ws).t()
            return (w if norm is None else norm[:, None] * w).to(dtype).contiguous()

        live = [n for n, m in lora.lora_layers(model) if not (m.merged or m.disabled)]
        if live:  # the fused step reads `weight` directly: an adapter beside it would be left out silently
            raise ValueError(f"{live[0]} has an unmerged LoRA adapter, which the fused decode step would ignore: "
                             f"merge it first (lmforge.model.lora.merge), or load the checkpoint with load_model, "
                             f"which merges")
        c = model.config
        off = c.norm_offset

        def gain(norm):  # a norm's effective weight (offset + w), float32 when there is an offset
            return norm.weight.float() + off if off else norm.weight

        with torch.no_grad():
            self.layers = []
            for b in model.layers:
                a, f = b.attention, b.feed_forward
                self.layers.append((t(a.wq.weight, a.wk.weight, a.wv.weight, norm=gain(b.attention_norm) if b.pre else None),
                                    t(a.wo.weight), t(f.w1.weight, f.w3.weight, norm=gain(b.ffn_norm) if b.pre else None),
                                    t(f.w2.weight)))
            self.norm = gain(model.norm)
            self.pre = c.norm_placement != "post"  # the pre-norms are folded into wqkv and w13 (else none)
            # sandwich / post placement: each layer's (after-attention, after-MLP) norm weights
            self.post_norms = [(gain(b.attention_post_norm), gain(b.ffn_post_norm)) for b in model.layers] \
                if c.norm_placement != "pre" else None
            self.rope = [b.rope for b in model.layers]  # "full", "sliding" or None (NoPE) per layer
            self.windows = [b.window for b in model.layers]
            # Qwen2's q/k/v biases: each layer's cat(bq, bk, bv) (H*hd + 2*KV*hd,), added after the norm scale
            self.qkv_bias = [torch.cat((b.attention.wq.bias, b.attention.wk.bias, b.attention.wv.bias)).to(dtype)
                             for b in model.layers] if model.config.qkv_bias else None
            # QK-norm (Qwen3): each layer's (q_norm, k_norm) weights, (hd,) each, in the compute dtype
            self.qk_norm = [(gain(b.attention.q_norm).to(dtype), gain(b.attention.k_norm).to(dtype))
                            for b in model.layers] if model.config.qk_norm else None
            w = model.output.weight[: model.vocab_size]
            self.head_t = w.numel() * dtype.itemsize <= self.HEAD_COPY_LIMIT
            self.head = t(w) if self.head_t else w.to(dtype)
            half = model.config.resolved_head_dim() // 2
            sign = torch.ones(model.config.resolved_head_dim(), device=w.device)
            sign[:half] = -1
            self.cos = model.rope_cos.to(dtype)  # (max_seq_len, hd)
            self.sin_signed = (model.rope_sin * sign).to(dtype)
            if hasattr(model, "rope_cos_sliding"):  # the sliding layers' own RoPE base
                self.cos_sliding = model.rope_cos_sliding.to(dtype)
                self.sin_signed_sliding = (model.rope_sin_sliding * sign).to(dtype)
            self.dtype = dtype
            self.packed = self.packed_head = None
            if w.device.type == "cpu" and dtype == torch.float32 and self.head_t:
                self.packed, self.packed_head = _onednn_pack(self.layers, self.head)



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



def _cache_weights(model: "Transformer", cache: KVCache, device: torch.device) -> DecodeWeights:
    """The cache's decode weights in the compute dtype of `device`, made on first use."""
    dtype = compute_dtype(device, model.output.weight.dtype)
    if cache.weights is None or cache.weights.dtype != dtype:
        cache.weights = decode_weights(model, dtype)
    return cache.weights


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
    w = _cache_weights(model, cache, tokens.device)
    dev, dtype = tokens.device, w.dtype
    c = model.config
    B, H, KV, hd = tokens.shape[0], c.n_heads, c.n_kv_heads, c.resolved_head_dim()
    G, eps, scale = H // KV, c.norm_eps, c.attn_scale or 1.0 / math.sqrt(hd)
    ropes = {"full": (w.cos[positions][:, None], w.sin_signed[positions][:, None])}  # (B, 1, hd), over heads
    if hasattr(w, "cos_sliding"):
        ropes["sliding"] = (w.cos_sliding[positions][:, None], w.sin_signed_sliding[positions][:, None])
    if slots is None:
        at = cache.length
        S = at + 1
        allowed = None if cache.key_mask is None else cache.key_mask[:, :S]  # (B, S): left padding
        current = torch.full((1, 1), at, device=dev)  # the query's slot
    else:
        S = cache.max_len
        rows = torch.arange(B, device=dev)
        allowed = torch.arange(S, device=dev)[None] <= slots[:, None]  # (B, S)
        if cache.key_mask is not None:  # left padding of a batch (compiled_decode_step)
            allowed = allowed & cache.key_mask[:, :S]
        current = slots[:, None]

    def bias_of(allowed):  # (B or 1, S) bool -> (B*KV or 1, 1, S): 0 where attended, -inf elsewhere
        if allowed is None:  # (the layout of the scores below)
            return None
        bias = torch.zeros(allowed.shape[0], 1, S, dtype=dtype, device=dev).masked_fill_(~allowed[:, None], float("-inf"))
        return bias.repeat_interleave(KV, 0) if bias.shape[0] == B else bias

    biases = {0: bias_of(allowed)}
    for window in set(w.windows) - {0}:  # a sliding layer also sees only its last `window` slots
        within = torch.arange(S, device=dev)[None] > current - window  # (B or 1, S)
        biases[window] = bias_of(within if allowed is None else allowed & within)
    # under torch.compile (compiled_decode_step) inductor picks its own matmuls: the prepacked
    # weights are oneDNN's opaque layout, which it takes only as frozen constants
    if w.packed is not None and (B > 1 or batch_invariant) and not torch.compiler.is_compiling():
        layers, head, mm = w.packed, w.packed_head, _onednn_linear
    else:
        layers, head, mm = w.layers, w.head, torch.matmul
    x = model.tok_embeddings(tokens)  # (B, dim); the residual stays in the parameters' dtype
    if c.embed_scale != 1.0:
        x = x * c.embed_scale
    act = ACTIVATIONS[c.mlp_activation]

    def inv_rms(x):  # (B, dim) -> (B, 1): 1 / rms(x), RMSNorm without its weight
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))

    def pre(y, x):  # the pre-norm's 1 / rms(x) (its weight is folded into the matrix), or none
        return y.mul_(inv_rms(x)) if w.pre else y

    def post(y, weight):  # sandwich / post placement: RMSNorm of a branch before the residual add
        return F.rms_norm(y.float(), (y.shape[-1],), weight.float(), eps).to(y.dtype)

    for layer, (wqkv, wo, w13, w2) in enumerate(layers):
        qkv = pre(mm(x, wqkv), x)
        if w.qkv_bias is not None:
            qkv = qkv.add_(w.qkv_bias[layer])
        if w.qk_norm is not None and c.qk_norm_scope == "projection":  # over all of q, all of k (OLMo 2)
            qn, kn = w.qk_norm[layer]
            qkv = torch.cat((F.rms_norm(qkv[:, :H * hd], (H * hd,), qn, eps),
                             F.rms_norm(qkv[:, H * hd:(H + KV) * hd], (KV * hd,), kn, eps), qkv[:, (H + KV) * hd:]), 1)
        qkv = qkv.view(B, H + 2 * KV, hd)
        qk = qkv[:, : H + KV]
        if w.qk_norm is not None and c.qk_norm_scope == "head":  # per head of q and of k, before the rotary embedding
            qn, kn = w.qk_norm[layer]
            qk = torch.cat((F.rms_norm(qk[:, :H], (hd,), qn, eps), F.rms_norm(qk[:, H:], (hd,), kn, eps)), 1)
        if w.rope[layer] is not None:  # rotary on q and k at once: x cos + rotate_half(x) sin
            cos, sin = ropes[w.rope[layer]]
            qk = torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin)  # (B, H + KV, hd)
        k, v = qk[:, H:], qkv[:, H + KV:]  # (B, KV, hd)
        ck, cv = cache.k[layer], cache.v[layer]  # (B, KV, max_len, hd)
        if slots is None:
            ck[:, :, at], cv[:, :, at] = k, v
        else:
            ck[rows, :, slots], cv[rows, :, slots] = k, v
        # grouped-query attention of one query: (B*KV, G, hd) @ (B*KV, hd, S); no K/V repeat
        q = qk[:, :H].reshape(B * KV, G, hd)
        keys = ck[:, :, :S].reshape(B * KV, S, hd)
        bias = biases[w.windows[layer]]
        if c.attn_softcap:  # Gemma 2: c tanh(s / c) after scaling, before the mask
            scores = softcap(torch.bmm(q, keys.transpose(1, 2)).mul_(scale), c.attn_softcap)
            scores = scores if bias is None else scores + bias
        else:
            scores = (torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale) if bias is not None
                      else torch.bmm(q, keys.transpose(1, 2)).mul_(scale))  # (B*KV, G, S)
        y = torch.bmm(scores.softmax(-1), cv[:, :, :S].reshape(B * KV, S, hd))  # (B*KV, G, hd)
        y = mm(y.view(B, H * hd), wo)
        x = x + (post(y, w.post_norms[layer][0]) if w.post_norms else y)
        gate, up = pre(mm(x, w13), x).chunk(2, -1)  # (B, ffn) each
        y = mm(act(gate).mul_(up), w2)
        x = x + (post(y, w.post_norms[layer][1]) if w.post_norms else y)
    if slots is None:
        cache.length += 1
    h = post(x, w.norm) if c.norm_offset else x * inv_rms(x) * w.norm  # Gemma's final norm in float32
    logits = mm(h, head) if w.head_t else F.linear(h, w.head)
    return softcap(logits, c.final_softcap)


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
            _cache_weights(model, cache, tokens.device)  # made eagerly, outside the graph
            slots = torch.full((tokens.shape[0],), cache.length, dtype=torch.long, device=tokens.device)
            logits = compiled(model, tokens, positions, cache, slots)
            cache.length += 1
            return logits

        model.__dict__["_compiled_decode"] = step  # a plain attribute: never saved
    return step


__all__ = ["DecodeWeights", "KVCache", "compiled_decode_step", "decode_step", "decode_weights", "new_cache"]
