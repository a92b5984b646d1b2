"""lmforge.loading.load_checkpoint: the one way a command loads a checkpoint with its
tokenizer, the contract checked (generate, chat, eval, export, the speedrun, SFT's init)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from lmforge.errors import CheckpointError, ContractError
from lmforge.loading import load_checkpoint
from lmforge.model import Transformer, resolve_model_config
from lmforge.train.checkpoint import save_checkpoint

SRC = Path(__file__).resolve().parents[1] / "src" / "lmforge"


@pytest.fixture(scope="module")
def ckpt(tiny_run, tmp_path_factory):
    cfg, tok = tiny_run
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=1)
    return save_checkpoint(tmp_path_factory.mktemp("load") / "run", 2, model, cfg, tok.folder), model


def test_loads_the_newest_checkpoint_with_its_own_tokenizer(ckpt, tiny_run):
    path, model = ckpt
    loaded = load_checkpoint(path.parent)  # the run folder: its newest checkpoint
    assert loaded.path == path and not loaded.model.training
    assert loaded.tokenizer.contract == tiny_run[1].contract and loaded.tokenizer.folder == path
    for (n, p), (_, q) in zip(model.named_parameters(), loaded.model.named_parameters()):
        assert torch.equal(p, q), n
    assert loaded.config.model.dim == model.config.dim
    assert load_checkpoint(path, tiny_run[1].folder).tokenizer.folder == tiny_run[1].folder  # a separate one


def test_refuses_another_tokenizer_and_a_folder_that_is_not_a_checkpoint(ckpt, tmp_path, tiny_corpus):
    from lmforge.tokenizer import train_tokenizer

    path, _ = ckpt
    texts = [p.read_text() for p in sorted(tiny_corpus.glob("*.py"))]
    other = train_tokenizer(texts, 320, tmp_path / "other", show_progress=False)  # consistent, but not this one's
    with pytest.raises(ContractError, match="other"):
        load_checkpoint(path, other.folder)
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "nothing-here")
    with pytest.raises(CheckpointError):
        load_checkpoint(other.folder)  # a tokenizer folder is not a checkpoint


def test_no_module_loads_a_checkpoint_another_way():
    """Outside model/ (where load_model lives) only lmforge/loading.py calls load_model."""
    callers = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "load_model":
                callers.add(str(path.relative_to(SRC)))
    assert callers <= {"loading.py", "model/load.py"}, callers
