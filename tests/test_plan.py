"""The preflight plan (lmforge.train.plan): printed and measured by `--dry-run` (which writes
nothing), written as plan.json by a real run. How close its tokens/s and time to finish come to the run
that follows is timing, measured in bench/bench_plan.py, not here."""

from __future__ import annotations

import json
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
    assert "plan: memory per rank (estimate)" in err and f"plan: measured over {plan['measured_steps']} steps" in err
    assert plan["measured_steps"] >= 3
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


# -- train.micro_batch_size = "auto" ---------------------------------------------------------------
def auto_cfg(cfg, global_batch=8, steps=4):
    from lmforge.config import apply_overrides

    c = apply_overrides(cfg, ["train.micro_batch_size=auto", f"train.global_batch_size={global_batch}",
                              f"train.steps={steps}", "train.grad_accum_steps=1"])
    return c.validate()


def available_for(cfg, tok, rows):
    """The available memory at which exactly `rows` rows fit (by the estimate auto uses)."""
    from lmforge.model.memory import memory_need
    from lmforge.train.plan import AUTO_MEMORY_SHARE

    model_cfg = replace(cfg.model, vocab_size=tok.contract.vocab_size)
    fixed, per_token = memory_need(model_cfg, training=True)
    return int((fixed + (rows + 0.5) * per_token * cfg.data.seq_len) / AUTO_MEMORY_SHARE)


def test_auto_micro_batch_keeps_the_global_batch_and_records_it(tiny_run, tmp_path, monkeypatch, capsys):
    from lmforge.config import load_config
    from lmforge.errors import ConfigError
    from lmforge.stages import common, pretrain_stage
    from test_resume import sigterm_at

    cfg, tok = tiny_run
    c = auto_cfg(cfg)
    assert c.train.micro_batch_size == 0  # "auto", as stored
    with pytest.raises(ConfigError, match=r'"auto" \(or 0\) needs train.global_batch_size'):
        load_config(None, ["train.micro_batch_size=auto"])
    pretrain_stage(c, tmp_path / "ample", progress=False)  # memory to spare: the whole batch in one micro-batch
    saved = (tmp_path / "ample" / "config.toml").read_text()
    assert "micro_batch_size = 8" in saved and "grad_accum_steps = 1" in saved
    assert 'train.micro_batch_size = "auto": 8 rows per micro-batch' in capsys.readouterr().err
    monkeypatch.setattr(common, "available_memory", lambda device: available_for(cfg, tok, 2))
    with monkeypatch.context() as m:
        sigterm_at(m, 2)
        pretrain_stage(c, tmp_path / "tight", progress=False)
    saved = (tmp_path / "tight" / "config.toml").read_text()
    assert "micro_batch_size = 2" in saved and "grad_accum_steps = 4" in saved  # 2 x 4 = the global 8
    # more memory now, but --resume continues with the run's own numbers
    monkeypatch.setattr(common, "available_memory", lambda device: available_for(cfg, tok, 8))
    last = pretrain_stage(c, tmp_path / "tight", resume=True, progress=False)
    assert last["step"] == 4 and "as in" in capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "tight" / "metrics.jsonl").read_text().splitlines()]
    ample = [json.loads(line) for line in (tmp_path / "ample" / "metrics.jsonl").read_text().splitlines()]
    # the same rows per step: the losses agree up to the float order of the accumulated sums
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in ample]
    for a, b in zip(rows, ample):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_plan_on_cuda_measures_allocated_memory(tiny_run, tmp_path, monkeypatch):
    from lmforge.stages import pretrain_stage

    cfg, _ = tiny_run
    plan = pretrain_stage(plan_cfg(cfg, precision="auto"), tmp_path / "run", dry_run=True, progress=False)["plan"]
    assert plan["memory_measured_as"].startswith("torch.cuda.max_memory_allocated")
    est = plan["estimated_growth_mib"]
    assert 0 < plan["measured_growth_mib"] and plan["device"].startswith("cuda")
    assert est > 0
