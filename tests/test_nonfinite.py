"""The non-finite guard: a step whose loss or gradient norm is not finite is never taken,
no checkpoint with a non-finite weight is ever written, and the run stops with exit 2 and a
message naming the last finite checkpoint."""

from __future__ import annotations

import math

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
