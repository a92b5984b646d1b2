"""The preflight plan (lmforge.train.plan): printed and measured by `--dry-run` (which writes
nothing), written as plan.json by a real run, and close to what the run then shows."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import pytest
import torch

from lmforge.train.plan import PLAN_FILE


def plan_cfg(cfg, **train):
    # a model big enough that a step takes tens of milliseconds (timing noise stays small)
    return replace(cfg, model=replace(cfg.model, dim=64), data=replace(cfg.data, seq_len=64),
                   train=replace(cfg.train, **{"steps": 40, "micro_batch_size": 8, "eval_every": 0,
                                               "checkpoint_every": 0, **train}))


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_run, tmp_path, capsys):
    from lmforge.stages import pretrain_stage

    cfg, _ = tiny_run
    res = pretrain_stage(plan_cfg(cfg), tmp_path / "run", dry_run=True, progress=False)
    assert not (tmp_path / "run").exists()
    plan = res["plan"]
    err = capsys.readouterr().err
    assert "plan: memory per rank (estimate)" in err and "plan: measured over 3 steps" in err
    m = plan["memory_estimate_per_rank"]
    assert m["total_mib"] == pytest.approx(sum(v for k, v in m.items() if k != "total_mib"), abs=0.2)
    params = plan["parameters"]
    assert m["weights_mib"] == pytest.approx(params * 4 / 2**20, abs=0.1)  # float32 weights
    assert plan["tokens_per_step"] == 8 * 64 and plan["time_to_finish_seconds"] == pytest.approx(
        plan["first_step_seconds"] + plan["step_seconds"] * 39, abs=0.1)
    assert plan["measured_peak_mib"] > 0 and plan["memory_measured_as"]


def test_a_real_run_writes_plan_json_with_the_estimates(tiny_run, tmp_path):
    from lmforge.stages import pretrain_stage

    cfg, _ = tiny_run
    pretrain_stage(plan_cfg(cfg, steps=2), tmp_path / "run", progress=False)
    plan = json.loads((tmp_path / "run" / PLAN_FILE).read_text())
    assert plan["steps"] == 2 and "memory_estimate_per_rank" in plan and "tokens_per_second" not in plan


@pytest.mark.slow
def test_the_dry_runs_tokens_per_second_and_eta_are_within_15_percent_of_the_run(tiny_run, tmp_path):
    """On a quiet CPU: the dry run's median over its timed steps against the real run's median
    step (after its first 5), in one thread, as the tests run."""
    from lmforge.stages import pretrain_stage

    cfg, _ = tiny_run
    c = plan_cfg(cfg, steps=60)
    dry = pretrain_stage(c, tmp_path / "run", dry_run=True, progress=False)["plan"]
    pretrain_stage(c, tmp_path / "run", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    real = statistics.median(r["tokens_per_s"] for r in rows[5:])
    real_eta = rows[-1]["elapsed_s"]
    assert dry["tokens_per_second"] == pytest.approx(real, rel=0.15), (dry["tokens_per_second"], real)
    assert dry["time_to_finish_seconds"] == pytest.approx(real_eta, rel=0.15), (dry["time_to_finish_seconds"], real_eta)
