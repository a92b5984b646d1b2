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
import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from lmforge.config import CONFIG_FILE, Config, ModelConfig
from lmforge.contract import CONTRACT_FILE, Contract, check_match, padded_vocab_size
from lmforge.errors import ConfigError, ContractError
from lmforge.model.attention import BACKENDS, AttentionMask, prepare_mask
from lmforge.model.io import MODEL_FILE, load_weights, read_checkpoint_meta, resolve_checkpoint
from lmforge.model.loss import linear_cross_entropy_sum


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
        self.weights: DecodeWeights | None = None  # built by the first `Transformer.decode_step`

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

        with torch.no_grad():
            self.layers = []
            for b in model.layers:
                a, f = b.attention, b.feed_forward
                self.layers.append((t(a.wq.weight, a.wk.weight, a.wv.weight, norm=b.attention_norm.weight),
                                    t(a.wo.weight), t(f.w1.weight, f.w3.weight, norm=b.ffn_norm.weight),
                                    t(f.w2.weight)))
            self.norm = model.norm.weight
            # Qwen2's q/k/v biases: each layer's cat(bq, bk, bv) (H*hd + 2*KV*hd,), added after the norm scale
            self.qkv_bias = [torch.cat((b.attention.wq.bias, b.attention.wk.bias, b.attention.wv.bias)).to(dtype)
                             for b in model.layers] if model.config.qkv_bias else None
            # QK-norm (Qwen3): each layer's (q_norm, k_norm) weights, (hd,) each, in the compute dtype
            self.qk_norm = [(b.attention.q_norm.weight.to(dtype), b.attention.k_norm.weight.to(dtype))
                            for b in model.layers] if model.config.qk_norm else None
            w = model.output.weight[: model.vocab_size]
            self.head_t = w.numel() * dtype.itemsize <= self.HEAD_COPY_LIMIT
            self.head = t(w) if self.head_t else w.to(dtype)
            half = model.config.head_dim // 2
            sign = torch.ones(model.config.head_dim, device=w.device)
            sign[:half] = -1
            self.cos = model.rope_cos.to(dtype)  # (max_seq_len, hd)
            self.sin_signed = (model.rope_sin * sign).to(dtype)
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


def check_fits_in_memory(cfg: ModelConfig, training_tokens: int = 0) -> None:
    """Refuse a model (and, with `training_tokens` = micro-batch rows x seq_len, a training
    step) that cannot fit in memory, before anything is allocated.

    Estimate (float32): weights 4 bytes/parameter (training: x4, with gradients and AdamW's
    two moments), rotary tables, and per trained token the activations kept for backward
    (~ n_layers x (12 dim + 3 ffn) values) plus a row of the loss's logit gradient (V values).

    Raises:
        ConfigError: naming the estimate, the memory, and the keys to lower.
    """
    weights = 4 * parameter_count(cfg) * (4 if training_tokens else 1)
    rope = 8 * cfg.max_seq_len * cfg.head_dim
    per_token = 4 * (cfg.n_layers * (12 * cfg.dim + 3 * cfg.resolved_ffn_dim()) + padded_vocab_size(max(cfg.vocab_size, 1)))
    need = weights + rope + training_tokens * per_token
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
        dtype = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
                 else self.output.weight.dtype)  # the compute dtype of q, k, v
        cos = self.rope_cos[positions][:, None].to(dtype)  # (B, 1, T, hd)
        sin = self.rope_sin[positions][:, None].to(dtype)
        # One mask for all layers (the block-diagonal document mask, or the cache's mask).
        backend = self.layers[0].attention.backend
        if cache is None:
            mask = prepare_mask(backend, T, device, dtype, document_ids)
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
                *, targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
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
        Returns:
            logits: (B, T, vocab_size) in the compute dtype (float32, or bf16 under autocast);
            or, with targets, a 0-dim float32 tensor.
        """
        h = self.hidden(tokens, positions, document_ids, cache)
        if targets is None:
            return self.logits(h)
        if loss_mask is None:
            loss_mask = torch.ones_like(targets, dtype=torch.bool)
        return linear_cross_entropy_sum(h, self.output.weight[: self.vocab_size], targets, loss_mask)

    def decode_weights(self, dtype: torch.dtype | None = None) -> DecodeWeights:
        """The decode layout of the current parameters in `dtype` (default: theirs), made once and
        kept until a parameter changes (its storage or version) or another dtype is asked for."""
        dtype = dtype or self.output.weight.dtype
        key = (dtype, tuple((p.data_ptr(), 0 if p.is_inference() else p._version)  # inference tensors: no version
                            for p in self.parameters()))
        w = self.__dict__.get("_decode_weights")
        if w is None or w.key != key:
            w = DecodeWeights(self, dtype)
            w.key = key
            self.__dict__["_decode_weights"] = w  # a plain attribute: not a buffer, never saved
        return w

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                    slots: torch.Tensor | None = None, batch_invariant: bool = False) -> torch.Tensor:
        """One T = 1 decode step on the cache: the same model as `forward`, computed with fused
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
        w = cache.weights
        dev = tokens.device
        dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else self.output.weight.dtype
        if w is None or w.dtype != dtype:
            w = cache.weights = self.decode_weights(dtype)
        c = self.config
        B, H, KV, hd = tokens.shape[0], c.n_heads, c.n_kv_heads, c.head_dim
        G, eps, scale = H // KV, c.norm_eps, 1.0 / math.sqrt(hd)
        cos = w.cos[positions][:, None]  # (B, 1, hd), broadcast over heads
        sin = w.sin_signed[positions][:, None]
        if slots is None:
            at = cache.length
            S = at + 1
            bias = None
            if cache.key_mask is not None:  # (B, 1, S): 0 where attended, -inf at padding
                bias = torch.zeros(B, 1, S, dtype=dtype, device=dev).masked_fill_(
                    ~cache.key_mask[:, None, :S], float("-inf"))
        else:
            S = cache.max_len
            rows = torch.arange(B, device=dev)
            allowed = torch.arange(S, device=dev)[None] <= slots[:, None]  # (B, S)
            bias = torch.zeros(B, 1, S, dtype=dtype, device=dev).masked_fill_(~allowed[:, None], float("-inf"))
        if bias is not None:
            bias = bias.repeat_interleave(KV, 0)  # (B*KV, 1, S), the layout of the scores below
        if w.packed is not None and (B > 1 or batch_invariant):
            layers, head, mm = w.packed, w.packed_head, _onednn_linear
        else:
            layers, head, mm = w.layers, w.head, torch.matmul
        x = self.tok_embeddings(tokens)  # (B, dim); the residual stays in the parameters' dtype
        def inv_rms(x):  # (B, dim) -> (B, 1): 1 / rms(x), RMSNorm without its weight
            return torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))

        for layer, (wqkv, wo, w13, w2) in enumerate(layers):
            qkv = mm(x, wqkv).mul_(inv_rms(x))
            if w.qkv_bias is not None:
                qkv = qkv.add_(w.qkv_bias[layer])
            qkv = qkv.view(B, H + 2 * KV, hd)
            qk = qkv[:, : H + KV]
            if w.qk_norm is not None:  # RMSNorm per head of q and of k, before the rotary embedding
                qn, kn = w.qk_norm[layer]
                qk = torch.cat((F.rms_norm(qk[:, :H], (hd,), qn, eps), F.rms_norm(qk[:, H:], (hd,), kn, eps)), 1)
            # rotary on q and k at once: x cos + rotate_half(x) sin
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
            scores = (torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale) if bias is not None
                      else torch.bmm(q, keys.transpose(1, 2)).mul_(scale))  # (B*KV, G, S)
            y = torch.bmm(scores.softmax(-1), cv[:, :, :S].reshape(B * KV, S, hd))  # (B*KV, G, hd)
            x = x + mm(y.view(B, H * hd), wo)
            gate, up = mm(x, w13).mul_(inv_rms(x)).chunk(2, -1)  # (B, ffn) each
            x = x + mm(F.silu(gate).mul_(up), w2)
        if slots is None:
            cache.length += 1
        h = x * inv_rms(x) * w.norm
        return mm(h, head) if w.head_t else F.linear(h, w.head)

    def new_cache(self, batch: int, max_len: int, key_mask: torch.Tensor | None = None) -> KVCache:
        p = self.output.weight
        dtype = torch.get_autocast_dtype(p.device.type) if torch.is_autocast_enabled(p.device.type) else p.dtype
        c = self.config
        return KVCache(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, dtype, p.device, key_mask)

    @classmethod
    def from_checkpoint(cls, folder: str | Path, device: str | torch.device = "cpu") -> "Transformer":
        """Load a trained model from a checkpoint folder (a `step_NNNNNN/` or a run folder,
        whose newest complete checkpoint is used). Strict: missing or unexpected keys fail.

        Raises:
            CheckpointError / ContractError: see `load_model`.
        """
        return load_model(folder, device)[0]


def load_model(folder: str | Path, device: str | torch.device = "cpu", contract: Contract | None = None,
               contract_path: str | Path = "the tokenizer") -> tuple[Transformer, Config, Contract, Path]:
    """(model in eval mode, config, contract, checkpoint path) from a checkpoint or run folder.

    Raises:
        CheckpointError / ContractError: incomplete or damaged checkpoint, non-finite weights,
        or a contract that differs from `contract` (when given).
    """
    path = resolve_checkpoint(folder)
    config, own = read_checkpoint_meta(path)
    if contract is not None:
        check_match(contract, contract_path, own, path / CONTRACT_FILE)
    model = Transformer(resolve_model_config(config.model, own, where=f"{path}/{CONFIG_FILE} model.vocab_size"))
    load_weights(model, path / MODEL_FILE)
    return model.to(device).eval(), config, own, path
