"""A trained checkpoint with its tokenizer, the contract checked: the one loader of every
command that reads a checkpoint to use it (generate, chat, eval, export, serve, the speedrun's
evaluation, SFT's initial weights)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from lmforge.config import OVERLAY_ENV, Config, overlay_differences
from lmforge.contract import CONTRACT_FILE
from lmforge.model import Transformer, load_model
from lmforge.model.io import read_checkpoint_meta, resolve_checkpoint
from lmforge.tokenizer import Tokenizer


class Checkpoint(NamedTuple):
    model: Transformer
    """In eval mode, on the device asked for."""
    tokenizer: Tokenizer
    config: Config
    """The checkpoint's own config (config.toml)."""
    path: Path
    """The step_NNNNNN folder loaded (the newest complete one of a run folder)."""


def load_checkpoint(checkpoint: str | Path, tokenizer: str | Path | None = None,
                    device: str | torch.device = "cpu", note_overlay: bool = True) -> Checkpoint:
    """Load `checkpoint` (a step_NNNNNN folder, or a run folder: its newest complete
    checkpoint) with a tokenizer: the folder `tokenizer`, else the checkpoint's own copy.

    The tokenizer is checked against its contract (`Tokenizer.load`) and the checkpoint's
    contract against the tokenizer's (P1, P6), before any weight is read. The model is the
    checkpoint's [model] as saved; `note_overlay`: say in one line when `LMFORGE_CONFIG_OVERLAY`
    sets a model.X it does not take (`note_overlay_model`; a training run's start refuses those
    instead, `config.model_from_init`).

    Raises:
        CheckpointError: not a checkpoint (no config or contract), incomplete, damaged or
            non-finite weights.
        ContractError: a tokenizer that differs from the checkpoint's, or from its own contract.
    """
    path = resolve_checkpoint(checkpoint)
    saved, _ = read_checkpoint_meta(path)  # a folder without config/contract is named as a checkpoint, not a tokenizer
    if note_overlay:
        note_overlay_model(saved, path)
    tok = Tokenizer.load(Path(tokenizer) if tokenizer else path)
    model, config, _, path = load_model(path, device, tok.contract, tok.folder / CONTRACT_FILE)
    return Checkpoint(model, tok, config, path)


_noted: set[tuple[str, str]] = set()


def note_overlay_model(saved: Config, path: Path) -> None:
    """One line on stderr (once per checkpoint and overlay) when the overlay (`LMFORGE_CONFIG_OVERLAY`)
    sets [model] values other than those of the checkpoint `path` (config `saved`): a checkpoint's
    weights have its own [model], so the overlay's is not applied to it, as `--set model.X` is not
    (generate, chat, eval, export, serve read a checkpoint's [model] as saved).

    Raises:
        ConfigError: the overlay cannot be read, or holds an unknown key or a wrong type (named).
    """
    overlay, changed = overlay_differences(saved, "model")
    key = (os.path.abspath(overlay), os.path.abspath(path))
    if not changed or key in _noted:
        return
    _noted.add(key)
    sets = ", ".join(f"{name} = {mine!r}" for name, mine, _ in changed)
    keeps = ", ".join(f"{name} = {theirs!r}" for name, _, theirs in changed)
    print(f"note: {OVERLAY_ENV}={overlay} sets {sets}, but {path} keeps its own [model] ({keeps}): a checkpoint's "
          f"model is read as saved, so the overlay's [model] is ignored here (as --set model.X is).", file=sys.stderr)


__all__ = ["Checkpoint", "load_checkpoint", "note_overlay_model"]
