"""Checkpoints continue a run exactly, and survive being killed mid-write.

- 20 steps straight == 10 steps, SIGTERM, --resume, 10 steps: bit-identical losses,
  weights and optimizer state (one process, CPU).
- SIGKILL while a checkpoint is being written leaves the previous one loadable and
  resumable; SIGTERM finishes the step, writes a clean checkpoint and says how to resume.
- RNG states (torch, numpy, python), data position and metrics.jsonl are restored.
- Loading is strict: a missing or unexpected key is an error.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.errors import CheckpointError
from lmforge.model import Transformer, resolve_model_config
from lmforge.stages import pretrain_stage
from lmforge.train import checkpoint as ckpt
from lmforge.model import io as mio
from lmforge.train.trainer import Trainer


def with_train(cfg, **kw):
    return replace(cfg, train=replace(cfg.train, **kw))


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_state(a: Path, b: Path) -> None:
    """Two checkpoint folders hold bit-identical weights, optimizer state and data position."""
    wa, wb = load_file(str(a / mio.MODEL_FILE)), load_file(str(b / mio.MODEL_FILE))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    oa = torch.load(a / "optimizer.pt", weights_only=True)
    ob = torch.load(b / "optimizer.pt", weights_only=True)
    assert oa["state"].keys() == ob["state"].keys()
    for name, st in oa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, ob["state"][name][k]), (name, k)
    sa, sb = (json.loads((p / "state.json").read_text()) for p in (a, b))
    assert (sa["step"], sa["tokens"], sa["data"]) == (sb["step"], sb["tokens"], sb["data"])


def sigterm_at(monkeypatch, step: int) -> None:
    """Send this process a real SIGTERM right after optimizer step `step`."""
    original = Trainer.train_step

    def train_step(self):
        m = original(self)
        if self.step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return m

    monkeypatch.setattr(Trainer, "train_step", train_step)


@pytest.mark.slow
def test_resume_is_bit_identical(tiny_run, tmp_path, monkeypatch, capsys):
    cfg, _ = tiny_run
    cfg = with_train(cfg, steps=20, checkpoint_every=0, keep_last=0)
    pretrain_stage(cfg, tmp_path / "straight", progress=False)

    sigterm_at(monkeypatch, 10)
    last = pretrain_stage(cfg, tmp_path / "split", progress=False)
    assert last["step"] == 10 and last["steps_run"] == 10
    err = capsys.readouterr().err
    assert "stopped at step 10 of 20 (SIGTERM)" in err and "run the same command again with --resume" in err
    assert [p.name for p in mio.list_checkpoints(tmp_path / "split")] == ["step_000010"]
    monkeypatch.undo()
    # something else uses the global RNGs in between: resume must not depend on them
    torch.manual_seed(999), np.random.seed(999), random.seed(999)
    last = pretrain_stage(cfg, tmp_path / "split", resume=True, progress=False)
    assert last["steps_run"] == 10 and "resumed from" in capsys.readouterr().err

    straight, split = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [m["step"] for m in split] == list(range(1, 21))
    for key in ("loss", "grad_norm", "lr", "tokens", "supervised"):
        assert [m[key] for m in split] == [m[key] for m in straight], key  # bit-identical
    assert split[-1]["val_loss"] == straight[-1]["val_loss"]
    assert straight[-1]["loss"] < straight[0]["loss"] - 0.5  # it trained: the comparison is not vacuous
    assert_same_state(tmp_path / "straight" / "step_000020", tmp_path / "split" / "step_000020")


def _trainer(cfg, tok, run: Path, tie: bool = False) -> Trainer:
    from lmforge.data.packing import shard_stream
    from lmforge.data.shards import Shard

    cfg = replace(cfg, model=replace(cfg.model, tie_embeddings=tie))
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=cfg.train.seed)
    shard = Shard.open(cfg.data.dir, "train", tok.contract)
    stream = shard_stream(shard, cfg.data.seq_len, cfg.train.micro_batch_size, cfg.train.seed)
    return Trainer(cfg, run, Path(cfg.tokenizer.dir), model, stream, progress=False, log=lambda m: None)


def rng_draws() -> tuple:
    return torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)]


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_restores_everything(tiny_run, tmp_path, tie):
    cfg, tok = tiny_run
    cfg = with_train(cfg, steps=3)
    a = _trainer(cfg, tok, tmp_path / "run", tie)
    for _ in range(3):
        a.train_step()
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    rng_draws()
    a.save()
    expected = rng_draws()  # what the RNGs give right after the checkpoint

    torch.manual_seed(4), np.random.seed(5), random.seed(6)
    b = _trainer(cfg, tok, tmp_path / "run", tie)
    assert b.resume()
    assert rng_draws() == expected
    assert b.step == 3 and b.tokens == a.tokens and b.stream.state_dict() == a.stream.state_dict()
    for (n, p), (_, q) in zip(a.raw_model.named_parameters(), b.raw_model.named_parameters()):
        assert torch.equal(p, q), n
        sa, sb = a.optimizer.state[p], b.optimizer.state[q]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), n
    if tie:
        assert b.raw_model.output.weight is b.raw_model.tok_embeddings.weight
    ma, mb = a.train_step(), b.train_step()  # and the next step is the same
    assert ma == mb


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(body, encoding="utf-8")
    return path


@pytest.mark.slow
def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(tiny_run, tmp_path):
    cfg, _ = tiny_run
    cfg = with_train(cfg, steps=6, checkpoint_every=3, keep_last=2)
    cfg.save(tmp_path / "cfg.toml")
    run = tmp_path / "run"
    script = _script(tmp_path, f"""
import sys, time
import lmforge.model.io as mio
from lmforge.config import load_config
from lmforge.stages import pretrain_stage

write = mio.save_safetensors
def slow_write(state, path, metadata=None):  # the weights of step 6 are on disk; the rest is not yet
    write(state, path, metadata=metadata)
    if ".step_000006.tmp-" in str(path):
        print("WRITING", flush=True)
        time.sleep(120)
mio.save_safetensors = slow_write
pretrain_stage(load_config({str(tmp_path / 'cfg.toml')!r}), {str(run)!r}, progress=False)
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.strip() == "WRITING" or not line:
                break
        assert line.strip() == "WRITING", "the run never reached the second checkpoint"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert [p.name for p in run.glob(".step_000006.tmp-*/" + mio.MODEL_FILE)]  # killed mid-write
    assert not (run / "step_000006").exists()
    assert mio.latest_checkpoint(run) == run / "step_000003"
    Transformer.from_checkpoint(run)  # the previous checkpoint loads
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4, 5, 6]  # metrics ran ahead of it
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # and a line torn by a kill

    last = pretrain_stage(cfg, run, resume=True, progress=False)  # and resumes
    assert last["step"] == 6 and last["steps_run"] == 3
    pretrain_stage(cfg, tmp_path / "straight", progress=False)
    got, want = read_metrics(run), read_metrics(tmp_path / "straight")
    assert [m["step"] for m in got] == list(range(1, 7))  # truncated to step 3 on resume, no duplicates
    assert [m["loss"] for m in got] == [m["loss"] for m in want]
    assert_same_state(run / "step_000006", tmp_path / "straight" / "step_000006")
    assert sorted(p.name for p in run.iterdir()) == [".lmforge-output", "config.toml", "contract.json", "data_inputs.json", "metrics.jsonl",
                                                     "plan.json", "step_000003", "step_000006", "tokenizer.json",
                                                     "tokenizer_config.json"]  # stale .tmp and lock gone


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_writes_a_clean_checkpoint_and_says_how_to_resume(tiny_run, tmp_path, sig):
    cfg, _ = tiny_run
    cfg = with_train(cfg, steps=100_000, checkpoint_every=0)
    cfg.save(tmp_path / "cfg.toml")
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "pretrain", "--config", str(tmp_path / "cfg.toml"),
                             "--out", str(run), "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 120
        metrics = run / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err[-2000:]  # 143 / 130: stopped, not finished
    steps = [m["step"] for m in read_metrics(run)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3
    assert f"stopped at step {steps[-1]} of 100000 ({sig.name}); checkpoint written to {run / mio.step_dir_name(steps[-1])}" in err
    assert "To continue, run the same command again with --resume" in err
    assert json.loads(out.strip().splitlines()[-1])["step"] == steps[-1]
    assert [p.name for p in run.iterdir() if p.is_dir()] == [mio.step_dir_name(steps[-1])]  # no .tmp left
    state = json.loads((run / mio.step_dir_name(steps[-1]) / "state.json").read_text())
    assert state["step"] == steps[-1]
    Transformer.from_checkpoint(run)


@pytest.mark.slow
def test_keep_last_prunes_and_resume_takes_the_newest_complete(tiny_run, tmp_path, capsys):
    cfg, _ = tiny_run
    cfg = with_train(cfg, min_lr_ratio=1.0)  # a flat schedule: more steps leave the steps taken as they were
    run = tmp_path / "run"
    pretrain_stage(with_train(cfg, steps=7, checkpoint_every=2, keep_last=2), run, progress=False)
    assert [p.name for p in mio.list_checkpoints(run)] == ["step_000006", "step_000007"]
    (run / "step_000009").mkdir()  # not complete: no weights
    (run / ".step_000010.tmp-x1y2z3").mkdir()  # a write that never finished
    assert mio.latest_checkpoint(run) == run / "step_000007"
    last = pretrain_stage(with_train(cfg, steps=8, checkpoint_every=2, keep_last=2), run, resume=True, progress=False)
    assert f"resumed from {run / 'step_000007'} at step 7" in capsys.readouterr().err
    assert last["step"] == 8 and last["steps_run"] == 1
    assert [p.name for p in mio.list_checkpoints(run)] == ["step_000007", "step_000008"]
    assert not (run / ".step_000010.tmp-x1y2z3").exists()


def test_load_weights_is_strict(tiny_run, tmp_path):
    cfg, tok = tiny_run
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    good = mio.model_state(model)

    def load(state):
        save_file(state, str(tmp_path / "w.safetensors"))
        mio.load_weights(Transformer(resolve_model_config(cfg.model, tok.contract)), tmp_path / "w.safetensors")

    missing = dict(good)
    del missing["layers.1.feed_forward.w2.weight"]
    with pytest.raises(CheckpointError) as exc:
        load(missing)
    msg = str(exc.value)
    assert "missing ['layers.1.feed_forward.w2.weight'], unexpected []" in msg and "no key is ever skipped" in msg
    with pytest.raises(CheckpointError, match=r"missing \[\], unexpected \['layers.2.attention.wq.weight'\]"):
        load(dict(good, **{"layers.2.attention.wq.weight": torch.zeros(32, 32)}))
    with pytest.raises(CheckpointError, match=r"norm.weight has shape \(16,\), the config expects \(32,\)"):
        load(dict(good, **{"norm.weight": torch.ones(16)}))
    (tmp_path / "w.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="cannot read weights"):
        mio.load_weights(model, tmp_path / "w.safetensors")
    load(good)  # and the right keys load


def test_optimizer_state_of_another_model_is_refused(tiny_run, tmp_path):
    cfg, tok = tiny_run
    a = _trainer(cfg, tok, tmp_path / "a")
    a.train_step()
    state = ckpt.gather_optimizer_state(a.raw_model, a.optimizer)
    state["param_groups"][0]["params"] = [n.replace("layers.1.", "layers.7.") for n in state["param_groups"][0]["params"]]
    with pytest.raises(CheckpointError, match=r"optimizer.pt: optimizer state for other parameters: missing "
                                              r"\['layers.1.attention.wk.weight'"):
        ckpt.load_optimizer_state(a.raw_model, a.optimizer, state)


# The compiled run resumed in a new process (warm and cold inductor caches, two threads, stopped by the
# time limit as a user's run is): tests/test_issue53_resume.py.
