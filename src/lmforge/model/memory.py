"""How much memory a model needs, and whether it fits here: the estimate that refuses a model
too large for the machine before anything is allocated (`check_fits_in_memory`), and the
figures the plan (lmforge.train.plan) builds on."""

from __future__ import annotations

import os

import torch

from lmforge.config import ModelConfig
from lmforge.contract import padded_vocab_size
from lmforge.errors import ConfigError


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the model `cfg` describes (vocab padded to 64, an untied head counted)."""
    V, d, hd = padded_vocab_size(max(cfg.vocab_size, 1)), cfg.dim, cfg.head_dim
    attention = d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd + cfg.n_heads * hd * d
    per_layer = attention + 3 * d * cfg.resolved_ffn_dim() + 2 * d + (2 * hd if getattr(cfg, "qk_norm", False) else 0)
    per_layer += (cfg.n_heads + 2 * cfg.n_kv_heads) * hd if getattr(cfg, "qkv_bias", False) else 0
    return V * d * (1 if cfg.tie_embeddings else 2) + cfg.n_layers * per_layer + d


def memory_bytes() -> int:
    """Physical memory of this machine (bytes), or of the CUDA device when there is one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_need(cfg: ModelConfig, training: bool = True) -> tuple[int, int]:
    """(fixed bytes, bytes per trained token) of the estimate `check_fits_in_memory` explains:
    float32 weights (x4 when training: gradients and AdamW's two moments) and rotary tables;
    per token the activations kept for backward and a row of the loss's logit gradient."""
    weights = 4 * parameter_count(cfg) * (4 if training else 1)
    rope = 8 * cfg.max_seq_len * cfg.head_dim
    per_token = 4 * (cfg.n_layers * (12 * cfg.dim + 3 * cfg.resolved_ffn_dim()) + padded_vocab_size(max(cfg.vocab_size, 1)))
    return weights + rope, per_token


def check_fits_in_memory(cfg: ModelConfig, training_tokens: int = 0) -> None:
    """Refuse a model (and, with `training_tokens` = micro-batch rows x seq_len, a training
    step) that cannot fit in memory, before anything is allocated.

    Estimate (float32): weights 4 bytes/parameter (training: x4, with gradients and AdamW's
    two moments), rotary tables, and per trained token the activations kept for backward
    (~ n_layers x (12 dim + 3 ffn) values) plus a row of the loss's logit gradient (V values).

    Raises:
        ConfigError: naming the estimate, the memory, and the keys to lower.
    """
    fixed, per_token = memory_need(cfg, training=bool(training_tokens))
    need = fixed + training_tokens * per_token
    have = memory_bytes()
    if need > have:
        gib = 2**30
        raise ConfigError(
            f"the model (dim {cfg.dim}, {cfg.n_layers} layers, ffn {cfg.resolved_ffn_dim()}, vocab {cfg.vocab_size}, "
            f"max_seq_len {cfg.max_seq_len}"
            + (f", {training_tokens:,} tokens per micro-batch" if training_tokens else "")
            + f") needs about {need / gib:,.1f} GiB, more than the {have / gib:,.1f} GiB of memory here. Lower "
            f"model.dim, model.n_layers, model.max_seq_len"
            + (", train.micro_batch_size or data.seq_len." if training_tokens else "."))


__all__ = ["parameter_count", "memory_bytes", "memory_need", "check_fits_in_memory"]
