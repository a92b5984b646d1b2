"""Training health (lmforge.train.health): each detector fires where it should, at the step
it should, and stays silent on a real speedrun.

tests/data/speedrun_{pretrain,sft}_metrics.jsonl are the loss, gradient norm and learning
rate of every step of a real `make speedrun` (commit 12f7b90, 2026-11-23, 2-core AMD EPYC);
its tokens/s are left out: that run shared the cores with other jobs, and the slow-step
detector rightly fired on it.
"""

from __future__ import annotations

import re

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from lmforge.train.health import COOLDOWN, WINDOW, HealthMonitor

DATA = Path(__file__).parent / "data"


def rows(n, loss=lambda s: 4.0 - 0.002 * s + 0.05 * math.sin(s), grad=lambda s: 1.0 + 0.1 * math.cos(3 * s),
         lr=lambda s: 1e-3, speed=lambda s: 1000.0 + 10 * math.sin(s)):
    return [{"step": s, "loss": loss(s), "grad_norm": grad(s), "lr": lr(s), "tokens_per_s": speed(s)}
            for s in range(1, n + 1)]


def fired(sequence, warmup=0) -> list[tuple[str, int]]:
    m = HealthMonitor(len(sequence), warmup)
    return [(w.kind, w.step) for r in sequence for w in m.update(r)]


def test_a_steady_run_is_healthy():
    m = HealthMonitor(400, 10)
    for r in rows(400):
        assert m.update(r) == []
    assert m.verdict() == {"verdict": "healthy", "warnings": {}}


def test_loss_spike_fires_at_its_step_then_cools_down():
    spikes = {100, 110, 100 + COOLDOWN + 5}
    seq = rows(300, loss=lambda s: 9.0 if s in spikes else 4.0 - 0.002 * s + 0.05 * math.sin(s))
    assert fired(seq) == [("loss_spike", 100), ("loss_spike", 100 + COOLDOWN + 5)]


def test_grad_norm_spike():
    seq = rows(200, grad=lambda s: 40.0 if s == 120 else 1.0 + 0.1 * math.cos(3 * s))
    assert fired(seq) == [("grad_norm_spike", 120)]


def test_loss_rising_and_loss_stalled():
    # falls for 200 steps, then rises 0.5% a step. At step 249 the window is steps 100..249: its
    # first third averages 5 - 0.005 x 124.5 = 4.3775, its last (4 + 4 x sum of 1.005^k, k=1..49) / 50
    # = 4.531, 3.5% above (at 248: 2.9%); then once per COOLDOWN
    seq = rows(400, loss=lambda s: 5.0 - 0.005 * s if s <= 200 else 4.0 * (1.005 ** (s - 200)))
    assert fired(seq) == [("loss_rising", 249), ("loss_rising", 249 + COOLDOWN), ("loss_rising", 249 + 2 * COOLDOWN),
                          ("loss_rising", 249 + 3 * COOLDOWN)]
    flat = rows(400, loss=lambda s: 3.0)  # no learning at all, at full learning rate: as soon as the window is full
    assert fired(flat)[0] == ("loss_stalled", 3 * WINDOW)


def test_a_plateau_is_a_stall_only_while_the_learning_rate_is_up():
    wsd = lambda s: 1e-3 if s <= 300 else 1e-3 * (600 - s) / 300  # noqa: E731  (peak, then linear to 0)
    # flat from step 300 (3.4): the first third's excess over the plateau, 0.002 x k(k+1)/2 / 50 for
    # its last k falling steps, is under 0.1% of 3.4 from k = 12, i.e. at step 300 - 12 + 149 = 437;
    # again at 487 and 537; at 587 the learning rate is 13/300 of its peak, under a tenth: silent
    early = rows(600, loss=lambda s: 4.0 - 0.002 * min(s, 300), lr=wsd)
    assert fired(early) == [("loss_stalled", 437), ("loss_stalled", 487), ("loss_stalled", 537)]
    late = rows(600, loss=lambda s: 4.0 - 0.002 * min(s, 440), lr=wsd)  # a plateau in the decay's tail: fine
    assert fired(late) == []


def test_lr_band_is_checked_once_at_the_end_of_warmup():
    assert fired(rows(100, lr=lambda s: 0.5), warmup=20) == [("lr_band", 20)]
    assert fired(rows(100, lr=lambda s: 1e-8), warmup=0) == [("lr_band", 1)]
    assert fired(rows(100, lr=lambda s: 3e-3), warmup=20) == []


def test_update_ratio_and_slow_steps():
    seq = rows(200)
    seq[74]["update_ratio"] = 1e-3  # in band
    seq[99]["update_ratio"] = 0.2  # step 100: far too large
    seq[120]["tokens_per_s"] = 100.0  # one slow step: not a slowdown
    for s in range(149, 200):  # from step 150 on: a third of the usual speed
        seq[s]["tokens_per_s"] = 300.0
    assert fired(seq) == [("update_ratio", 100), ("slow_steps", 152)]


def test_a_decay_ending_at_zero_is_not_an_update_ratio_warning():
    """Regression (the speedrun of 2026-11-24): the last step of a decay to lr 0 updates nothing;
    a ratio of 0 there is expected, while the same 0 at full learning rate is flagged."""
    seq = rows(300, lr=lambda s: 1e-3 * min(1.0, (300 - s) / 150))
    for s in (99, 199, 299):
        seq[s]["update_ratio"] = 1e-3
    seq[299]["update_ratio"] = 0.0  # step 300: lr 0
    assert fired(seq) == []
    seq[99]["update_ratio"] = 0.0  # step 100: lr at its peak
    assert fired(seq) == [("update_ratio", 100)]


def test_non_finite_rows_are_not_warnings():
    seq = rows(60)
    seq[40]["loss"] = float("nan")
    assert fired(seq) == []


@pytest.mark.parametrize("stage, warmup", [("pretrain", 50), ("sft", 10)])
def test_a_real_speedrun_is_healthy(stage, warmup):
    seq = [json.loads(line) for line in (DATA / f"speedrun_{stage}_metrics.jsonl").read_text().splitlines()]
    assert fired(seq, warmup) == []


# -- real runs made to misbehave ------------------------------------------------------------------
def run(tiny_run, tmp_path, name, **train):
    from lmforge.stages import pretrain_stage

    cfg, _ = tiny_run
    cfg = replace(cfg, train=replace(cfg.train, **{"steps": 120, "warmup_steps": 5, "eval_every": 0, **train}))
    last = pretrain_stage(cfg, tmp_path / name, progress=False)
    metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return last, metrics


def test_a_tiny_run_is_healthy_and_says_so(tiny_run, tmp_path, capsys):
    last, metrics = run(tiny_run, tmp_path, "ok")  # the tiny recipe: Muon, lr 1e-2, clipping at 1
    # every detector but slow_steps reads numbers, not the clock (this machine may be shared)
    assert set(last["health"]["warnings"]) <= {"slow_steps"}, last["health"]
    if not last["health"]["warnings"]:
        assert "health: healthy" in capsys.readouterr().err
    ratios = [m["update_ratio"] for m in metrics if "update_ratio" in m]
    assert len(ratios) == 120 // 25 and all(1e-5 < r < 3e-2 for r in ratios), ratios


def test_a_learning_rate_far_too_high_is_flagged(tiny_run, tmp_path, capsys):
    last, metrics = run(tiny_run, tmp_path, "hot", optimizer="adamw", lr=0.5)  # clipping on (1.0)
    # a rate this hot may also set off a gradient-norm spike (which step depends on the schedule's decay)
    assert {"lr_band", "update_ratio"} <= set(last["health"]["warnings"]) <= {"lr_band", "update_ratio", "slow_steps",
                                                                           "grad_norm_spike"}, last["health"]
    flagged = {w["kind"]: w for m in metrics for w in m.get("health", ())}
    assert flagged["lr_band"]["step"] == 5 and flagged["lr_band"]["figure"] == 0.5  # the end of warm-up
    assert flagged["update_ratio"]["figure"] > 3e-2 and flagged["update_ratio"]["step"] % 25 == 0
    assert all(w["message"] for m in metrics for w in m.get("health", ()))
    err = capsys.readouterr().err
    assert "health: step 5: the peak learning rate 0.5 is outside [1e-06, 0.03] (the usual peak" in err
    assert re.search(r"health: [23] warning\(s\)", err) or "slow_steps" in err


def test_gradient_clipping_off_is_flagged(tiny_run, tmp_path):
    # AdamW at lr 1e-2: with train.grad_clip = 1 the run is healthy; without clipping one large
    # update sets off gradient norms several times the running median
    clipped, _ = run(tiny_run, tmp_path, "clip", optimizer="adamw", lr=1e-2)
    unclipped, metrics = run(tiny_run, tmp_path, "noclip", optimizer="adamw", lr=1e-2, grad_clip=0.0)
    assert set(clipped["health"]["warnings"]) <= {"slow_steps"}, clipped["health"]
    assert "grad_norm_spike" in unclipped["health"]["warnings"], unclipped["health"]
    spike = next(w for m in metrics for w in m.get("health", ()) if w["kind"] == "grad_norm_spike")
    row = metrics[spike["step"] - 1]
    norms = sorted(m["grad_norm"] for m in metrics[max(0, spike["step"] - 51):spike["step"] - 1])
    assert row["grad_norm"] == spike["figure"] > 3 * norms[len(norms) // 2]  # the figure is that step's


def test_a_long_repeated_stretch_in_the_data_is_flagged(tiny_run, tiny_corpus, tmp_path):
    """One file that repeats one line, 4x the rest of the corpus in tokens: the model learns to
    copy it, the running median loss collapses towards 0, and every batch of real text then
    stands out as a loss spike."""
    from lmforge.stages import prepare_stage

    cfg, _ = tiny_run
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = {p.name: p.read_text() for p in sorted(tiny_corpus.glob("*.py"))}
    texts["zz_repeated.py"] = "tokens = items\n" * (4 * sum(map(len, texts.values())) // len("tokens = items\n"))
    for name, text in texts.items():
        (corpus / name).write_text(text)
    cfg = replace(cfg, data=replace(cfg.data, source=str(corpus), dir=str(tmp_path / "data")))
    prepare_stage(cfg, progress=False)
    last, metrics = run((cfg, None), tmp_path, "repeated")
    assert "loss_spike" in last["health"]["warnings"], last["health"]
    spike = next(w for m in metrics for w in m.get("health", ()) if w["kind"] == "loss_spike")
    before = sorted(m["loss"] for m in metrics[spike["step"] - 51:spike["step"] - 1])
    assert before[len(before) // 2] < 0.05 < 1.0 < spike["figure"]  # a median near 0, a real-text batch
    assert metrics[spike["step"] - 1]["loss"] == spike["figure"]
    assert spike["message"].endswith("a median under 0.1 nats means most batches are text the model now copies "
                                     "(repeated or duplicated data)")


def test_a_learning_rate_far_too_low_stalls(tiny_run, tmp_path):
    # AdamW at lr 1e-6 (inside the lr band): the loss does not move; the window of 3 x WINDOW steps is
    # full at step 150, while the learning rate (WSD, decaying over the second half) is still at 3/4 of its peak
    last, metrics = run(tiny_run, tmp_path, "cold", steps=200, optimizer="adamw", lr=1e-6)
    kinds = [(w["kind"], w["step"]) for m in metrics for w in m.get("health", ()) if w["kind"] != "slow_steps"]
    assert ("loss_stalled", 3 * WINDOW) in kinds and "lr_band" not in dict(kinds), kinds
    assert {k for k, _ in kinds} == {"loss_stalled", "update_ratio"}  # |update| / |weights| ~ 1e-5 and below


def test_steps_that_slow_down_are_flagged(tiny_run, tmp_path, monkeypatch):
    """A fake clock for the trainer: each step takes 10 ms, from step 81 on 100 ms. The median
    of the last 5 steps' tokens/s falls below half the running median once 3 of them are slow."""
    from types import SimpleNamespace

    from lmforge.train import trainer as trainer_module

    clock = {"t": 0.0}
    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(perf_counter=lambda: clock["t"]))
    real = trainer_module.Trainer.train_step

    def train_step(self):
        m = real(self)
        clock["t"] += 0.1 if self.step > 80 else 0.01
        return m

    monkeypatch.setattr(trainer_module.Trainer, "train_step", train_step)
    last, metrics = run(tiny_run, tmp_path, "slow")
    assert last["health"] == {"verdict": "1 warning(s): slow_steps x1", "warnings": {"slow_steps": 1},
                              "first": [{"kind": "slow_steps", "step": 83, "figure": pytest.approx(2560.0),
                                         "message": "2,560 tokens/s over the last 5 steps against a running "
                                                    "median of 25,600"}]}
    assert metrics[82]["health"][0]["kind"] == "slow_steps"
    assert metrics[79]["tokens_per_s"] == pytest.approx(10 * metrics[82]["tokens_per_s"])


def test_update_ratio_is_the_relative_change_of_the_weights(tiny_run, tmp_path):
    """metrics.jsonl's update_ratio at step 25 = |W25 - W24| / |W25| recomputed from the
    checkpoints of steps 24 and 25."""
    from safetensors.torch import load_file

    cfg, _ = tiny_run
    _, metrics = run(tiny_run, tmp_path, "ratio", steps=25, checkpoint_every=1, keep_last=2)
    w24, w25 = (load_file(tmp_path / "ratio" / f"step_0000{s}" / "model.safetensors") for s in (24, 25))
    delta = sum(float((w25[k].double() - w24[k].double()).pow(2).sum()) for k in w25)
    norm = sum(float(w25[k].double().pow(2).sum()) for k in w25)
    assert [m["step"] for m in metrics if "update_ratio" in m] == [25]
    assert metrics[24]["update_ratio"] == pytest.approx(math.sqrt(delta / norm), rel=1e-5)


def test_resume_rebuilds_the_monitor_from_metrics(tiny_run, tmp_path, monkeypatch):
    from test_resume import sigterm_at

    from lmforge.stages import pretrain_stage

    cfg, _ = tiny_run
    cfg = replace(cfg, train=replace(cfg.train, steps=60, warmup_steps=5, optimizer="adamw", lr=0.5, grad_clip=0.0))
    straight = pretrain_stage(cfg, tmp_path / "straight", progress=False)
    with monkeypatch.context() as m:
        sigterm_at(m, 30)
        pretrain_stage(cfg, tmp_path / "resumed", progress=False)
    resumed = pretrain_stage(cfg, tmp_path / "resumed", resume=True, progress=False)
    def steady(verdict):  # slow_steps depends on the clock; every other detector on the numbers
        return {k: n for k, n in verdict["warnings"].items() if k != "slow_steps"}

    assert steady(resumed["health"]) == steady(straight["health"]) != {}  # none lost or repeated


def test_the_speedrun_summary_shows_the_verdicts():
    from lmforge.stages.speedrun import format_summary

    summary = {"parameters": 10, "non_embedding_parameters": 5, "tokens_trained": 100, "tokens_per_s": 50.0,
               "stage_seconds": {"pretrain": 2.0}, "val_loss": 3.0, "val_perplexity": 20.1, "val_bits_per_byte": 1.5,
               "xz_bits_per_byte": 1.9, "loss_plot": None, "checkpoint": "runs/x/step_000002", "samples": [],
               "pretrain_health": "healthy", "sft_health": "1 warning(s): loss_spike x1"}
    row = [line for line in format_summary(summary).splitlines() if "training health" in line]
    assert len(row) == 1 and row[0].rstrip(" |").endswith("pretrain: healthy; sft: 1 warning(s): loss_spike x1"), row
