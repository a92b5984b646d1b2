"""A trained checkpoint with its tokenizer, the contract checked: the one loader of every
command that reads a checkpoint to use it (generate, chat, eval, export, serve, the speedrun's
evaluation, SFT's initial weights)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from lmforge.config import Config
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
                    device: str | torch.device = "cpu") -> Checkpoint:
    """Load `checkpoint` (a step_NNNNNN folder, or a run folder: its newest complete
    checkpoint) with a tokenizer: the folder `tokenizer`, else the checkpoint's own copy.

    The tokenizer is checked against its contract (`Tokenizer.load`) and the checkpoint's
    contract against the tokenizer's (P1, P6), before any weight is read.

    Raises:
        CheckpointError: not a checkpoint (no config or contract), incomplete, damaged or
            non-finite weights.
        ContractError: a tokenizer that differs from the checkpoint's, or from its own contract.
    """
    path = resolve_checkpoint(checkpoint)
    read_checkpoint_meta(path)  # a folder without config/contract is named as a checkpoint, not a tokenizer
    tok = Tokenizer.load(Path(tokenizer) if tokenizer else path)
    model, config, _, path = load_model(path, device, tok.contract, tok.folder / CONTRACT_FILE)
    return Checkpoint(model, tok, config, path)


__all__ = ["Checkpoint", "load_checkpoint"]
