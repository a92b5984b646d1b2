"""The speedrun's step-time levers: `train.time_budget_s` (pretraining planned for seconds of
the whole stage instead of a step count) and `train.compile` without a C++ compiler (trains
eagerly).

The step count comes from what is left of the budget after the start-up and a measurement on a
throw-away copy (steps, one validation, one checkpoint), and is revised once in the run from its
own steps (lmforge.train.budget). Here the budget's clock and the probe's figures are replaced
(the probe still trains a real copy): the arithmetic, not the machine, is tested. The run is then
exactly the run `train.steps = N` gives (the probe moves no data position and no RNG; the
revision changes no step taken), its config.toml says N, and `--resume` keeps N without
measuring again.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace

import pytest

from lmforge.errors import CheckpointError, ConfigError
from lmforge.stages import pretrain_stage
from lmforge.train import budget
from lmforge.train.budget import StepBudget, decay_start, run_step_seconds
from lmforge.train.trainer import Trainer
from test_resume import assert_same_state, read_metrics, with_train


class FakeClock:
    """The budget's clock: `now` seconds, moved by the test (and by `per_step` each step)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fixed_costs(monkeypatch, step_s: float, val_s: float = 0.0, save_s: float = 0.0,
                spent: float = 0.0, per_step=0.0) -> tuple[list[dict], FakeClock]:
    """The probe runs for real (a copy trains, validates and saves) but reports these figures;
    the clock stands still except `spent` seconds for the start-up and the probe, and `per_step`
    seconds (or `per_step(step)`, 1-based) for each step of the run. Returns (the probes made,
    the clock)."""
    real, made, clock = budget.probe_costs, [], FakeClock()

    def probe(*args, **kwargs):
        out = real(*args, **kwargs)
        made.append(out)
        clock.now += spent
        return {**out, "step_s": step_s, "val_s": val_s, "save_s": save_s}

    monkeypatch.setattr(budget, "probe_costs", probe)
    monkeypatch.setattr(budget, "budget_clock", clock)
    if per_step:
        original = Trainer.train_step

        def train_step(self):
            if not self.run_dir.name.startswith("lmforge-budget-"):  # the run's steps, not the probe's
                clock.now += per_step(self.step + 1) if callable(per_step) else per_step
            return original(self)

        monkeypatch.setattr(Trainer, "train_step", train_step)
    return made, clock


def assert_equals_plain_run(c, steps: int, tmp_path) -> None:
    """The budgeted run in tmp_path/budget took the same steps (losses, learning rates, final
    state) as a plain run of `steps` steps of `c` without a budget."""
    pretrain_stage(with_train(c, time_budget_s=0.0, steps=steps), tmp_path / "plain", progress=False)
    a, b = read_metrics(tmp_path / "budget"), read_metrics(tmp_path / "plain")
    for key in ("loss", "lr"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    final = f"step_{steps:06d}"
    assert_same_state(tmp_path / "budget" / final, tmp_path / "plain" / final)


def test_the_budget_sets_the_steps_and_the_run_equals_that_many_steps(tiny_run, tmp_path, monkeypatch, capsys):
    cfg, _ = tiny_run
    made, _ = fixed_costs(monkeypatch, 0.05, spent=0.1)
    budget = with_train(cfg, time_budget_s=0.7, steps=999, checkpoint_every=0, keep_last=0, warmup_steps=2,
                        eval_every=0)
    last = pretrain_stage(budget, tmp_path / "budget", progress=False)
    assert len(made) == 1 and made[0]["measured_steps"] >= 3 and made[0]["save_s"] > 0  # real steps, a real save
    assert last["step"] == 12  # int((0.7 - 0.1 spent) / 0.05)
    err = capsys.readouterr().err
    assert "train.time_budget_s = 0.7 s for the whole stage: 12 steps (0.1 s spent" in err
    saved = (tmp_path / "budget" / "config.toml").read_text()
    assert "steps = 12\n" in saved and "time_budget_s = 0.7\n" in saved
    # the same run with train.steps = 12 and no budget: bit-identical (the probe moved nothing)
    plain = with_train(cfg, steps=12, checkpoint_every=0, keep_last=0, warmup_steps=2, eval_every=0)
    pretrain_stage(plain, tmp_path / "plain", progress=False)
    a, b = read_metrics(tmp_path / "budget"), read_metrics(tmp_path / "plain")
    for key in ("loss", "grad_norm", "lr", "tokens"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert a[-1]["loss"] < a[0]["loss"]  # it trained: the comparison is not vacuous
    assert_same_state(tmp_path / "budget" / "step_000012", tmp_path / "plain" / "step_000012")


def test_a_command_of_its_own_process_counts_the_budget_from_the_process_start(tiny_run, tmp_path, monkeypatch):
    """`lmforge pretrain` as the process's command (cli.main with argv None): the CLI passes the
    process's start down as `started` (the interpreter's start and the imports counted); a call
    from Python (argv given, or the stage called without `started`) counts from its session's start."""
    cfg, _ = tiny_run
    _, clock = fixed_costs(monkeypatch, 0.05, spent=0.1)
    c = with_train(cfg, time_budget_s=1.0, steps=999, checkpoint_every=0, keep_last=0, warmup_steps=2, eval_every=0)
    started = clock.now - 0.3  # the process started 0.3 s before the stage
    aged = pretrain_stage(c, tmp_path / "aged", progress=False, started=started)
    assert aged["step"] == 12  # int((1.0 - 0.3 - 0.1) / 0.05)
    assert pretrain_stage(c, tmp_path / "fresh", progress=False)["step"] == 18  # int((1.0 - 0.1) / 0.05)
    age = budget.process_age_s()
    assert age is None or 0.0 <= age < 24 * 3600
    # the CLI passes the start of the process's own command line only
    from lmforge import cli, stages

    seen = []
    monkeypatch.setattr(budget, "process_age_s", lambda: 4.2)
    monkeypatch.setattr(stages, "pretrain_stage", lambda *a, **k: seen.append(k.get("started")) or {})
    argv = ["pretrain", "--config", str(tmp_path / "aged" / "config.toml"), "--out", str(tmp_path / "x")]
    assert cli.main(argv) == 0
    monkeypatch.setattr("sys.argv", ["lmforge", *argv])
    assert cli.main() == 0
    assert seen == [None, pytest.approx(clock.now - 4.2)]


def test_validations_and_checkpoints_are_paid_from_the_budget(tiny_run, tmp_path, monkeypatch):
    cfg, _ = tiny_run
    fixed_costs(monkeypatch, 0.05, val_s=0.2, save_s=0.1)
    c = with_train(cfg, time_budget_s=1.3, steps=999, checkpoint_every=5, keep_last=1, warmup_steps=2, eval_every=4)
    # per step 0.05 + 0.2 / 4 + 0.1 / 5 = 0.12 s; the final validation and checkpoint 0.3 s: (1.3 - 0.3) / 0.12
    assert pretrain_stage(c, tmp_path / "run", progress=False)["step"] == 8


def test_the_run_revises_the_count_from_its_own_steps(tiny_run, tmp_path, monkeypatch, capsys):
    """The probe said 0.05 s a step; the run's steps take 0.1 s. After step 23 (80% of the way
    to the decay start of the first count, 58) the count is decided again from the run's own
    mean step, kept high enough that no step taken changes its learning rate; the run equals a
    plain run of the revised count, and its config.toml says it."""
    cfg, _ = tiny_run
    _, clock = fixed_costs(monkeypatch, 0.05, per_step=0.1)
    c = with_train(cfg, time_budget_s=2.9, steps=999, checkpoint_every=0, keep_last=0, warmup_steps=2,
                   eval_every=0, schedule="wsd", decay_fraction=0.2)
    last = pretrain_stage(c, tmp_path / "budget", progress=False)
    # first: int(2.9 / 0.05) = 58, decay start 58 - 12 = 46, revision after int(0.8 x 46) = 36;
    # at step 36 the clock says 3.6: over the budget, so N = 37 at least, and the decay must start
    # at or after step 36: 45 - 9 = 36
    assert decay_start(45, 0.2) == 36 and decay_start(44, 0.2) < 36
    assert last["step"] == 45
    err = capsys.readouterr().err
    assert "58 steps (" in err and "revised after step 36" in err
    assert "train.time_budget_s: 45 steps (was 58): 0.100 s a step over the run's steps 2-36" in err
    assert "steps = 45\n" in (tmp_path / "budget" / "config.toml").read_text()
    monkeypatch.undo()
    assert_equals_plain_run(c, 45, tmp_path)


def test_a_wsd_run_revises_again_before_its_decay(tiny_run, tmp_path, monkeypatch, capsys):
    """The steps slow down after the first revision (at the first checkpoint, step 40): 0.05 s
    a step, then 0.06. A second revision at 80% of the decay start (step 80) takes the pace
    since the first and ends the run inside its budget (one revision: 200 steps, 11.6 s of a
    10 s budget); the steps taken keep their learning rates (a plain run of the final count
    gives the same), and the newest config.toml holds the final count."""
    cfg, _ = tiny_run
    _, clock = fixed_costs(monkeypatch, 0.05, per_step=lambda step: 0.05 if step <= 40 else 0.06)
    c = with_train(cfg, time_budget_s=10.0, steps=999, checkpoint_every=40, keep_last=1, warmup_steps=2,
                   eval_every=0, schedule="wsd", decay_fraction=0.5)
    last = pretrain_stage(c, tmp_path / "budget", progress=False)
    # first: 200 steps (decay from step 100); at step 40 the pace is 0.05 s: still 200; at step 80
    # the clock says 4.4 s and the pace is 0.06 s: 80 + int(5.6 / 0.06) = 173 (decay from 87)
    assert last["step"] == 173
    assert clock.now == pytest.approx(4.4 + 93 * 0.06) and clock.now <= 10.0
    err = capsys.readouterr().err
    assert "200 steps (" in err and "revised after step 40" in err
    assert "train.time_budget_s: 200 steps (was 200): 0.050 s a step over the run's steps 2-40" in err
    assert "train.time_budget_s: 173 steps (was 200): 0.060 s a step over the run's steps 41-80" in err
    assert "steps = 173\n" in (tmp_path / "budget" / "config.toml").read_text()
    monkeypatch.undo()
    assert_equals_plain_run(c, 173, tmp_path)


def test_the_budget_arithmetic():
    from lmforge.config import TrainConfig

    t = TrainConfig(eval_every=100, checkpoint_every=200, warmup_steps=50, schedule="wsd", decay_fraction=0.5)
    b = StepBudget(deadline=420.0, step_s=0.4, val_s=1.0, save_s=2.0)
    # per step 0.4 + 0.01 + 0.01 = 0.42; 60 s spent, 3 s for the final validation and checkpoint
    assert b.per_step(t) == pytest.approx(0.42)
    assert b.steps_for(t, now=60.0) == 850  # 357 / 0.42
    assert b.steps_for(t, now=419.0, done=5) == 6  # over the budget: one more step, never fewer than taken
    b.plan_revision(t, 850)  # decay starts at 425: 80% of it is 340, the first checkpoint comes at 200
    assert b.revise_at == 200
    b.plan_revision(replace(t, checkpoint_every=0), 850)
    assert b.revise_at == 340
    b.plan_revision(replace(t, schedule="cosine"), 850)
    assert b.revise_at == 50  # cosine: within the warm-up only
    b.plan_revision(replace(t, schedule="cosine", warmup_steps=10), 850)
    assert b.revise_at == 0  # too few steps to average
    n = b.revised_steps(t, now=400.0, done=200, step_s=0.45)
    assert decay_start(n, 0.5) >= 200 and n == 400
    # wsd revises once more, at 80% of the revised decay start, and no more; cosine does not
    b = StepBudget(deadline=420.0, step_s=0.4, val_s=1.0, save_s=2.0)
    b.plan_revision(t, 850)
    assert b.next_revision(t, 850, 200) == 340 and b.next_revision(t, 850, 340) == 0
    assert StepBudget(420.0, 0.4, 1.0, 2.0).next_revision(t, 250, 100) == 0  # 80% of 125 is 100: too close
    assert StepBudget(420.0, 0.4, 1.0, 2.0).next_revision(replace(t, schedule="cosine"), 850, 50) == 0
    # the run's pace: the mean of its steps, a one-time compile (over 5x the median) left out
    assert run_step_seconds([0.4] * 19 + [0.6]) == pytest.approx(0.41)
    assert run_step_seconds([0.4] * 19 + [0.6, 15.0]) == pytest.approx(0.41)


@pytest.mark.slow
def test_resume_keeps_the_step_count_without_measuring_again(tiny_run, tmp_path, monkeypatch, capsys):
    cfg, _ = tiny_run
    c = with_train(cfg, time_budget_s=1.0, checkpoint_every=0, keep_last=0, warmup_steps=2, eval_every=0)
    with monkeypatch.context() as m:
        fixed_costs(m, 0.05)
        pretrain_stage(c, tmp_path / "straight", progress=False)
    with monkeypatch.context() as m:
        fixed_costs(m, 0.05)
        original = Trainer.train_step

        def train_step(self):  # SIGTERM after step 8 of the real run (not of the probe)
            out = original(self)
            if self.run_dir.name == "split" and self.step == 8:
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        m.setattr(Trainer, "train_step", train_step)
        assert pretrain_stage(c, tmp_path / "split", progress=False)["step"] == 8
    capsys.readouterr()
    made, _ = fixed_costs(monkeypatch, 0.5)  # this machine is now 10x slower: a new measurement would say 2 steps
    last = pretrain_stage(c, tmp_path / "split", resume=True, progress=False)
    assert made == [] and last["step"] == 20
    assert "20 steps (as in " in capsys.readouterr().err
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 20
    assert_same_state(tmp_path / "straight" / "step_000020", tmp_path / "split" / "step_000020")
    # another budget is another schedule: refused, naming the field
    with pytest.raises(CheckpointError, match=r"train.time_budget_s = 2\.0 \(the run has 1\.0\)"):
        pretrain_stage(with_train(c, time_budget_s=2.0, steps=30), tmp_path / "split", resume=True, progress=False)


def test_a_budget_spent_before_the_first_step_is_refused_and_nothing_is_written(tiny_run, tmp_path, monkeypatch):
    cfg, _ = tiny_run
    fixed_costs(monkeypatch, 0.05, spent=5.0)
    with pytest.raises(ConfigError, match=r"train.time_budget_s = 3: the start-up and the measurement took 5\.0 s"):
        pretrain_stage(with_train(cfg, time_budget_s=3.0), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


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
