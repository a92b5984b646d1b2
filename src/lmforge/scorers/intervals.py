"""Intervals for rates over few samples (a held-out set of 20 functions is not a precise figure)."""

from __future__ import annotations

import math


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a rate k / n (Wilson 1927; z = 1.96: 95%): (low, high) in [0, 1];
    (0.0, 1.0) when n = 0. Unlike the normal approximation it stays inside [0, 1] and is not
    zero-width at k = 0 or k = n."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


__all__ = ["wilson_interval"]
