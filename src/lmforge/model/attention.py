"""Attention backends: `sdpa` and `flex`, equal within float tolerance on the same inputs.

Both take q: (B, H, T, hd), k, v: (B, KV, S, hd) with H a multiple of KV (grouped-query
attention) and return (B, H, T, hd). Masking rules (P2, P5, P7):

- training / prefill without a cache: causal, and when `document_ids` (B, T) is given,
  block-diagonal causal (a token sees earlier tokens of its own segment only);
- with a KV cache: query i (absolute slot `offset + i`) sees cache slots j <= offset + i
  that `key_mask` (B, S) marks valid (left padding in batched generation).

Every path handles T = 1 (the single-token decode step). `is_causal=True` is used
only when T == S, because PyTorch aligns its causal mask top-left when they differ.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from lmforge.errors import ConfigError


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int -> (B, 1, T, T) bool: True where query i may attend key j
    (same segment and j <= i)."""
    T = document_ids.shape[-1]
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal)[:, None]


def cache_mask(T: int, offset: int, key_mask: torch.Tensor | None, S: int, device) -> torch.Tensor:
    """(B or 1, 1, T, S) bool for queries at slots offset..offset+T-1 over S cache slots."""
    q = torch.arange(offset, offset + T, device=device)[:, None]
    k = torch.arange(S, device=device)[None, :]
    mask = (k <= q)[None, None]  # (1, 1, T, S)
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :S]
    return mask


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    document_ids: torch.Tensor | None = None,
    cache_offset: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    T, S = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if cache_offset is None:
        if document_ids is None or bool((document_ids == document_ids[:, :1]).all()):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(document_ids), enable_gqa=gqa)
    if key_mask is None and T == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)  # one query sees all S
    mask = cache_mask(T, cache_offset, key_mask, S, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    document_ids: torch.Tensor | None = None,
    cache_offset: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlexAttention with a BlockMask built from `document_ids` (compiled on CUDA).

    Decode steps with a cache go through sdpa: a block mask buys nothing for T = 1.
    """
    if cache_offset is not None:
        return sdpa_attention(q, k, v, document_ids, cache_offset, key_mask)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention as flex

    B, _, T, _ = q.shape
    if document_ids is None:
        def mask_mod(b, h, qi, ki):
            return qi >= ki
    else:
        docs = document_ids

        def mask_mod(b, h, qi, ki):
            return (qi >= ki) & (docs[b, qi] == docs[b, ki])
    block_mask = create_block_mask(mask_mod, B, None, T, T, device=q.device)
    fn = _compiled_flex() if q.is_cuda else flex
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


BACKENDS = {"sdpa": sdpa_attention, "flex": flex_attention}


def resolve_backend(name: str, device: torch.device | str, training: bool = True) -> str:
    """"auto" -> "flex" on CUDA, "sdpa" elsewhere. An explicit "flex" for CPU training is
    an error: in torch 2.13 FlexAttention has no backward pass on CPU."""
    device = torch.device(device)
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if name == "flex" and training and device.type != "cuda":
        raise ConfigError(
            f"model.attention = \"flex\" cannot train on {device.type}: FlexAttention has no backward "
            f"pass on CPU in this torch. Set model.attention=\"sdpa\" (or \"auto\")."
        )
    if name not in BACKENDS:
        raise ConfigError(f"model.attention = {name!r}: expected one of auto, sdpa, flex.")
    return name
