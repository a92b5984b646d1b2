"""One decoder-only Transformer: Llama's layout by default, and the mechanisms of the families
lmforge imports (Gemma 3/2, OLMo 2, Mistral, Qwen2/3) as named `ModelConfig` fields, each with one
code site (in functional.py, which the fused decode step of decode.py calls too; or here, attention.py,
loss.py), a test against a reference computed in the test (tests/test_families_model.py) and one
parity test against transformers (tests/test_families_hf.py).
The family names themselves live at the edges (lmforge.export.families).

Architecture choices (the defaults):
- RMSNorm before attention and before the MLP, and once more before the output
  (`norm_placement`: "sandwich" adds one after each, "post" keeps only those; `norm_offset`: the
  `(offset + w)` form, computed in float32);
- rotary position embeddings on q and k, in the half-split ("rotate_half") layout that
  Hugging Face's Llama uses, with positions given per token (they reset per document);
- grouped-query attention (n_kv_heads <= n_heads), backends in `attention.py`, scaled by
  1/sqrt(head_dim) (`attn_scale`), optionally soft-capped (`attn_softcap`), each layer full or
  sliding (`layer_types`, `sliding_window`) with its own RoPE base (`rope_theta_sliding`) or none
  (`nope_layers`); QK-norm per head or over the projection (`qk_norm`, `qk_norm_scope`);
- SwiGLU MLP (w2(silu(w1 x) * w3 x)), ffn_dim = 8/3 dim rounded up to 64 unless set
  (`mlp_activation = "gelu_tanh"`: GeGLU);
- embeddings times `embed_scale`; logits optionally soft-capped (`final_softcap`);
- no biases (except Qwen2-style q/k/v biases, `qkv_bias`, for imported models); optional tied
  input/output embeddings; optional Llama 3.1 RoPE frequency scaling (`rope_scaling`);
- the vocabulary is the tokenizer's, padded to a multiple of 64 for the embedding (P6):
  the padding rows are never inputs or targets, and the logits are exactly the
  tokenizer's vocab wide (the output weight is sliced before the matmul).
Names follow Meta's Llama reference (dim, n_layers, n_heads, n_kv_heads, vocab_size,
ffn_dim, norm_eps, rope_theta, max_seq_len); Hugging Face names live in export.py only.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lmforge.config import ModelConfig
from lmforge.contract import Contract, padded_vocab_size
from lmforge.errors import ConfigError, ContractError
from lmforge.model import decode
from lmforge.model.attention import BACKENDS, AttentionMask, prepare_mask, resolve_backend
from lmforge.model.decode import KVCache
from lmforge.model.functional import (ACTIVATIONS, apply_rope, qk_norm, rms_norm, scale_embedding, scale_logits,
                                      softcap, sublayer)
from lmforge.model.loss import linear_cross_entropy_sum
from lmforge.model.memory import ROPE_BLOCK_ELEMENTS, check_fits_in_memory
from lmforge.runtime import compute_dtype


def resolve_model_config(model: ModelConfig, contract: Contract, where: str = "model.vocab_size") -> ModelConfig:
    """The model config with vocab_size taken from the contract (P6).

    Raises:
        ContractError: a hand-set vocab_size below the tokenizer's, or different from it.
    """
    v = model.vocab_size
    if v and v < contract.vocab_size:
        raise ContractError(
            f"{where} = {v} is below the tokenizer's vocab size {contract.vocab_size}: token ids up to "
            f"{contract.vocab_size - 1} would index past the embedding. Remove model.vocab_size "
            f"(lmforge derives it from the tokenizer's contract)."
        )
    if v and v not in (contract.vocab_size, contract.model_vocab_size):
        raise ContractError(
            f"{where} = {v} differs from the tokenizer's vocab size {contract.vocab_size} "
            f"(padded: {contract.model_vocab_size}). Remove model.vocab_size; it is derived."
        )
    return replace(model, vocab_size=contract.vocab_size)


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + weight) over the last dimension (Zhang & Sennrich 2019).

    offset 0: Llama's form, in x's dtype. offset 1: Gemma's `(1 + w)` form, computed in float32
    and cast after the multiply (transformers' `Gemma3RMSNorm`); its weights start at 0."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: ModelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (max_seq_len, head_dim) float32, half-split layout (RoFormer, Su et al. 2021).

    With `scaling.rope_scaling == "llama3"`, the inverse frequencies are scaled as Llama 3.1
    does (Meta's reference `apply_scaling`; transformers' `_compute_llama3_parameters`):
    wavelengths above original_max_seq_len / low_freq_factor are divided by `rope_factor`,
    those below original_max_seq_len / high_freq_factor kept, and the band between
    interpolated smoothly.

    The angles are computed in float64 a block of rows at a time (`ROPE_BLOCK_ELEMENTS`), so
    the memory taken is the two float32 tables (what `memory.rope_bytes` counts), not float64
    temporaries of their size; the values are those of the whole table at once, bit for bit.

    Raises:
        ConfigError: the memory here cannot hold the tables (model.max_seq_len too large).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None and scaling.rope_scaling == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, scaling.rope_factor, scaling.rope_low_freq_factor,
                                   scaling.rope_high_freq_factor, scaling.rope_original_max_seq_len)
    half = head_dim // 2
    rows = max(1, ROPE_BLOCK_ELEMENTS // max(half, 1))
    try:
        cos, sin = torch.empty(max_seq_len, head_dim), torch.empty(max_seq_len, head_dim)
        for start in range(0, max_seq_len, rows):
            stop = min(start + rows, max_seq_len)
            angles = torch.outer(torch.arange(start, stop, dtype=torch.float64), inv_freq)  # (rows, hd/2)
            for table, values in ((cos, angles.cos()), (sin, angles.sin())):
                table[start:stop, :half] = values  # cast to float32 as the whole table's .float() rounds
                table[start:stop, half:] = values
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and "alloc" not in str(exc):
            raise
        need = 2 * 4 * max_seq_len * head_dim
        raise ConfigError(
            f"model.max_seq_len = {max_seq_len:,} with a head size of {head_dim}: the rotary tables (cos and sin, "
            f"float32) need {need / 2**30:,.2f} GiB and this process could not get that memory. Lower "
            f"model.max_seq_len (or free memory, or raise the process's memory limit, `ulimit -v`).") from None
    return cos, sin


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_seq_len: int) -> torch.Tensor:
    """Llama 3.1's frequency scaling of RoPE's inverse frequencies (hd/2,) float64 (Meta's
    `apply_scaling` in llama-models; transformers' `_compute_llama3_parameters`)."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_seq_len / low_freq_factor
    high_wavelen = original_max_seq_len / high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim()
        self.scale = cfg.attn_scale or None  # None: sdpa's 1/sqrt(head_dim)
        self.softcap = cfg.attn_softcap
        bias = cfg.qkv_bias  # Qwen2's layout: biases on q, k and v only
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # QK-norm before the rotary embedding: over each head (Qwen3, Gemma 3) or over the whole
        # q and k projections before the split into heads (OLMo 2); `functional.qk_norm`
        self.qk_norm = cfg.qk_norm and cfg.qk_norm_scope
        whole = cfg.qk_norm_scope == "projection"
        self.q_norm, self.k_norm = (RMSNorm(self.head_dim * (n if whole else 1), cfg.norm_eps, cfg.norm_offset)
                                    if cfg.qk_norm else nn.Identity() for n in (cfg.n_heads, cfg.n_kv_heads))
        self.backend = "sdpa"

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: AttentionMask,
                cache: KVCache | None = None):
        """x: (B, T, dim); rope: (cos, sin) (B, 1, T, hd) each, or None (a NoPE layer)."""
        B, T, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # (B, T, H*hd), (B, T, KV*hd) x 2
        norms = (self.q_norm, self.k_norm)
        q, k = qk_norm(q, k, norms, self.qk_norm, "projection")
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        q, k = qk_norm(q, k, norms, self.qk_norm, "head")
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, KV, offset + T, hd)
        y = BACKENDS[self.backend](q, k, v, mask, scale=self.scale, softcap=self.softcap)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, dim)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.resolved_ffn_dim()
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.act = ACTIVATIONS[cfg.mlp_activation]

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One layer. Norms by `norm_placement`: "pre" (x + f(norm(x))), "sandwich" (x +
    post_norm(f(norm(x))), Gemma 2/3), "post" (x + post_norm(f(x)), OLMo 2); an absent norm is an
    `nn.Identity` (no parameters), and `functional.sublayer` the one body of every placement."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        pre, post = cfg.norm_placement in ("pre", "sandwich"), cfg.norm_placement in ("sandwich", "post")

        def norm(present):
            return RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset) if present else nn.Identity()

        self.attention_norm = norm(pre)
        self.attention = Attention(cfg, layer)
        self.attention_post_norm = norm(post)
        self.ffn_norm = norm(pre)
        self.feed_forward = FeedForward(cfg)
        self.ffn_post_norm = norm(post)
        # which of the forward's rotary tables and masks this layer takes
        # a sliding layer takes tables of its own only with its own base (Gemma 3's local RoPE, never
        # scaled); otherwise it rotates as the full layers do, rope_scaling included (Mistral)
        own = cfg.is_sliding(layer) and bool(cfg.rope_theta_sliding)
        self.rope = None if layer in cfg.nope_layers else "sliding" if own else "full"
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else 0
        self.residual_scale = cfg.residual_scale

    def forward(self, x, ropes: dict, masks: dict, cache=None):
        rope, mask = ropes.get(self.rope), masks[self.window]
        x = sublayer(x, lambda h: self.attention(h, rope, mask, cache), self.attention_norm, self.attention_post_norm,
                     self.residual_scale)
        return sublayer(x, self.feed_forward, self.ffn_norm, self.ffn_post_norm, self.residual_scale)


class Transformer(nn.Module):
    """The lmforge model. `config.vocab_size` must be the tokenizer's (see resolve_model_config).
    `init_weights=False`: no draw, for a caller that loads every weight next (`load_model`)."""

    def __init__(self, config: ModelConfig, init_weights: bool = True):
        super().__init__()
        if config.vocab_size <= 0:
            raise ConfigError(
                "model.vocab_size is 0: derive it from the tokenizer with "
                "lmforge.model.resolve_model_config(config, contract) before building the model."
            )
        check_fits_in_memory(config)  # before allocating: a mistyped size is an error, not an OOM or a hang
        self.config = config
        self.vocab_size = config.vocab_size
        self.model_vocab_size = padded_vocab_size(config.vocab_size)
        self.tok_embeddings = nn.Embedding(self.model_vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)
        # a tied head to be loaded is never allocated; from scratch, its draws keep every seed's stream
        meta = config.tie_embeddings and not init_weights
        self.output = nn.Linear(config.dim, self.model_vocab_size, bias=False, device="meta" if meta else None)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        hd = config.resolved_head_dim()
        cos, sin = rope_tables(hd, config.max_seq_len, config.rope_theta, config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if any(b.rope == "sliding" for b in self.layers):  # sliding layers' own base, never scaled (Gemma 3)
            cos, sin = rope_tables(hd, config.max_seq_len, config.rope_theta_sliding)
            self.register_buffer("rope_cos_sliding", cos, persistent=False)
            self.register_buffer("rope_sin_sliding", sin, persistent=False)
        self.set_attention("eager" if config.attn_softcap else "sdpa")  # sdpa cannot soft-cap
        #: train.activation_checkpointing (set by the Trainer): keep each block's input, recompute in backward
        self.activation_checkpointing = False
        if init_weights:
            self.reset_parameters()

    def set_attention(self, backend: str) -> None:
        """Choose the attention backend ("sdpa", "flex" or "eager"; resolve "auto" first).

        Raises:
            ConfigError: an unknown backend, or "sdpa" for a model with attn_softcap."""
        if backend not in BACKENDS:
            raise ConfigError(f"attention backend {backend!r}: expected one of {sorted(BACKENDS)}.")
        resolve_backend(backend, "cpu", training=False, softcap=self.config.attn_softcap)  # sdpa + soft-cap refused
        for block in self.layers:
            block.attention.backend = backend

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None, zero_init: bool = False) -> None:
        """Normal(0, 0.02) weights; residual projections (wo, w2) scaled by 1/sqrt(2 n_layers)
        (GPT-2, Radford et al. 2019); RMSNorm weights 1. With `zero_init`, wo, w2 and an untied
        head start at 0 (modded-nanogpt; pretraining's train.zero_init); the random draws are
        made all the same, so the other weights do not change."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = 0.02
        zeroed = ("wo.weight", "w2.weight") + (() if self.config.tie_embeddings else ("output.weight",))
        for name, p in self.named_parameters():
            if name.endswith((".lora_a", ".lora_b")):  # LoRA adapters keep their own values (model/lora.py)
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0 - self.config.norm_offset)  # a gain of 1 in either form
            elif name.endswith(".bias"):
                p.zero_()
            elif zero_init and name.endswith(zeroed):
                torch.randn(p.shape, generator=gen)  # keep the other weights' draws unchanged
                p.zero_()
            else:
                s = std / math.sqrt(2 * self.config.n_layers) if name.endswith(("wo.weight", "w2.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen).mul_(s))  # one temporary: randn(...) * s's values

    def num_parameters(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        heads = (self.tok_embeddings,) + (() if self.config.tie_embeddings else (self.output,))
        return n - sum(m.weight.numel() for m in heads) if non_embedding else n

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
               document_ids: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, dim); see `forward` for the arguments."""
        B, T = tokens.shape
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + T, device=tokens.device).expand(B, T)
        device = tokens.device
        dtype = compute_dtype(device, self.output.weight.dtype)  # the compute dtype of q, k, v
        ropes = {}  # rotary tables by layer kind: (B, 1, T, hd) cos and sin
        for kind in {b.rope for b in self.layers} - {None}:
            suffix = "_sliding" if kind == "sliding" else ""
            ropes[kind] = tuple(getattr(self, f"rope_{f}{suffix}")[positions][:, None].to(dtype) for f in ("cos", "sin"))
        # One mask per window for all layers (the block-diagonal document mask, or the cache's
        # mask; a sliding layer's also keeps keys within its window): 0 = full attention.
        backend = self.layers[0].attention.backend
        masks = {}
        for window in {b.window for b in self.layers}:
            if cache is None:
                masks[window] = prepare_mask(backend, T, device, dtype, document_ids, n_heads=self.config.n_heads,
                                             window=window)
            else:
                masks[window] = prepare_mask(backend, T, device, dtype, None, cache.length, cache.key_mask,
                                             cache.length + T, window=window)
        x = self.embed(tokens)  # (B, T, dim)
        # activation checkpointing (Chen et al. 2016, arXiv 1604.06174): autograd keeps each block's input
        # (B, T, dim) and runs the block's forward again during backward (torch.utils.checkpoint,
        # non-reentrant: the same kernels on the same inputs, so the same gradients bit for bit)
        recompute = self.activation_checkpointing and cache is None and torch.is_grad_enabled()
        for block in self.layers:
            x = checkpoint(block, x, ropes, masks, use_reentrant=False) if recompute else block(x, ropes, masks, cache)
        if cache is not None:
            cache.length += T
        return self.norm(x)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(...) int64 token ids -> (..., dim) embeddings in the parameters' dtype, times `embed_scale`
        (Gemma: sqrt(dim), in float32; transformers: in the weights' dtype)."""
        return scale_embedding(self.tok_embeddings(tokens), self.config.embed_scale)

    def logits(self, h: torch.Tensor, product=None) -> torch.Tensor:
        """(..., dim) -> (..., vocab_size): the padding rows of the output never take part;
        divided by `logit_scale`, soft-capped with `final_softcap`. `product`: h -> h @ output.weight[:vocab_size].T computed
        another way (the decode step's prepacked head), the default F.linear."""
        h = scale_logits(h, self.config.logit_scale)
        y = F.linear(h, self.output.weight[: self.vocab_size]) if product is None else product(h)
        return softcap(y, self.config.final_softcap)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                *, targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                groups: torch.Tensor | None = None, n_groups: int = 0, temperature: float = 1.0) -> torch.Tensor:
        """Next-token logits, or the summed training loss when `targets` is given.

        Args:
            tokens: (B, T) int64, ids < vocab_size.
            positions: (B, T) int64 rotary positions (default 0..T-1, or continuing the cache).
            document_ids: (B, T) int segment ids; attention stays within a segment (default: one).
            cache: a KVCache for generation (prefill, then T = 1 decode steps).
            targets, loss_mask: (B, T) int64 / bool. When given, return the sum of cross-entropy
                (nats) over positions where loss_mask is True: lmforge's one loss
                (`lmforge.model.loss.linear_cross_entropy_sum`), which never materialises the
                float32 logits. Going through forward keeps DDP/FSDP hooks in the path.
            groups, n_groups: with targets, (B, T) int64 in [0, n_groups): return each group's
                sum instead, (n_groups,) float32 nats (a group is a row, or a document of a
                packed row: the sequence log-probabilities DPO compares are their negatives; one
                group per position: each token's, RL's).
            temperature: with targets, the loss of softmax(logits / temperature) (RL: the sampler's).
        Returns:
            logits: (B, T, vocab_size) in the compute dtype (float32, or bf16 under autocast);
            or, with targets, a 0-dim float32 tensor ((n_groups,) with `groups`).
        """
        h = self.hidden(tokens, positions, document_ids, cache)
        if targets is None:
            return self.logits(h)
        if loss_mask is None:
            loss_mask = torch.ones_like(targets, dtype=torch.bool)
        weight = self.output.weight[: self.vocab_size]
        return linear_cross_entropy_sum(scale_logits(h, self.config.logit_scale), weight, targets, loss_mask,
                                        groups=groups, n_groups=n_groups,
                                        softcap=self.config.final_softcap, temperature=temperature)

    # -- the decode path (lmforge.model.decode): delegates, for the callers of these methods --
    def new_cache(self, batch: int, max_len: int, key_mask: torch.Tensor | None = None) -> KVCache:
        """An empty KVCache for `batch` rows of `max_len` slots (see `decode.new_cache`)."""
        return decode.new_cache(self, batch, max_len, key_mask)

    def decode_weights(self, dtype: torch.dtype | None = None) -> decode.DecodeWeights:
        """The parameters in the decode layout (see `decode.decode_weights`)."""
        return decode.decode_weights(self, dtype)

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                    slots: torch.Tensor | None = None, batch_invariant: bool = False) -> torch.Tensor:
        """One fused T = 1 decode step: (B,) tokens -> (B, vocab_size) logits (see `decode.decode_step`)."""
        return decode.decode_step(self, tokens, positions, cache, slots, batch_invariant)
