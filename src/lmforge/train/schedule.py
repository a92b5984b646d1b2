"""Learning-rate schedules: a pure function of the step, so resume needs only the step."""

from __future__ import annotations

import math

from lmforge.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of `cfg.steps`.

    cosine: linear warmup over warmup_steps, then cosine from lr to lr * min_lr_ratio
    (Loshchilov & Hutter 2017). wsd: warmup, constant, then linear decay over the last
    decay_fraction of the steps (warmup-stable-decay; Hu et al. 2024, MiniCPM). constant:
    warmup, then lr (the tuning stages' schedule where a few steps must all count).

    Every step trains: the decays reach lr * min_lr_ratio only after the last step (cosine's last
    step is 1 / (steps - warmup) short of it; wsd's n decay steps stop 1 / (n + 1) short), so a
    one-step run trains at lr / 2, not at the floor.
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    start = decay_start(cfg.steps, cfg.decay_fraction)
    if step < start:
        return peak
    # n decay steps are n of the n + 1 equal stretches from lr to the floor: the last trains at
    # lr / (n + 1) above it (it reached the floor exactly before, so a 1-step run trained nothing)
    progress = min(1.0, (step - start + 1) / (cfg.steps - start + 1))
    return peak + (floor - peak) * progress


def decay_start(steps: int, decay_fraction: float) -> int:
    """wsd: the first step (0-based) of the linear decay over the last `decay_fraction` of `steps`
    (at least one step of decay)."""
    return steps - max(1, int(round(decay_fraction * steps)))
