"""The model's mechanisms, each written once: the training forward (`transformer.py`, `attention.py`)
and the fused decode step (`decode.py`) both call these, so a mechanism added here reaches both.

- `rms_norm` / `norm_gain`: RMSNorm with its `norm_offset` (Gemma's `(1 + w)`); `norm_of`: one
  of the model's norm modules as the decode step applies it; `FoldedNorm` / `inv_rms`: the same
  norm folded into the matrix after it (the decode step's pre-norms);
- `sublayer`: a residual sublayer with its norms placed by `norm_placement` (an absent norm is
  the identity, so one body covers "pre", "sandwich" and "post": litgpt's layout) and its
  output scaled by `residual_scale`;
- `qk_norm`: QK-norm at its scope ("head" or "projection");
- `apply_rope`: the rotary embedding, or none (a NoPE layer);
- `key_allowed`: causal attention and the sliding window;
- `scale_embedding`, `scale_logits`, `softcap`, and the MLP's `ACTIVATIONS`.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

#: model.mlp_activation -> the gate's activation (GELU's tanh form is transformers' gelu_pytorch_tanh).
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}

Norm = Callable[[torch.Tensor], torch.Tensor]


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's soft-capping of attention scores and logits (cap 0: x as is)."""
    return torch.tanh(x / cap) * cap if cap else x


def scale_embedding(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Token embeddings (..., dim) times `model.embed_scale` (Gemma: sqrt(dim)), in x's dtype; 1: x as is."""
    return x * scale if scale != 1.0 else x


def norm_gain(weight: torch.Tensor, offset: float) -> torch.Tensor:
    """An RMSNorm's effective gain (offset + weight), (dim,): float32 with an offset (Gemma's
    `(1 + w)`, transformers' `Gemma3RMSNorm`), else the weight as it is."""
    return weight.float() + offset if offset else weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x / rms(x) * (offset + weight) over the last dimension (Zhang & Sennrich 2019), x's dtype.

    offset 0: Llama's form, in x's dtype (the weight cast to it: bf16 q/k under autocast keep
    the fused kernel). offset != 0: computed in float32 and cast after the multiply."""
    if offset:  # Gemma: float32 throughout, one cast at the end
        return torch.rms_norm(x.float(), x.shape[-1:], norm_gain(weight, offset), eps).to(x.dtype)
    w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    return torch.rms_norm(x, x.shape[-1:], w, eps)  # (F.rms_norm's op, one Python call fewer: decoding counts them)


def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., dim) -> (..., 1): 1 / rms(x), RMSNorm without its gain. With the gain folded into the
    rows of the matrix that follows, rms_norm(x) @ W = (x @ diag(gain) W) * inv_rms(x)."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))


def identity(x):
    """An absent norm (the model's `nn.Identity`)."""
    return x


class Float32Norm:
    """`rms_norm` on x in float32, cast back to x's dtype (see `norm_of`)."""

    def __init__(self, gain: torch.Tensor, eps: float):
        self.gain, self.eps = gain, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return rms_norm(x, self.gain, self.eps)
        return rms_norm(x.float(), self.gain, self.eps).to(x.dtype)


def norm_of(module: torch.nn.Module, dtype: torch.dtype | None = None, float32: bool = False) -> Callable:
    """One of the model's norms as the decode step applies it: `identity` for an absent one (an
    nn.Identity), else `rms_norm` with the gain (`norm_gain`: offset + w) made once. `float32` (the
    norms of the residual stream and of its branches): on x in float32, cast back to x's dtype;
    else in x's dtype with the gain in `dtype` (QK-norm: the compute dtype). Equal to the forward's
    norms in float32; under bf16 autocast the decode step's own precision (as before issue 54)."""
    if isinstance(module, torch.nn.Identity):
        return identity
    gain = norm_gain(module.weight, module.offset)
    if float32:
        return Float32Norm(gain, module.eps)
    return functools.partial(rms_norm, weight=gain if dtype is None else gain.to(dtype), eps=module.eps)


class Folded(tuple):
    """(x, scale): a sublayer's input x (B, dim) with its pre-norm pending. The norm's gain is folded
    into the rows of the matrix after it (`decode.fuse`) and scale (B, 1) = 1/rms(x) scales the
    rows of that product (`decode.linear`): rms_norm(x) @ W = (x @ diag(gain) W) * inv_rms(x)."""


class FoldedNorm:
    """A pre-norm whose gain is folded into the next matrix: x -> `Folded` (x, 1/rms(x))."""

    def __init__(self, eps: float):
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> Folded:
        return Folded((x, inv_rms(x, self.eps)))


def sublayer(x: torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor], pre: Norm, post: Norm,
             scale: float = 1.0) -> torch.Tensor:
    """x + post(f(pre(x))) * scale: a residual sublayer (attention, MLP) with the norms
    `norm_placement` gives it: "pre" a norm before f, "post" one after it (OLMo 2), "sandwich"
    both (Gemma 2/3). An absent norm is the identity. `scale`: `model.residual_scale` (Granite's
    residual_multiplier; 1: no multiply). x: (..., dim), the residual stream."""
    y = post(f(pre(x)))
    return x + (y * scale if scale != 1.0 else y)


def scale_logits(h: torch.Tensor, logit_scale: float) -> torch.Tensor:
    """The final hidden states (..., dim) divided by `model.logit_scale` before the output
    projection, so the logits are divided by it in every path (Granite's logits_scaling:
    transformers divides the logits); 1: h as is."""
    return h / logit_scale if logit_scale != 1.0 else h


def qk_norm(q: torch.Tensor, k: torch.Tensor, norms: tuple[Norm, Norm], scope: str | bool,
            stage: str) -> tuple[torch.Tensor, torch.Tensor]:
    """QK-norm at `stage` of the attention: "projection" (q (..., H*hd) and k (..., KV*hd) before the
    split into heads: OLMo 2) or "head" (each head's (..., hd), after the split, before the rotary
    embedding: Qwen3, Gemma 3). q and k through `norms` (q's, k's) when `stage` is the model's
    `scope` (False: no QK-norm), else q and k as they are."""
    return (norms[0](q), norms[1](k)) if scope == stage else (q, k)


class SignedRope(NamedTuple):
    """Rotary tables with rotate_half's minus sign folded into the sine: `sin_signed` is sin with
    its first half negated. `apply_rope` then takes one fused multiply-add (the decode step's form)."""

    cos: torch.Tensor
    sin_signed: torch.Tensor


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | SignedRope | None) -> torch.Tensor:
    """The rotary embedding (RoFormer, Su et al. 2021) in the half-split ("rotate_half") layout of
    Hugging Face's Llama: x cos + rotate_half(x) sin over the last dimension (hd).

    rope: (cos, sin) broadcastable to x, in x's dtype; a `SignedRope` (the same rotation as one
    multiply-add: equal up to its rounding); None: x as it is (a NoPE layer, `nope_layers`)."""
    if rope is None:
        return x
    half = x.shape[-1] // 2
    if isinstance(rope, SignedRope):
        return torch.addcmul(x * rope.cos, x.roll(half, -1), rope.sin_signed)
    cos, sin = rope
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def key_allowed(q: torch.Tensor, k: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Whether a query at slot q may attend a key at slot k (broadcast, bool): causal (k <= q), and
    with a sliding `window` W > 0 also q - k < W (the query's own key counts: W keys in all;
    transformers' `sliding_window_overlay`, llama.cpp's `is_masked_swa`)."""
    allowed = k <= q
    return allowed & (q - k < window) if window else allowed
