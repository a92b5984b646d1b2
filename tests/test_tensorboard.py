"""`train.tensorboard = true`: the metrics, as TensorBoard's own reader sees them, equal
metrics.jsonl's; the health warnings, the config and plan.json are there as text; a resumed run has each
step once; without the package the run is refused before any work."""

from __future__ import annotations

import builtins
import json
from dataclasses import replace

import pytest

from lmforge.errors import ConfigError

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402


def read_board(folder):
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_the_events_hold_what_metrics_jsonl_holds(tiny_run, tmp_path, monkeypatch):
    from test_resume import sigterm_at

    from lmforge.stages import pretrain_stage

    cfg, _ = tiny_run
    cfg = replace(cfg, train=replace(cfg.train, steps=40, warmup_steps=5, optimizer="adamw", lr=0.5, grad_clip=0.0,
                                     tensorboard=True, eval_every=10))
    with monkeypatch.context() as m:
        sigterm_at(m, 20)
        pretrain_stage(cfg, tmp_path / "run", progress=False)
    pretrain_stage(cfg, tmp_path / "run", resume=True, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    acc = read_board(tmp_path / "run" / "tensorboard")
    tags = acc.Tags()
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "val_loss", "update_ratio"):
        events = acc.Scalars(key)
        want = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        assert [e.step for e in events] == [s for s, _ in want], key  # each step once, the resumed run too
        for e, (_, v) in zip(events, want):
            assert e.value == pytest.approx(v, rel=1e-6), key
    def texts(tag):
        return [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in acc.Tensors(tag)]

    warnings = [(w["step"], f"step {w['step']}: {w['kind']}: {w['message']}")
                for r in rows for w in r.get("health", ())]
    assert warnings and texts("health/text_summary") == warnings  # each once, across the resume too
    plan = (tmp_path / "run" / "plan.json").read_text()
    assert [t for _, t in texts("plan/text_summary")][-1] == "```\n" + plan + "\n```"  # the resumed run's plan
    assert "steps = 40" in texts("config/text_summary")[0][1]


def test_without_the_package_the_run_is_refused_before_any_work(tiny_run, tmp_path, monkeypatch):
    from lmforge.stages import pretrain_stage

    cfg, _ = tiny_run
    real = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    monkeypatch.delitem(__import__("sys").modules, "tensorboard", raising=False)
    with pytest.raises(ConfigError, match=r"train.tensorboard = true needs the tensorboard package.*lmforge\[tensorboard\]"):
        pretrain_stage(replace(cfg, train=replace(cfg.train, tensorboard=True)), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
