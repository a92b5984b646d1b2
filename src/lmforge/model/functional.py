"""Elementwise pieces the training forward (`transformer.py`) and the fused decode step
(`decode.py`) share: the MLP's activations by `model.mlp_activation`, and soft-capping."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

#: model.mlp_activation -> the gate's activation (GELU's tanh form is transformers' gelu_pytorch_tanh).
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's soft-capping of attention scores and logits (cap 0: x as is)."""
    return torch.tanh(x / cap) * cap if cap else x
