"""Attention backends: `sdpa` and `flex`, equal within float tolerance on the same inputs.

Both take q: (B, H, T, hd), k, v: (B, KV, S, hd) with H a multiple of KV (grouped-query
attention) and return (B, H, T, hd). Masking rules (P2, P5, P7):

- training / prefill without a cache: causal, and when `document_ids` (B, T) is given,
  block-diagonal causal (a token sees earlier tokens of its own segment only). Segments
  come from the packer (`data/packing.py`: the data's document offsets, never token ids);
  padding is a segment of its own, so no real token ever attends to a pad.
- with a KV cache: query i (absolute slot `offset + i`) sees cache slots j <= offset + i
  that `key_mask` (B, S) marks valid (left padding in batched generation).

`sdpa` uses `is_causal=True` when every row of the batch is one segment (a row filled by
one document, or no `document_ids`), else an additive float mask (0 / -inf, (B, 1, T, T),
broadcast over heads and grouped-query aware through `enable_gqa`). `is_causal=True` is
used only when T == S, because PyTorch aligns its causal mask top-left when they differ.
`flex` uses FlexAttention with a `BlockMask` from `create_block_mask` over `document_ids`,
compiled on CUDA. On CPU it runs the unfused eager FlexAttention (forward only: torch
2.13 has no FlexAttention backward on CPU), which is what `resolve_backend` allows there.

A model calls its backend once per layer with the same `document_ids` tensor, so the
mask derived from it (the single-segment test, the float mask, the BlockMask) is built
once per forward and reused by the other layers (`_per_document_ids`): on CUDA that is
one host sync and one `create_block_mask` per forward instead of one per layer.

Every path handles T = 1 (the single-token decode step), batch 1 and padded rows.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lmforge.errors import ConfigError


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int -> (B, 1, T, T) bool: True where query i may attend key j
    (same segment and j <= i). Every query may attend at least to itself."""
    T = document_ids.shape[-1]
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal)[:, None]


def additive_document_mask(document_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, T) int -> (B, 1, T, T) `dtype`: 0 where `document_mask` is True, -inf elsewhere.
    The same numbers sdpa makes from a bool mask, made once instead of once per layer."""
    allowed = document_mask(document_ids)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def one_segment_per_row(document_ids: torch.Tensor) -> bool:
    """True when every row of `document_ids` (B, T) holds a single segment (plain causal
    attention is then exact). A host sync on CUDA."""
    return bool((document_ids == document_ids[:, :1]).all())


def cache_mask(T: int, offset: int, key_mask: torch.Tensor | None, S: int, device) -> torch.Tensor:
    """(B or 1, 1, T, S) bool for queries at slots offset..offset+T-1 over S cache slots."""
    q = torch.arange(offset, offset + T, device=device)[:, None]
    k = torch.arange(S, device=device)[None, :]
    mask = (k <= q)[None, None]  # (1, 1, T, S)
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :S]
    return mask


# -- masks built once per forward --------------------------------------------------------------
# kind -> (weak reference to the document_ids tensor, its version counter, key, value).
# One entry per kind: the layers of one forward share one document_ids tensor.
_MEMO: dict[str, tuple[weakref.ref, int, Any, Any]] = {}


def _per_document_ids(kind: str, document_ids: torch.Tensor, key: Any, build: Callable[[], Any]) -> Any:
    """`build()`, reused while the same `document_ids` tensor (same object, not modified
    in place) comes back with the same `key`. Not memoized while torch.compile traces (the
    compiled graph builds it once anyway) or for inference-mode tensors (no version counter)."""
    if torch.compiler.is_compiling() or torch.is_inference(document_ids):
        return build()
    hit = _MEMO.get(kind)
    if hit is not None:
        ref, version, hit_key, value = hit
        if ref() is document_ids and version == document_ids._version and hit_key == key:
            return value
    value = build()

    def forget(dead: weakref.ref, kind: str = kind) -> None:  # free the mask with its tensor
        if _MEMO is None:  # interpreter shutdown
            return
        entry = _MEMO.get(kind)
        if entry is not None and entry[0] is dead:
            _MEMO.pop(kind, None)

    _MEMO[kind] = (weakref.ref(document_ids, forget), document_ids._version, key, value)
    return value


# -- sdpa ----------------------------------------------------------------------------------------
def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    document_ids: torch.Tensor | None = None,
    cache_offset: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with the masking rules of the module docstring.

    Args:
        q: (B, H, T, hd); k, v: (B, KV, S, hd), H a multiple of KV.
        document_ids: (B, T) int segment ids (no cache only); None: one segment.
        cache_offset: slots already in the cache (generation), or None for no cache (T == S).
        key_mask: (B, S) bool, valid cache slots (generation with left padding).
    Returns:
        (B, H, T, hd), q's dtype.
    """
    T, S = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if cache_offset is None:
        if document_ids is None or _per_document_ids("one", document_ids, None,
                                                     lambda: one_segment_per_row(document_ids)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        mask = _per_document_ids("sdpa", document_ids, (q.dtype, q.device),
                                 lambda: additive_document_mask(document_ids.to(q.device), q.dtype))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if key_mask is None and T == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)  # one query sees all S
    mask = cache_mask(T, cache_offset, key_mask, S, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


# -- flex ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document_block_mask(document_ids: torch.Tensor | None, T: int, device: torch.device):
    """A FlexAttention `BlockMask` for T queries over T keys: causal within each segment of
    `document_ids` (B, T), or plain causal (broadcast over the batch) when it is None."""
    from torch.nn.attention.flex_attention import create_block_mask

    if document_ids is None:
        return create_block_mask(_causal, None, None, T, T, device=device)
    docs = document_ids.to(device)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    return create_block_mask(same_document_causal, docs.shape[0], None, T, T, device=device)


def flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    document_ids: torch.Tensor | None = None,
    cache_offset: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlexAttention with a BlockMask built from `document_ids` (compiled on CUDA; the
    unfused eager implementation elsewhere, forward only on CPU). Arguments and result as
    `sdpa_attention`.

    Decode steps with a cache go through sdpa: a block mask buys nothing for T = 1.
    """
    if cache_offset is not None:
        return sdpa_attention(q, k, v, document_ids, cache_offset, key_mask)
    from torch.nn.attention.flex_attention import flex_attention as flex

    T = q.shape[2]
    if document_ids is None:
        block_mask = _causal_block_mask(T, q.device)
    else:
        block_mask = _per_document_ids("flex", document_ids, (T, q.device),
                                       lambda: document_block_mask(document_ids, T, q.device))
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    with warnings.catch_warnings():  # eager flex is the documented CPU path: no compile warning
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def _causal_block_mask(T: int, device: torch.device):
    if torch.compiler.is_compiling():
        return document_block_mask(None, T, device)
    return _causal_block_mask_cached(T, str(device))


@functools.lru_cache(maxsize=8)
def _causal_block_mask_cached(T: int, device: str):
    return document_block_mask(None, T, torch.device(device))


BACKENDS = {"sdpa": sdpa_attention, "flex": flex_attention}


def resolve_backend(name: str, device: torch.device | str, training: bool = True) -> str:
    """The backend for `model.attention` on `device`: "auto" -> "flex" on CUDA, "sdpa"
    elsewhere; "sdpa" and "flex" as given.

    Raises:
        ConfigError: an unknown name, or an explicit "flex" for training on a device other
            than CUDA (torch 2.13's FlexAttention has no backward pass on CPU). Stages call
            this before any work, so the error comes at config time.
    """
    device = torch.device(device)
    if name not in ("auto", *BACKENDS):
        raise ConfigError(f"model.attention = {name!r}: expected one of 'auto', 'sdpa', 'flex'. "
                          f"Set model.attention=\"auto\".")
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if name == "flex" and training and device.type != "cuda":
        raise ConfigError(
            f"model.attention = \"flex\" cannot train on {device.type}: FlexAttention has no backward "
            f"pass on CPU in torch {torch.__version__.split('+')[0]} (expected a CUDA device for \"flex\"). "
            f"Set model.attention=\"sdpa\" (or \"auto\", which picks flex on CUDA and sdpa elsewhere)."
        )
    return name
