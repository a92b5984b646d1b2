"""The speedrun's step-time levers: `train.time_budget_s` (pretraining planned for seconds of
steps instead of a step count) and `train.compile` without a C++ compiler (trains eagerly).

The step count comes from steps timed on a throw-away copy before the run (the measurement is
wrapped here so that it reports a fixed step time: the arithmetic, not the machine, is tested);
the run is then exactly the run `train.steps = N` gives (the probe moves no data position and
no RNG), its config.toml says N, and `--resume` keeps N without measuring again.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace

import pytest

from lmforge.errors import CheckpointError, ConfigError
from lmforge.stages import common, pretrain_stage
from lmforge.train.trainer import Trainer
from test_resume import assert_same_state, read_metrics, with_train


def fixed_step_time(monkeypatch, seconds: float) -> list[dict]:
    """Every measurement runs its real steps (so the probe really trains a copy) but reports
    `seconds` per step; returns the list of measurements made."""
    real, made = common.measure_steps, []

    def measure(trainer, steps, tokens_per_step):
        out = real(trainer, steps, tokens_per_step)
        made.append(out)
        return {**out, "step_seconds": seconds}

    monkeypatch.setattr(common, "measure_steps", measure)
    return made


def test_the_budget_sets_the_steps_and_the_run_equals_that_many_steps(tiny_run, tmp_path, monkeypatch, capsys):
    cfg, _ = tiny_run
    made = fixed_step_time(monkeypatch, 0.05)
    budget = with_train(cfg, time_budget_s=0.6, steps=999, checkpoint_every=0, keep_last=0, warmup_steps=2)
    last = pretrain_stage(budget, tmp_path / "budget", progress=False)
    assert len(made) == 1 and made[0]["measured_steps"] >= 3  # the probe trained real steps
    assert last["step"] == 12  # int(0.6 / 0.05)
    err = capsys.readouterr().err
    assert "train.time_budget_s = 0.6: 12 steps (0.050 s per step" in err
    saved = (tmp_path / "budget" / "config.toml").read_text()
    assert "steps = 12\n" in saved and "time_budget_s = 0.6\n" in saved
    # the same run with train.steps = 12 and no budget: bit-identical (the probe moved nothing)
    plain = with_train(cfg, steps=12, checkpoint_every=0, keep_last=0, warmup_steps=2)
    pretrain_stage(plain, tmp_path / "plain", progress=False)
    a, b = read_metrics(tmp_path / "budget"), read_metrics(tmp_path / "plain")
    for key in ("loss", "grad_norm", "lr", "tokens"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert a[-1]["loss"] < a[0]["loss"]  # it trained: the comparison is not vacuous
    assert_same_state(tmp_path / "budget" / "step_000012", tmp_path / "plain" / "step_000012")


@pytest.mark.slow
def test_resume_keeps_the_step_count_without_measuring_again(tiny_run, tmp_path, monkeypatch, capsys):
    cfg, _ = tiny_run
    c = with_train(cfg, time_budget_s=1.0, checkpoint_every=0, keep_last=0, warmup_steps=2)
    with monkeypatch.context() as m:
        fixed_step_time(m, 0.05)
        pretrain_stage(c, tmp_path / "straight", progress=False)
    with monkeypatch.context() as m:
        fixed_step_time(m, 0.05)
        original = Trainer.train_step

        def train_step(self):  # SIGTERM after step 8 of the real run (not of the probe)
            out = original(self)
            if self.run_dir.name == "split" and self.step == 8:
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        m.setattr(Trainer, "train_step", train_step)
        assert pretrain_stage(c, tmp_path / "split", progress=False)["step"] == 8
    capsys.readouterr()
    made = fixed_step_time(monkeypatch, 0.5)  # this machine is now 10x slower: a new measurement would say 2 steps
    last = pretrain_stage(c, tmp_path / "split", resume=True, progress=False)
    assert made == [] and last["step"] == 20
    assert "20 steps (as in " in capsys.readouterr().err
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 20
    assert_same_state(tmp_path / "straight" / "step_000020", tmp_path / "split" / "step_000020")
    # another budget is another schedule: refused, naming the field
    with pytest.raises(CheckpointError, match=r"train.time_budget_s = 2\.0 \(the run has 1\.0\)"):
        pretrain_stage(with_train(c, time_budget_s=2.0, steps=30), tmp_path / "split", resume=True, progress=False)


def test_sft_and_dpo_do_not_take_the_pretraining_budget(tiny_run):
    from lmforge.stages.dpo import dpo_config
    from lmforge.stages.sft import sft_config

    cfg, _ = tiny_run
    c = with_train(cfg, time_budget_s=300.0)
    assert sft_config(c, c).train.time_budget_s == 0 and sft_config(c, c).train.steps == c.sft.steps
    assert dpo_config(c, c).train.time_budget_s == 0 and dpo_config(c, c).train.steps == c.dpo.steps


def test_a_negative_budget_is_refused():
    from lmforge.config import load_config

    with pytest.raises(ConfigError, match="train.time_budget_s"):
        load_config(None, ["train.time_budget_s=-1"])
    assert replace(load_config(None, ["train.time_budget_s=60"]).train).time_budget_s == 60.0


def test_compile_without_a_cxx_compiler_trains_eagerly_and_says_so(monkeypatch):
    import shutil

    import torch

    from lmforge.train.trainer import compiler_available

    lines: list[str] = []
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert not compiler_available(torch.device("cpu"), lines.append)
    assert len(lines) == 1 and "no C++ compiler on PATH" in lines[0] and "train.compile = false" in lines[0]
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/g++" if name == "g++" else None)
    assert compiler_available(torch.device("cpu"), lines.append) and len(lines) == 1


def test_validation_never_runs_the_compiled_graph(tiny_run, tmp_path, monkeypatch):
    """With train.compile, the steps run the compiled model and validation the plain one: under
    no_grad torch.compile would build a second graph (20 s of the speedrun's pretraining for 4
    validation batches). A stand-in for torch.compile records every call of the compiled module."""
    import torch

    from lmforge.train import trainer as trainer_mod

    calls: list[bool] = []  # torch.is_grad_enabled() at each call of the "compiled" module

    class Compiled(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            calls.append(torch.is_grad_enabled())
            return self.module(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "compiler_available", lambda *a, **k: True)
    monkeypatch.setattr(torch, "compile", Compiled)
    cfg, _ = tiny_run
    run = with_train(cfg, steps=4, eval_every=2, checkpoint_every=0, keep_last=0, warmup_steps=1)
    pretrain_stage(with_train(run, compile=True), tmp_path / "compiled", progress=False)
    assert calls and all(calls)  # the steps went through it, validation never did
    pretrain_stage(run, tmp_path / "eager", progress=False)
    a, b = read_metrics(tmp_path / "compiled"), read_metrics(tmp_path / "eager")
    assert [m.get("val_loss") for m in a] == [m.get("val_loss") for m in b]
    assert sum(m.get("val_loss") is not None for m in a) == 2
