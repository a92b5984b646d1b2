"""The non-finite guard: a step whose loss or gradient norm is not finite is never taken,
no checkpoint with a non-finite weight is ever written, and the run stops with exit 2 and a
message naming the last finite checkpoint."""

from __future__ import annotations

import math
import shutil

import pytest
from safetensors.torch import load_file

from lmforge.cli import main
from lmforge.model import io as mio


def test_divergence_stops_before_the_step_and_keeps_only_finite_checkpoints(tiny_run, tmp_path, capsys,
                                                                            monkeypatch):
    import torch

    from lmforge.train.trainer import Trainer

    cfg, _ = tiny_run
    cfg.save(tmp_path / "cfg.toml")
    run = tmp_path / "run"
    original = Trainer.train_step

    def train_step(self):  # the output head blows up after step 3 (train.lr is bounded: 1e30 is refused now)
        if self.step == 3:
            with torch.no_grad():
                self.raw_model.output.weight.fill_(1e38)  # logits overflow float32: the loss is not finite
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    rc = main(["pretrain", "--config", str(tmp_path / "cfg.toml"), "--out", str(run), "--no-progress",
               "--set", "train.grad_clip=0", "--set", "train.warmup_steps=0",
               "--set", "train.steps=6", "--set", "train.checkpoint_every=1", "--set", "train.keep_last=0"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("error:") == 1 and "Traceback" not in err
    line = err[err.index("error:"):]
    assert "training diverged" in line and "The step was not taken" in line, line
    saved = mio.list_checkpoints(run)
    assert [ck.name for ck in saved] == ["step_000001", "step_000002", "step_000003"]  # before the divergence
    assert str(saved[-1]) in line  # the message names the newest finite checkpoint
    for ck in saved:  # every checkpoint on disk is finite
        assert all(bool(v.isfinite().all()) for v in load_file(str(ck / mio.MODEL_FILE)).values()), ck
    metrics = [line for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(metrics) == int(saved[-1].name.split("_")[1])  # no row for the step not taken


def test_a_non_finite_weight_is_never_saved(tiny_run, tmp_path):
    import torch

    from lmforge.errors import CheckpointError
    from lmforge.model import Transformer, resolve_model_config
    from lmforge.train.checkpoint import save_checkpoint

    cfg, tok = tiny_run
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    with torch.no_grad():
        model.norm.weight[0] = math.inf
    with pytest.raises(CheckpointError, match="norm.weight holds NaN or infinite values; no checkpoint is written"):
        save_checkpoint(tmp_path / "run", 1, model, cfg, tok.folder, state={"tokens": 0, "data": {}})
    assert not mio.list_checkpoints(tmp_path / "run")
    assert not any(p.name.startswith(".step") for p in (tmp_path / "run").iterdir()) if (tmp_path / "run").exists() \
        else True


@pytest.mark.parametrize("resume", [False, True])
def test_a_backward_that_returns_zero_gradients_stops_at_the_first_step(tiny_run, tmp_path, capsys, monkeypatch,
                                                                       resume):
    """The fault torch 2.11's compile of the fused loss had on CUDA (2026-11-26, an H100): the loss right,
    every gradient 0, a run of frozen weights that only warned. Cross-entropy always has a
    gradient, so the first step of a process (a resume's too) with a finite loss > 0 and a
    gradient norm of exactly 0 stops with exit 2, before its optimizer step, naming
    train.compile; a checkpoint written before the fault is left as it was."""
    from lmforge.model import loss as L

    cfg, _ = tiny_run
    cfg.save(tmp_path / "cfg.toml")
    run = tmp_path / "run"
    args = ["pretrain", "--config", str(tmp_path / "cfg.toml"), "--out", str(run), "--no-progress",
            "--set", "train.steps=4", "--set", "train.checkpoint_every=2"]
    if resume:  # a healthy run cut back to its step-2 checkpoint, then a resume that meets the broken backward
        assert main(args) == 0
        capsys.readouterr()
        shutil.rmtree(run / "step_000004")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} if resume else {}
    original = L._LinearCrossEntropySum.backward

    def zero_backward(ctx, grad_total):
        return tuple(g if g is None else torch.zeros_like(g) for g in original(ctx, grad_total))

    import torch
    monkeypatch.setattr(L._LinearCrossEntropySum, "backward", staticmethod(zero_backward))
    rc = main(args + (["--resume"] if resume else []))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("error:") == 1 and "Traceback" not in err
    line = err[err.index("error:"):]
    step = 3 if resume else 1
    assert f"step {step}: the loss is" in line and "the gradient norm is exactly 0" in line, line
    assert "train.compile" in line
    assert [ck.name for ck in mio.list_checkpoints(run)] == (["step_000002"] if resume else [])
    for p, data in before.items():
        if p.name != "metrics.jsonl" and p.suffix not in (".lock",):
            assert p.read_bytes() == data, p
