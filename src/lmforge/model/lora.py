"""LoRA: low-rank adapters on the blocks' linear layers (Hu et al. 2021, arXiv 2106.09685).

A target `nn.Linear` (attention wq wk wv wo, MLP w1 w2 w3; `config.LORA_TARGETS`) is
replaced by a `LoRALinear` that keeps the same `weight` (and `bias`) parameter under the same
state-dict key (`layers.0.attention.wq.weight`) and adds two beside it:
    lora_a  (rank, in_features)   Kaiming-uniform (a = sqrt(5)), as PEFT's `reset_lora_parameters`
    lora_b  (out_features, rank)  zeros, so an injected model computes exactly the base model
    y = x W^T + b + scale * dropout(x) A^T B^T,  scale = alpha / rank (alpha / sqrt(rank) with
    use_rslora, Kalajdzievski 2023).
`inject` freezes every other parameter. The output head and the embedding are never targets
(`config.check_lora` refuses them). Consumers never see adapters: `lmforge.model.load_model`
merges a LoRA checkpoint into plain weights (W + scale B A, in float32 then cast to W's dtype,
`merged_state`), so the fused decode path (`model/decode.py`, which reads weights directly),
export and serving take it as any other model.

A LoRA run's `model.safetensors` holds the adapter tensors only (`adapter_state`), with the
base checkpoint's location and the sha256 of its model.safetensors in the file's metadata
(`BASE_PATH_KEY`, `BASE_SHA256_KEY`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from lmforge.config import LORA_TARGETS, LoRAConfig, check_lora
from lmforge.errors import ConfigError
from lmforge.contract import file_sha256  # noqa: F401  (the one file hash; re-exported for the stages)

#: safetensors metadata of a LoRA checkpoint's model.safetensors: the base checkpoint folder
#: (resolved) and the sha256 of its model.safetensors.
BASE_PATH_KEY = "lora_base"
BASE_SHA256_KEY = "lora_base_sha256"
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")


def lora_scale(lo: LoRAConfig) -> float:
    """alpha / rank, or alpha / sqrt(rank) with use_rslora."""
    return lo.alpha / (math.sqrt(lo.rank) if lo.use_rslora else lo.rank)


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank adapter beside its weight (see the module docstring).

    `merged`: the adapter is folded into `weight` (`merge`); `disabled`: the adapter is left
    out of forward (`adapters_disabled`)."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float,
                 generator: torch.Generator | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        w = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, dtype=w.dtype, device=w.device))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, dtype=w.dtype, device=w.device))
        self.scale = scale
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.disabled = False
        self._base_weight: torch.Tensor | None = None
        self.reset_adapter(generator)

    @torch.no_grad()
    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """A Kaiming-uniform with a = sqrt(5) (bound 1/sqrt(in_features), nn.Linear's and
        PEFT's init), B zero."""
        a = torch.empty(self.lora_a.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_a.copy_(a)
        self.lora_b.zero_()

    def delta(self) -> torch.Tensor:
        """scale * B A, (out, in) float32."""
        return self.scale * (self.lora_b.detach().float() @ self.lora_a.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.merged or self.disabled:
            return y
        a, b = self.lora_a, self.lora_b
        if a.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            a, b = a.to(x.dtype), b.to(x.dtype)
        # y + scale * (x A^T) B^T as one addmm into a fresh output: no (..., out) temporaries for the
        # adapter's product, its scaling and the sum (three passes over the output before)
        xa = F.linear(self.dropout(x), a)  # (..., rank)
        out = torch.addmm(y.reshape(-1, y.shape[-1]), xa.reshape(-1, xa.shape[-1]), b.t(), alpha=self.scale)
        return out.view(y.shape)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the adapter into `weight` (W + scale B A in float32, cast to W's dtype); the base
        weight is kept to restore by `unmerge`. Merging a merged layer does nothing."""
        if self.merged:
            return
        self._base_weight = self.weight.detach().clone()
        self.weight.copy_((self.weight.float() + self.delta()).to(self.weight.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Restore the base weight bit for bit (the copy `merge` kept)."""
        if not self.merged:
            return
        self.weight.copy_(self._base_weight)
        self._base_weight = None
        self.merged = False


def lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def is_adapter_key(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def inject(model: nn.Module, lo: LoRAConfig, seed: int = 0) -> nn.Module:
    """Replace the target linear layers of every block of `model` (a Transformer) by
    LoRALinear layers (in place) and freeze every other parameter; returns `model`.

    The adapters' A matrices are drawn from one generator seeded with `seed`, block by block
    in `lo.targets` order (the same seed gives the same adapters on every rank).

    Raises:
        ConfigError: rank 0, an unknown target, the head or the embedding as a target.
        ValueError: the model already has adapters.
    """
    check_lora(lo)
    if lo.rank < 1:
        raise ConfigError(f"lora.rank = {lo.rank}: adapters need rank >= 1 (0 means full fine-tuning).")
    if has_adapters(model):
        raise ValueError("the model already has LoRA adapters; merge them into a plain model first")
    for target in lo.targets:  # B A of rank r can be no richer than min(in, out): a larger r only costs
        parent = model.layers[0].attention if target in LORA_TARGETS[:4] else model.layers[0].feed_forward
        out_f, in_f = getattr(parent, target).weight.shape
        if lo.rank > min(out_f, in_f):
            raise ConfigError(f"lora.rank = {lo.rank} exceeds the smaller side of the {target} layer ({out_f} x {in_f}: "
                              f"{min(out_f, in_f)}); a rank past it adds parameters and no expressiveness. Set "
                              f"lora.rank <= {min(out_f, in_f)}, or leave {target} out of lora.targets.")
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    scale = lora_scale(lo)
    for block in model.layers:
        for target in lo.targets:
            parent = block.attention if target in LORA_TARGETS[:4] else block.feed_forward
            base = getattr(parent, target)
            setattr(parent, target, LoRALinear(base, lo.rank, scale, lo.dropout, gen))
    return model


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, `model` computes its base model (no adapter term; a merged model is
    unmerged first and merged again after)."""
    layers = [m for _, m in lora_layers(model)]
    was_merged = [m.merged for m in layers]
    for m in layers:
        m.unmerge()
        m.disabled = True
    try:
        yield model
    finally:
        for m, merged in zip(layers, was_merged):
            m.disabled = False
            if merged:
                m.merge()


def merge(model: nn.Module) -> None:
    """Fold every adapter into its weight (idempotent; see LoRALinear.merge)."""
    for _, m in lora_layers(model):
        m.merge()


def unmerge(model: nn.Module) -> None:
    """Undo `merge`, restoring every base weight bit for bit."""
    for _, m in lora_layers(model):
        m.unmerge()


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter entries of a state dict (what a LoRA checkpoint saves)."""
    return {k: v for k, v in state.items() if is_adapter_key(k)}


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain Transformer state dict of `model`: every adapted weight replaced by
    W + scale B A (computed in float32, cast to W's dtype), no adapter keys. `model` is not
    changed (a merged model's weights are taken as they are)."""
    state = {k: v.detach() for k, v in model.state_dict().items() if not is_adapter_key(k)}
    for name, m in lora_layers(model):
        if not m.merged:
            state[f"{name}.weight"] = (m.weight.detach().float() + m.delta()).to(m.weight.dtype)
    return state


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = ["LoRALinear", "inject", "adapters_disabled", "merge", "unmerge", "merged_state", "adapter_state",
           "has_adapters", "is_adapter_key", "lora_layers", "lora_scale", "file_sha256", "trainable_parameters",
           "BASE_PATH_KEY", "BASE_SHA256_KEY"]
