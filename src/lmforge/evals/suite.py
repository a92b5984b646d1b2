"""A set of tasks scored: per task its accuracy, random baseline, centred score and 95% interval,
and the suite's one number, the mean centred score (nanochat's CORE metric does the same over
its tasks). Multiple choice: `accuracy` by the lowest mean per-token loss of the options,
`accuracy_sum` by the highest summed log-probability (`evals.metrics`); continuation tasks: the
share whose every continuation token is the greedy argmax. The results carry no timing and no
path, so one checkpoint gives a byte-identical JSON each time (fp32).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from lmforge.evals.metrics import centred, choice_score, rate_interval
from lmforge.evals.scoring import loglikelihoods
from lmforge.evals.tasks import Task


def score_task(model: torch.nn.Module, tok, task: Task, batch_size: int = 16, device="cpu") -> dict:
    """{"kind", "n", "accuracy", ("accuracy_sum"), "baseline", "centred", "interval" (of the
    accuracy), "centred_interval", "too_long" (items left out), "about"} of one task."""
    items = task.items
    if task.kind == "choice":
        requests = [r for x in items for r in task.requests(x)]
        lls = iter(loglikelihoods(model, tok, requests, batch_size, device))
        acc = acc_sum = 0.0
        for x in items:
            got = [next(lls) for _ in x.choices]
            acc += choice_score([g.mean_loss for g in got], x.gold, higher=False)
            acc_sum += choice_score([g.logprob for g in got], x.gold, higher=True)
        extra = {"accuracy_sum": acc_sum / len(items)}
    else:
        lls = loglikelihoods(model, tok, [(x.context, x.continuation) for x in items], batch_size, device)
        acc = float(sum(g.greedy for g in lls))
        extra = {}
    n, base = len(items), task.baseline
    lo, hi = rate_interval(acc, n)
    return {"kind": task.kind, "n": n, "accuracy": acc / n, **extra, "baseline": base,
            "centred": centred(acc / n, base), "interval": [lo, hi],
            "centred_interval": [centred(lo, base), centred(hi, base)], "too_long": task.too_long,
            "about": task.about}


def run_suite(model: torch.nn.Module, tok, tasks: Sequence[Task], batch_size: int = 16, device="cpu",
              progress=None) -> dict:
    """{"tasks": {name: score_task(...)}, "suite": the mean centred score over the tasks}.
    `progress(name, result)` is called after each task."""
    out = {}
    for task in tasks:
        out[task.name] = score_task(model, tok, task, batch_size, device)
        if progress is not None:
            progress(task.name, out[task.name])
    return {"tasks": out, "suite": statistics.mean(r["centred"] for r in out.values()) if out else float("nan")}


def results_table(results: dict) -> str:
    """A Markdown table of `run_suite`'s results, the suite's line last."""
    rows = ["| task | kind | n | accuracy | 95% interval | baseline | centred |", "|---|---|---|---|---|---|---|"]
    for name, r in results["tasks"].items():
        lo, hi = r["interval"]
        acc = f"{r['accuracy']:.1%}" + (f" (sum: {r['accuracy_sum']:.1%})" if "accuracy_sum" in r else "")
        if r.get("pass@k"):
            acc += " (" + ", ".join(f"pass@{k} {v:.1%}" for k, v in r["pass@k"].items()) + \
                f" of {r['samples']} samples at T {r['temperature']:g})"
        rows.append(f"| {name} | {r['kind']} | {r['n']} | {acc} | [{lo:.1%}, {hi:.1%}] | {r['baseline']:.1%} | "
                    f"{r['centred']:+.3f} |")
    rows.append(f"| **suite** (mean centred) | | | | | | **{results['suite']:+.3f}** |")
    return "\n".join(rows)


__all__ = ["results_table", "run_suite", "score_task"]
