"""One Llama-style decoder-only Transformer.

Architecture choices:
- RMSNorm before attention and before the MLP, and once more before the output;
- rotary position embeddings on q and k, in the half-split ("rotate_half") layout that
  Hugging Face's Llama uses, with positions given per token (they reset per document);
- grouped-query attention (n_kv_heads <= n_heads), backends in `attention.py`;
- SwiGLU MLP (w2(silu(w1 x) * w3 x)), ffn_dim = 8/3 dim rounded up to 64 unless set;
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

from lmforge.config import ModelConfig
from lmforge.contract import Contract, padded_vocab_size
from lmforge.errors import ConfigError, ContractError
from lmforge.model import decode
from lmforge.model.attention import BACKENDS, AttentionMask, prepare_mask
from lmforge.model.decode import KVCache
from lmforge.model.loss import linear_cross_entropy_sum
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
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bf16 q/k under autocast (qk_norm): the weight in x's dtype keeps the fused kernel
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: ModelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (max_seq_len, head_dim) float32, half-split layout (RoFormer, Su et al. 2021).

    With `scaling.rope_scaling == "llama3"`, the inverse frequencies are scaled as Llama 3.1
    does (Meta's reference `apply_scaling`; transformers' `_compute_llama3_parameters`):
    wavelengths above original_max_seq_len / low_freq_factor are divided by `rope_factor`,
    those below original_max_seq_len / high_freq_factor kept, and the band between
    interpolated smoothly.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None and scaling.rope_scaling == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, scaling.rope_factor, scaling.rope_low_freq_factor,
                                   scaling.rope_high_freq_factor, scaling.rope_original_max_seq_len)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (S, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (S, hd)
    return angles.cos().float(), angles.sin().float()


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, h, T, hd); cos, sin: (B, 1, T, hd), in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        bias = cfg.qkv_bias  # Qwen2's layout: biases on q, k and v only
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's q and k, before the rotary embedding
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.backend = "sdpa"

    def forward(self, x, cos, sin, mask: AttentionMask, cache: KVCache | None = None):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, KV, offset + T, hd)
        y = BACKENDS[self.backend](q, k, v, mask)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, dim)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.resolved_ffn_dim()
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, mask: AttentionMask, cache=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The lmforge model. `config.vocab_size` must be the tokenizer's (see resolve_model_config)."""

    def __init__(self, config: ModelConfig):
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
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, self.model_vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta, config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.set_attention("sdpa")
        self.reset_parameters()

    def set_attention(self, backend: str) -> None:
        """Choose the attention backend ("sdpa" or "flex"; resolve "auto" first)."""
        if backend not in BACKENDS:
            raise ConfigError(f"attention backend {backend!r}: expected one of {sorted(BACKENDS)}.")
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
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif zero_init and name.endswith(zeroed):
                torch.randn(p.shape, generator=gen)  # keep the other weights' draws unchanged
                p.zero_()
            else:
                s = std / math.sqrt(2 * self.config.n_layers) if name.endswith(("wo.weight", "w2.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)

    def num_parameters(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_embeddings.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.output.weight.numel()
        return n

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
               document_ids: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, dim); see `forward` for the arguments."""
        B, T = tokens.shape
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + T, device=tokens.device).expand(B, T)
        device = tokens.device
        dtype = compute_dtype(device, self.output.weight.dtype)  # the compute dtype of q, k, v
        cos = self.rope_cos[positions][:, None].to(dtype)  # (B, 1, T, hd)
        sin = self.rope_sin[positions][:, None].to(dtype)
        # One mask for all layers (the block-diagonal document mask, or the cache's mask).
        backend = self.layers[0].attention.backend
        if cache is None:
            mask = prepare_mask(backend, T, device, dtype, document_ids, n_heads=self.config.n_heads)
        else:
            mask = prepare_mask(backend, T, device, dtype, None, cache.length, cache.key_mask, cache.length + T)
        x = self.tok_embeddings(tokens)  # (B, T, dim)
        for block in self.layers:
            x = block(x, cos, sin, mask, cache)
        if cache is not None:
            cache.length += T
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., dim) -> (..., vocab_size): the padding rows of the output never take part."""
        return F.linear(h, self.output.weight[: self.vocab_size])

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                *, targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                groups: torch.Tensor | None = None, n_groups: int = 0) -> torch.Tensor:
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
                packed row: the sequence log-probabilities DPO compares are their negatives).
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
        return linear_cross_entropy_sum(h, weight, targets, loss_mask, groups=groups, n_groups=n_groups)

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


# Moved out of the model file (their names stay importable from here): the memory estimate
# (lmforge.model.memory) and checkpoint reading, LoRA base included (lmforge.model.load, which
# also binds Transformer.from_checkpoint).
from lmforge.model.memory import check_fits_in_memory, memory_bytes, memory_need, parameter_count  # noqa: E402,F401
