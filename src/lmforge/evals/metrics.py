"""The numbers an evaluation reports, by the field's rules.

Multiple choice (lm-evaluation-harness's `acc` and `acc_norm`-style rules): the option with the
lowest mean per-token loss of its continuation wins (`acc`, lmforge's main figure: it does not
favour short options), and the option with the highest summed log-probability (`acc_sum`); a tie
between m options including the gold one scores 1/m, so a model that cannot tell the options apart
scores exactly the random baseline (never "index 0 wins"). The centred score (nanochat's
`core_eval.py`, DCLM's CORE) rescales accuracy so chance is 0 and perfect is 1:
(acc - baseline) / (1 - baseline). pass@k is Chen et al. 2021's unbiased estimator (arXiv
2107.03374, human-eval's `evaluation.py`): 1 - C(n - c, k) / C(n, k), computed as a product.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lmforge.errors import ConfigError
from lmforge.scorers.intervals import wilson_interval

#: Two scores closer than this (relative) are a tie.
TIE_TOLERANCE = 1e-9


def _best(values: Sequence[float], higher: bool) -> list[int]:
    top = max(values) if higher else min(values)
    return [i for i, v in enumerate(values) if math.isclose(v, top, rel_tol=TIE_TOLERANCE, abs_tol=1e-12)]


def choice_score(values: Sequence[float], gold: int, higher: bool) -> float:
    """1/m when the gold option is among the m options tied for best, else 0 (`higher`: the best
    is the largest value, else the smallest)."""
    best = _best(values, higher)
    return 1.0 / len(best) if gold in best else 0.0


def centred(accuracy: float, baseline: float) -> float:
    """(accuracy - baseline) / (1 - baseline): 0 at chance, 1 when perfect (baseline < 1)."""
    return (accuracy - baseline) / (1.0 - baseline)


def rate_interval(total: float, n: int) -> tuple[float, float]:
    """95% Wilson interval of a rate whose successes may be fractional (ties count 1/m)."""
    return wilson_interval(total, n)  # type: ignore[arg-type]  (the formula holds for real k)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a problem with `c` correct out of `n` samples (Chen et al. 2021).

    Raises:
        ConfigError: k < 1, k > n, or c outside [0, n].
    """
    if not 1 <= k <= n:
        raise ConfigError(f"pass@k: k = {k} with n = {n} samples per problem: expected 1 <= k <= n. Lower k, or "
                          f"draw more samples (--samples).")
    if not 0 <= c <= n:
        raise ConfigError(f"pass@k: {c} correct of {n} samples: expected 0 <= c <= n.")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


__all__ = ["TIE_TOLERANCE", "centred", "choice_score", "pass_at_k", "rate_interval"]
