"""How much memory a model needs, and whether it fits here: the one estimate of activations
(`activation_bytes`), which the plan's per-rank estimate (lmforge.train.plan.memory_estimate),
the automatic micro-batch and the refusal of a model too large for the machine before anything
is allocated (`check_fits_in_memory`) all use; and the readers of the machine's memory (its size, what is still available)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lmforge.config import ModelConfig
from lmforge.contract import padded_vocab_size
from lmforge.errors import ConfigError


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the model `cfg` describes (vocab padded to 64, an untied head counted)."""
    V, d, hd = padded_vocab_size(max(cfg.vocab_size, 1)), cfg.dim, cfg.resolved_head_dim()
    attention = d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd + cfg.n_heads * hd * d
    per_layer = attention + 3 * d * cfg.resolved_ffn_dim() + 2 * d + (2 * hd if getattr(cfg, "qk_norm", False) else 0)
    per_layer += (cfg.n_heads + 2 * cfg.n_kv_heads) * hd if getattr(cfg, "qkv_bias", False) else 0
    return V * d * (1 if cfg.tie_embeddings else 2) + cfg.n_layers * per_layer + d


def memory_bytes() -> int:
    """Physical memory of this machine (bytes), or of the CUDA device when there is one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


#: Elements of float64 angles `transformer.rope_tables` computes at a time (8 MiB each).
ROPE_BLOCK_ELEMENTS = 1 << 20


def rope_bytes(cfg: ModelConfig) -> int:
    """Bytes of the rotary tables the model builds (`transformer.rope_tables`): float32 cos and sin
    of max_seq_len x head_dim, once, and once more for sliding layers with their own base
    (`ModelConfig.own_sliding_rope`), plus the float64 block they are computed through (the angles,
    their cos and their sin)."""
    tables = 1 + cfg.own_sliding_rope()
    return tables * 2 * 4 * cfg.max_seq_len * cfg.resolved_head_dim() + 3 * 8 * ROPE_BLOCK_ELEMENTS


#: Rows of float32 logits the fused loss (lmforge.model.loss.linear_cross_entropy) holds at a time.
LOSS_CHUNK_ROWS = 256


def activation_bytes(cfg: ModelConfig, tokens: int, compute_bytes: int = 4, recompute: bool = False) -> int:
    """Bytes autograd keeps for backward over `tokens` trained tokens: tokens x n_layers x
    (12 dim + 4 ffn) elements of the compute dtype (`compute_bytes` each) — roughly the tensors
    kept per block (the norms' inputs and outputs, q, k, v, the attention output, the MLP's
    projections and activation; the fused attention kernels keep no T x T matrix) — plus the
    loss's float32 chunk (LOSS_CHUNK_ROWS x vocab, logits and their gradient). Measured on this
    project's CPU: the steps added 1.0-1.3 x (gradients + optimizer state + this), 2.1 x for a
    2-layer dim-128 model (lmforge.train.plan). `recompute` (train.activation_checkpointing): each
    block's input (dim elements a token a layer) and one block's tensors while it is recomputed."""
    block = 12 * cfg.dim + 4 * cfg.resolved_ffn_dim()
    per_token = (cfg.n_layers * cfg.dim + block if recompute else cfg.n_layers * block) * compute_bytes
    return tokens * per_token + LOSS_CHUNK_ROWS * padded_vocab_size(max(cfg.vocab_size, 1)) * 4 * 2


def available_memory(device: torch.device) -> int:
    """Bytes this process may still take: CUDA `mem_get_info` (free), else /proc/meminfo's
    MemAvailable (the physical memory where it cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return memory_bytes()


_libc = None


def release_free_memory() -> None:
    """Hand the heap's free pages back to the kernel (glibc's `malloc_trim(0)`; a no-op where the C
    library is another). glibc keeps what a step frees for its next allocations: after a forward's
    temporaries, about 1 GB of a LoRA step of the SmolLM2-135M shape at 4 x 256 rows that the
    resident memory counts (bench/RESULTS.md, 2026-11-29); the Trainer trims after each forward and
    backward under train.activation_checkpointing on CPU."""
    global _libc
    if _libc is None:
        try:
            import ctypes

            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


def memory_need(cfg: ModelConfig, training: bool = True) -> tuple[int, int]:
    """(fixed bytes, bytes per trained token) of the estimate `check_fits_in_memory` explains,
    before any model is built: float32 weights (x4 when training: gradients and AdamW's two
    moments), rotary tables (`rope_bytes`) and, when training, the loss's chunk; per token the activations of
    `activation_bytes` in float32."""
    weights = 4 * parameter_count(cfg) * (4 if training else 1)
    rope = rope_bytes(cfg)
    if not training:
        return weights + rope, 0
    chunk = activation_bytes(cfg, 0)
    return weights + rope + chunk, activation_bytes(cfg, 1) - chunk


def check_fits_in_memory(cfg: ModelConfig, training_tokens: int = 0) -> None:
    """Refuse a model (and, with `training_tokens` = micro-batch rows x seq_len, a training
    step) that cannot fit in memory, before anything is allocated.

    Estimate (float32, `memory_need`): weights 4 bytes/parameter (training: x4, with gradients
    and AdamW's two moments), rotary tables, and the activations of `activation_bytes`.

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


__all__ = ["LOSS_CHUNK_ROWS", "ROPE_BLOCK_ELEMENTS", "activation_bytes", "available_memory", "parameter_count",
           "release_free_memory",
           "memory_bytes", "memory_need", "rope_bytes", "check_fits_in_memory"]
