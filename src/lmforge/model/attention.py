"""Attention backends: `sdpa`, `flex` and `eager`, equal within float tolerance on the same inputs.

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
Under torch.compile, bf16 training on CPU goes through `cpu_attention` (`model/cpu_attention.py`):
sdpa's forward kernel with a backward written as batched matrix products (faster there, as exact).
`flex` uses FlexAttention with a `BlockMask` from `create_block_mask` over `document_ids`,
compiled on CUDA. On CPU it runs the unfused eager FlexAttention (forward only: torch
2.13 has no FlexAttention backward on CPU), which is what `resolve_backend` allows there.

The mask is prepared once per forward (`prepare_mask`, called by the Transformer before
its layers) and handed to every layer: one single-segment test, one float mask or one
`create_block_mask` per forward instead of one per layer (on CUDA, one host sync).
`sdpa_attention` / `flex_attention` are the one-call forms (prepare, then attend).

Sliding layers (`window` W > 0, Gemma 2/3, Mistral): query i also sees only keys j with
0 <= i - j < W (transformers' `sliding_window_overlay`, llama.cpp's `is_masked_swa`), ANDed with
the rules above: within a packed row, index distance is position distance inside a document.
Every backend takes the scores' `scale` (None: 1/sqrt(hd)); `softcap` (Gemma 2's c tanh(s/c)
after scaling, before the mask) is computed by `eager` and `flex` and refused by `sdpa`.

Every path handles T = 1 (the single-token decode step), batch 1 and padded rows.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lmforge.errors import ConfigError
from lmforge.model.cpu_attention import cpu_attention_applies, cpu_attention
from lmforge.model.functional import key_allowed, softcap as soft_cap


def window_mask(T: int, S: int, offset: int, window: int, device) -> torch.Tensor:
    """(T, S) bool for queries at slots offset..offset+T-1 over S key slots: causal (j <= i),
    and with `window` W > 0 also i - j < W (the query's own key counts: W keys in all)."""
    q = torch.arange(offset, offset + T, device=device)[:, None]  # (T, 1)
    k = torch.arange(S, device=device)[None, :]  # (1, S)
    return key_allowed(q, k, window)


def document_mask(document_ids: torch.Tensor, window: int = 0) -> torch.Tensor:
    """(B, T) int -> (B, 1, T, T) bool: True where query i may attend key j
    (same segment and j <= i, and i - j < window when it is > 0). Every query may attend at
    least to itself."""
    T = document_ids.shape[-1]
    # block-diagonal by segment: query i and key j in the same document; segments are
    # contiguous runs in a packed row, so "same id" is "same block"
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, 1) == (B, 1, T) -> (B, T, T)
    causal = window_mask(T, T, 0, window, document_ids.device)  # (T, T): j <= i (and within the window)
    return (same & causal)[:, None]  # (B, 1, T, T): broadcast over heads


def additive_document_mask(document_ids: torch.Tensor, dtype: torch.dtype, window: int = 0) -> torch.Tensor:
    """(B, T) int -> (B, 1, T, T) `dtype`: 0 where `document_mask` is True, -inf elsewhere.
    The same numbers sdpa makes from a bool mask, made once instead of once per layer."""
    allowed = document_mask(document_ids, window)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


@torch.compiler.disable
def one_segment_per_row(document_ids: torch.Tensor) -> bool:
    """True when every row of `document_ids` (B, T) holds a single segment (plain causal
    attention is then exact). A host sync on CUDA. Under `train.compile` it runs eagerly: a
    Python bool decides the graph (one for plain causal rows, one for the document mask)."""
    return bool((document_ids == document_ids[:, :1]).all())


def _one_training_graph(device: torch.device, dtype: torch.dtype, document_ids: torch.Tensor,
                        n_heads: int) -> bool:
    """Compiled bf16 training on CPU (`cpu_attention`'s path) keeps the document mask even
    for rows of one segment each: the masked path is as fast there (bench/RESULTS.md,
    2026-11-26) and the step compiles one graph instead of two (the recipe's stage: 25-30 s
    of its 460 s budget; 2026-11-26). Elsewhere `one_segment_per_row` picks plain causal."""
    B, T = document_ids.shape
    return cpu_attention_applies(device, dtype, B * n_heads * T * T)


def cache_mask(T: int, offset: int, key_mask: torch.Tensor | None, S: int, device, window: int = 0) -> torch.Tensor:
    """(B or 1, 1, T, S) bool for queries at slots offset..offset+T-1 over S cache slots (a
    row's real tokens fill consecutive slots, so slot distance is position distance)."""
    mask = window_mask(T, S, offset, window, device)[None, None]  # (1, 1, T, S): causal over the cache
    if key_mask is not None:  # left padding: pad slots are never keys (P5)
        mask = mask & key_mask[:, None, None, :S]  # (B, 1, T, S)
    return mask


# -- masks prepared once per forward ----------------------------------------------------------
@dataclass
class AttentionMask:
    """What every layer of one forward needs to attend: exactly one of `is_causal` (plain
    causal, T == S), `attn_mask` (sdpa: additive float or bool, broadcast over heads), or
    `block_mask` (flex); none of them means "attend to every key" (a T = 1 decode step)."""

    is_causal: bool = False
    attn_mask: torch.Tensor | None = None
    block_mask: Any = None


def prepare_mask(backend: str, T: int, device: torch.device, dtype: torch.dtype,
                 document_ids: torch.Tensor | None = None, cache_offset: int | None = None,
                 key_mask: torch.Tensor | None = None, S: int | None = None,
                 n_heads: int = 1, window: int = 0) -> AttentionMask:
    """The mask of one forward, for T queries.

    Args:
        backend: "sdpa", "flex" or "eager" (eager takes sdpa's masks).
        dtype: the dtype of q (the additive mask's dtype).
        document_ids: (B, T) segment ids (no cache only); None: one segment.
        cache_offset, key_mask, S: with a KV cache, the slots already filled, the (B, S) valid
            slots (left padding) and the number of keys after this step's update.
        n_heads: the query heads (the `cpu_attention` path's size cap).
        window: a sliding layer's W (keys within i - j < W only); 0 = full attention.
    """
    if cache_offset is not None:
        if window >= S:  # every key is within the window
            window = 0
        if key_mask is None and T == 1 and not window:
            return AttentionMask()  # one query sees all S keys
        return AttentionMask(attn_mask=cache_mask(T, cache_offset, key_mask, S, device, window))
    if window >= T:  # no query is further than T - 1 from a key: the window never slides
        window = 0
    if backend == "flex":
        width = flex_width(T, torch.device(device))
        if document_ids is None:  # causal (in the window): the padded queries come after every real one
            return AttentionMask(block_mask=_causal_block_mask(width, device, window))
        if width != T:  # padded slots are a segment of their own: no real query sees them
            document_ids = F.pad(document_ids, (0, width - T), value=-1)
        return AttentionMask(block_mask=document_block_mask(document_ids, width, device, window))
    if window:
        if document_ids is None:
            return AttentionMask(attn_mask=window_mask(T, T, 0, window, device)[None, None])
        return AttentionMask(attn_mask=additive_document_mask(document_ids.to(device), dtype, window))
    if document_ids is None or (not _one_training_graph(device, dtype, document_ids, n_heads)
                                and one_segment_per_row(document_ids)):
        return AttentionMask(is_causal=True)
    return AttentionMask(attn_mask=additive_document_mask(document_ids.to(device), dtype))


# -- sdpa ----------------------------------------------------------------------------------------
def sdpa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                scale: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """q: (B, H, T, hd), k, v: (B, KV, S, hd) -> (B, H, T, hd) with a prepared mask; `scale`
    None: 1/sqrt(hd).

    Compiled bf16 training on CPU takes `cpu_attention` (the same forward kernel, a faster
    backward); everything else `F.scaled_dot_product_attention`.

    Raises:
        ConfigError: a soft-cap, which sdpa cannot compute (`resolve_backend` says so first)."""
    if softcap:
        raise ConfigError(f"model.attention = \"sdpa\" cannot soft-cap attention scores (model.attn_softcap = "
                          f"{softcap}). Set model.attention=\"auto\" (eager on CPU, flex on CUDA).")
    if _takes_cpu_attention(q, k, v, mask):
        return cpu_attention(q, k, v, mask.attn_mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.attn_mask, is_causal=mask.is_causal,
                                          enable_gqa=q.shape[1] != k.shape[1], scale=scale)


def eager_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                 scale: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Attention with its scores as a matrix (transformers' `eager_attention_forward`): every
    mechanism (soft-cap included), any device, forward and backward; (B, H, T, S) float32
    scores per layer. Arguments and result as `sdpa_attend`."""
    B, H, T, hd = q.shape
    KV, S = k.shape[1], k.shape[2]
    if KV != H:
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
    scores = (q @ k.transpose(-1, -2)).float() * (hd ** -0.5 if scale is None else scale)  # (B, H, T, S)
    scores = soft_cap(scores, softcap)
    allowed = window_mask(T, S, S - T, 0, q.device) if mask.is_causal else mask.attn_mask
    if allowed is not None:  # lmforge's float masks are 0 / -inf
        allowed = allowed if allowed.dtype == torch.bool else allowed == 0
        # the lowest finite score, not -inf: a query with no key (a left-pad row) gets finite
        # numbers nobody reads, where -inf would make NaN that 0-weighted cache reads spread
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return scores.softmax(-1).to(q.dtype) @ v


def _takes_cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> bool:
    """Whether this call goes through `cpu_attention` (`cpu_attention_applies`, bf16 q/k/v
    with gradients wanted, T == S: training and prefill, plain causal or a document mask)."""
    return (cpu_attention_applies(q.device, q.dtype, q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])
            and q.dtype == k.dtype == v.dtype and (q.requires_grad or k.requires_grad or v.requires_grad)
            and mask.block_mask is None and (mask.is_causal or mask.attn_mask is not None)
            and q.shape[-2] == k.shape[-2])


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
    mask = prepare_mask("sdpa", q.shape[-2], q.device, q.dtype, document_ids, cache_offset, key_mask, k.shape[-2])
    return sdpa_attend(q, k, v, mask)


# -- flex ----------------------------------------------------------------------------------------
#: FlexAttention's kernels tile the sequence in blocks of this many tokens. On CUDA a row is padded
#: to a multiple of it: a packed RL row of 81 tokens failed to compile there ("NoValidChoicesError:
#: No choices to select" lowering flex_attention; torch 2.11, H200, 2026-11-27, bench/gpu_check.py),
#: and rows of varying widths would compile one kernel each (`_compiled_flex` is dynamic=False).
FLEX_BLOCK = 128


def flex_width(T: int, device: torch.device) -> int:
    """The width FlexAttention runs T tokens at: T rounded up to a multiple of FLEX_BLOCK on
    CUDA (the compiled kernel), T elsewhere (the eager reference needs no padding)."""
    return -(-T // FLEX_BLOCK) * FLEX_BLOCK if device.type == "cuda" else T


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _causal(b, h, q_idx, kv_idx):
    return key_allowed(q_idx, kv_idx)


@torch.compiler.disable
def document_block_mask(document_ids: torch.Tensor | None, T: int, device: torch.device, window: int = 0):
    """A FlexAttention `BlockMask` for T queries over T keys: causal within each segment of
    `document_ids` (B, T), or plain causal (broadcast over the batch) when it is None.

    Built eagerly, outside a `train.compile` graph (one graph break per forward, before the
    layers): traced into the compiled model, the mask made the first training step fail with
    "CUDA error: an illegal memory access" on an H200 (torch 2.11, 2026-11-26; the same model
    with the mask built eagerly, or with sdpa, trained)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if document_ids is None:
        return create_block_mask(_causal if not window else _causal_window(window), None, None, T, T, device=device)
    docs = document_ids.to(device)

    def same_document_causal(b, h, q_idx, kv_idx):
        return key_allowed(q_idx, kv_idx, window) & (docs[b, q_idx] == docs[b, kv_idx])

    return create_block_mask(same_document_causal, docs.shape[0], None, T, T, device=device)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                scale: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """FlexAttention with a prepared BlockMask (compiled on CUDA; the unfused eager
    implementation elsewhere, forward only on CPU). Cache steps (no block mask) go through
    sdpa: a block mask buys nothing for decoding."""
    if mask.block_mask is None:
        return (eager_attend if softcap else sdpa_attend)(q, k, v, mask, scale, softcap)
    from torch.nn.attention.flex_attention import flex_attention as flex

    gqa = q.shape[1] != k.shape[1]
    T, width = q.shape[-2], mask.block_mask.seq_lengths[0]
    if width > T:  # `flex_width`: zero rows after the real ones, masked off by the block mask, sliced off after
        q, k, v = (F.pad(x, (0, 0, 0, width - T)) for x in (q, k, v))
        return flex_attend(q, k, v, mask, scale, softcap)[..., :T, :]
    kwargs = dict(block_mask=mask.block_mask, enable_gqa=gqa, scale=scale,
                  score_mod=_softcap_score(softcap) if softcap else None)
    if q.is_cuda:
        return _compiled_flex()(q, k, v, **kwargs)
    with warnings.catch_warnings():  # eager flex is the documented CPU path: no compile warning
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        return flex(q, k, v, **kwargs)


@functools.lru_cache(maxsize=4)
def _softcap_score(cap: float):
    """A FlexAttention score_mod: cap * tanh(score / cap) (applied after scaling, before the mask)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return soft_cap(score, cap)
    return score_mod


def flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    document_ids: torch.Tensor | None = None,
    cache_offset: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlexAttention with a BlockMask built from `document_ids`; arguments and result as
    `sdpa_attention`."""
    mask = prepare_mask("flex", q.shape[-2], q.device, q.dtype, document_ids, cache_offset, key_mask, k.shape[-2])
    return flex_attend(q, k, v, mask)


def _causal_block_mask(T: int, device: torch.device, window: int = 0):
    if torch.compiler.is_compiling():
        return document_block_mask(None, T, device, window)
    return _causal_block_mask_cached(T, str(device), window)


@functools.lru_cache(maxsize=8)
def _causal_block_mask_cached(T: int, device: str, window: int = 0):
    return document_block_mask(None, T, torch.device(device), window)


@functools.lru_cache(maxsize=8)
def _causal_window(window: int):
    """A mask_mod: causal, and keys within the last `window` positions (a sliding layer)."""
    def causal_window(b, h, q_idx, kv_idx):
        return key_allowed(q_idx, kv_idx, window)
    return causal_window


#: backend name -> attend(q, k, v, AttentionMask, scale, softcap)
BACKENDS = {"sdpa": sdpa_attend, "flex": flex_attend, "eager": eager_attend}


#: FlexAttention's compiled kernel needs a head dimension of at least 16 (inductor: "NYI:
#: embedding dimension of the query, key, and value must be at least 16"; seen on an H100,
#: torch 2.11, 2026-11-26 (an H100)).
FLEX_MIN_HEAD_DIM = 16


def resolve_backend(name: str, device: torch.device | str, training: bool = True,
                    head_dim: int | None = None, softcap: float = 0.0) -> str:
    """The backend for `model.attention` on `device`: "auto" -> "flex" on CUDA (sdpa for a
    head_dim below FLEX_MIN_HEAD_DIM), "sdpa" elsewhere, "eager" where that cannot soft-cap
    (`softcap`, model.attn_softcap, off CUDA); "sdpa", "flex" and "eager" as given.

    Raises:
        ConfigError: an unknown name, an explicit "flex" for training on a device other
            than CUDA (torch 2.13's FlexAttention has no backward pass on CPU), or an explicit
            "flex" for a model whose head_dim (dim / n_heads) is below 16, an explicit "sdpa"
            with a soft-cap. Stages call this before any work, so the error comes at config time.
    """
    device = torch.device(device)
    if name not in ("auto", *BACKENDS):
        raise ConfigError(f"model.attention = {name!r}: expected one of 'auto', {', '.join(map(repr, BACKENDS))}. "
                          f"Set model.attention=\"auto\".")
    small = head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM
    if name == "auto":
        if device.type == "cuda" and not small:
            return "flex"
        return "eager" if softcap else "sdpa"
    if name == "sdpa" and softcap:
        raise ConfigError(f"model.attention = \"sdpa\" cannot soft-cap attention scores (model.attn_softcap = "
                          f"{softcap}): expected \"auto\", \"eager\" or \"flex\" (CUDA). Set model.attention=\"auto\".")
    if name == "flex" and training and device.type != "cuda":
        raise ConfigError(
            f"model.attention = \"flex\" cannot train on {device.type}: FlexAttention has no backward "
            f"pass on CPU in torch {torch.__version__.split('+')[0]} (expected a CUDA device for \"flex\"). "
            f"Set model.attention=\"sdpa\" (or \"auto\", which picks flex on CUDA and sdpa elsewhere)."
        )
    if name == "flex" and small:
        raise ConfigError(
            f"model.attention = \"flex\" with head_dim {head_dim} (model.dim / model.n_heads): FlexAttention's "
            f"kernel needs a head_dim of at least {FLEX_MIN_HEAD_DIM}. Set model.attention=\"auto\" (sdpa for "
            f"this model) or fewer heads.")
    return name
