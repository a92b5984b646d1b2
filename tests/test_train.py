"""Training lowers the loss; checkpoints save and load exactly, resolve to the newest step,
are pruned to keep_last, and refuse folders without their contract."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lmforge.config import load_config
from lmforge.errors import CheckpointError, ConfigError, ContractError, LmforgeError
from lmforge.model import Transformer, load_model, resolve_model_config
from lmforge.stages import pretrain_stage
from lmforge.train import checkpoint as ckpt
from lmforge.model import io as mio
from lmforge.fileio import OutputError, open_run_dir
from lmforge.train.trainer import METRICS_FILE


@pytest.fixture(scope="module")
def trained(tiny_run, tmp_path_factory):
    """A 8-step run checkpointing every 2 steps and keeping the last 2."""
    cfg, tok = tiny_run
    cfg = replace(cfg, train=replace(cfg.train, steps=8, checkpoint_every=2, keep_last=2))
    run = tmp_path_factory.mktemp("trained") / "run"
    last = pretrain_stage(cfg, run, progress=False)
    return cfg, tok, run, last


def build(cfg, tok, seed: int, tie: bool = False) -> Transformer:
    mcfg = resolve_model_config(replace(cfg.model, tie_embeddings=tie), tok.contract)
    m = Transformer(mcfg)
    m.reset_parameters(seed=seed)
    return m.eval()


def tokens_for(tok, text: str = "def value(self):\n    return data") -> torch.Tensor:
    """(2, T) int64: two different rows of real ids, each starting with <|bos|>."""
    a, b = tok.encode(text), tok.encode(text[::-1])
    n = min(len(a), len(b))
    return torch.tensor([[tok.bos_id, *a[:n]], [tok.bos_id, *b[:n]]])


# -- training -------------------------------------------------------------------------
@pytest.mark.slow  # shares the 8-step training run
def test_a_few_steps_lower_the_loss(trained):
    cfg, tok, run, last = trained
    rows = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    for r in rows:
        assert {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s"} <= set(r)
        assert r["tokens"] == r["step"] * cfg.train.micro_batch_size * cfg.data.seq_len
    import math

    assert rows[0]["loss"] == pytest.approx(math.log(tok.vocab_size), abs=0.5)  # a fresh model is ~uniform
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0  # measured: 5.87 -> 4.30
    assert last["val_loss"] is not None and last["val_loss"] < rows[0]["loss"]
    assert last["steps_run"] == 8


@pytest.mark.slow  # shares the 8-step training run
def test_run_folder_contents(trained):
    cfg, tok, run, _ = trained
    for name in ("config.toml", "contract.json", "tokenizer.json", "tokenizer_config.json", METRICS_FILE):
        assert (run / name).is_file(), name
    assert load_config(run / "config.toml") == cfg


@pytest.mark.slow  # shares the 8-step training run
def test_keep_last_prunes_during_training(trained):
    _, _, run, _ = trained
    assert [p.name for p in mio.list_checkpoints(run)] == ["step_000006", "step_000008"]
    assert not list(run.glob(".tmp-*"))
    step = run / "step_000008"
    for name in ("model.safetensors", "optimizer.pt", "rng.pt", "state.json", "config.toml",
                 "contract.json", "tokenizer.json", "tokenizer_config.json"):
        assert (step / name).is_file(), name
    state = json.loads((step / "state.json").read_text())
    assert state["step"] == 8 and state["tokens"] > 0


@pytest.mark.slow  # shares the 8-step training run
def test_from_checkpoint_on_the_run_folder_is_the_newest_step(trained):
    cfg, tok, run, _ = trained
    x = tokens_for(tok)
    newest = Transformer.from_checkpoint(run)
    torch.testing.assert_close(newest(x), Transformer.from_checkpoint(run / "step_000008")(x), rtol=0, atol=0)
    older = Transformer.from_checkpoint(run / "step_000006")
    assert not torch.equal(newest(x), older(x))


@pytest.mark.slow  # shares the 8-step training run
def test_fresh_run_refuses_a_folder_with_checkpoints(trained):
    cfg, _, run, _ = trained
    with pytest.raises(OutputError, match="--resume"):
        open_run_dir(run, "pretrain", False, mio.list_checkpoints, create=False)
    open_run_dir(run, "pretrain", True, mio.list_checkpoints, create=False)
    with pytest.raises(OutputError, match="already holds a `lmforge pretrain` run with checkpoints"):
        pretrain_stage(cfg, run, progress=False)


def test_pretrain_without_prepared_data(tiny_run, tmp_path):
    cfg, _ = tiny_run
    cfg = replace(cfg, data=replace(cfg.data, dir=str(tmp_path / "not-prepared")))
    with pytest.raises(LmforgeError, match="lmforge prepare"):
        pretrain_stage(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


# -- checkpoints ----------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_save_load_gives_identical_logits(tiny_run, tmp_path, tie):
    cfg, tok = tiny_run
    cfg = replace(cfg, model=replace(cfg.model, tie_embeddings=tie))
    model = build(cfg, tok, seed=5, tie=tie)
    with torch.no_grad():  # move away from the init so a silent re-init would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = ckpt.save_checkpoint(tmp_path / "run", 3, model, cfg, tok.folder, state={"tokens": 12})
    assert path == tmp_path / "run" / "step_000003"
    loaded, lcfg, contract, where = load_model(tmp_path / "run")
    assert where == path and lcfg == cfg and contract == tok.contract
    x = tokens_for(tok)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    if tie:
        assert loaded.output.weight is loaded.tok_embeddings.weight
        from safetensors.torch import load_file

        assert "output.weight" not in load_file(str(path / mio.MODEL_FILE))  # stored once
    state = json.loads((path / "state.json").read_text())
    assert state == {"tokens": 12, "step": 3}


def test_newest_complete_step_is_chosen(tiny_run, tmp_path):
    cfg, tok = tiny_run
    run = tmp_path / "run"
    models = {}
    for step in (2, 999_999, 1_000_000, 30):
        models[step] = build(cfg, tok, seed=step)
        ckpt.save_checkpoint(run, step, models[step], cfg, tok.folder)
    # not complete, or not a step folder: ignored
    (run / "step_2000000").mkdir()
    (run / ".tmp-step_3000000").mkdir()
    shutil.copytree(run / "step_000030", run / ".tmp-step_4000000")
    (run / "notes").mkdir()
    names = [p.name for p in mio.list_checkpoints(run)]
    assert names == ["step_000002", "step_000030", "step_999999", "step_1000000"]  # numeric order
    x = tokens_for(tok)
    torch.testing.assert_close(Transformer.from_checkpoint(run)(x), models[1_000_000](x), rtol=0, atol=0)
    assert mio.resolve_checkpoint(run / "step_000030") == run / "step_000030"


def test_prune_checkpoints(tiny_run, tmp_path):
    cfg, tok = tiny_run
    run = tmp_path / "run"
    model = build(cfg, tok, seed=0)
    for step in (1, 2, 3, 4, 5):
        ckpt.save_checkpoint(run, step, model, cfg, tok.folder)
    ckpt.prune_checkpoints(run, 0)  # 0 = keep all
    assert len(mio.list_checkpoints(run)) == 5
    ckpt.prune_checkpoints(run, 3)
    assert [p.name for p in mio.list_checkpoints(run)] == ["step_000003", "step_000004", "step_000005"]
    ckpt.prune_checkpoints(run, 1)
    assert [p.name for p in run.iterdir()] == ["step_000005"]


@pytest.fixture
def one_checkpoint(tiny_run, tmp_path) -> Path:
    cfg, tok = tiny_run
    return ckpt.save_checkpoint(tmp_path / "run", 1, build(cfg, tok, seed=1), cfg, tok.folder)


def test_checkpoint_without_contract(one_checkpoint):
    (one_checkpoint / "contract.json").unlink()
    with pytest.raises(ContractError) as exc:
        Transformer.from_checkpoint(one_checkpoint)
    msg = str(exc.value)
    assert f"checkpoint {one_checkpoint} has no contract.json" in msg
    with pytest.raises(ContractError, match="has no contract.json"):
        Transformer.from_checkpoint(one_checkpoint.parent)  # through the run folder too


def test_checkpoint_with_a_swapped_tokenizer(one_checkpoint, tmp_path):
    (one_checkpoint / "tokenizer.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ContractError, match="tokenizer_sha256"):
        Transformer.from_checkpoint(one_checkpoint)


def test_checkpoint_without_config(one_checkpoint):
    (one_checkpoint / "config.toml").unlink()
    with pytest.raises(CheckpointError, match="no config.toml"):
        Transformer.from_checkpoint(one_checkpoint)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError) as exc:
        Transformer.from_checkpoint(tmp_path)
    assert str(tmp_path) in str(exc.value) and "not a checkpoint" in str(exc.value)
    with pytest.raises(CheckpointError):
        Transformer.from_checkpoint(tmp_path / "missing")


def test_damaged_weights(one_checkpoint):
    (one_checkpoint / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match="cannot read weights"):
        Transformer.from_checkpoint(one_checkpoint)


def test_weights_load_strictly(one_checkpoint):
    from safetensors.torch import load_file, save_file

    path = one_checkpoint / "model.safetensors"
    state = load_file(str(path))
    del state["layers.1.feed_forward.w2.weight"]
    state["layers.9.extra"] = torch.zeros(1)
    save_file(state, str(path))
    with pytest.raises(CheckpointError) as exc:
        Transformer.from_checkpoint(one_checkpoint)
    assert "layers.1.feed_forward.w2.weight" in str(exc.value) and "layers.9.extra" in str(exc.value)


def test_weights_of_another_shape(one_checkpoint):
    text = (one_checkpoint / "config.toml").read_text()
    (one_checkpoint / "config.toml").write_text(text.replace("dim = 32", "dim = 64"))
    with pytest.raises(CheckpointError, match="shape"):
        Transformer.from_checkpoint(one_checkpoint)
