"""The one loss path for every stage (P3).

A training step's loss is the sum of per-token cross-entropy (nats) over the
supervised targets of *all* its micro-batches and data-parallel ranks, divided by the
number of those targets. `cross_entropy_sum` gives one micro-batch's numerator; the
trainer counts the denominator first (all micro-batches, all-reduced over ranks), then
runs the backward passes. A micro-batch with no supervised target adds exactly 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy (nats) over supervised positions.

    Args:
        logits: (B, T, V) float (any dtype; computed in float32).
        targets: (B, T) int64.
        loss_mask: (B, T) bool; only True positions count (targets elsewhere are never read
            as labels, so a pad id equal to a real id cannot leak in, P4).
    Returns:
        0-dim float32 tensor (0.0 when nothing is supervised, never NaN).
    """
    V = logits.shape[-1]
    mask = loss_mask.reshape(-1)
    flat = logits.reshape(-1, V)
    t = targets.reshape(-1)
    if not bool(mask.all()):
        flat, t = flat[mask], t[mask]
    if t.numel() == 0:
        return flat.sum().float() * 0.0
    return F.cross_entropy(flat.float(), t, reduction="sum")
