"""`lmforge eval`: held-out loss, perplexity and bits per byte of a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.contract import CONTRACT_FILE
from lmforge.data.shards import Shard, preflight
from lmforge.errors import DataError
from lmforge.evaluate import evaluate_shard
from lmforge.fileio import check_user_file, user_file
from lmforge.loading import load_checkpoint
from lmforge.runtime import training_runtime


def eval_stage(checkpoint: str | Path, data_dir: str | Path | None = None, split: str = "val",
               out: str | Path | None = None, force: bool = False) -> dict:
    """Held-out loss, perplexity and bits per byte of a checkpoint on a prepared split,
    in the checkpoint's `train.precision`; with `out`, also written there as JSON.

    Raises:
        CheckpointError / ContractError / DataError: a bad checkpoint, data prepared with
        another tokenizer, damaged shards, or a split with no token to predict (all checked
        before any forward pass).
    """
    if out is not None:  # refused before any work: a folder, an existing file without --force, inside an output
        check_user_file(out, force)
    model, tok, cfg, path = load_checkpoint(checkpoint)
    data_dir = Path(data_dir or cfg.data.dir)
    preflight(data_dir, tok.contract, path / CONTRACT_FILE)  # contract, ids < vocab, eos ends: before any forward
    shard = Shard.open(data_dir, split, tok.contract, path / CONTRACT_FILE)
    if shard.n_tokens - shard.n_documents <= 0:  # each document of n tokens gives n - 1 targets
        raise DataError(f"data folder {data_dir}: split {split!r} holds {shard.n_documents} documents and no token to "
                        f"predict, so there is nothing to score (a loss of 0 would be a lie). Evaluate another split "
                        f"(--split), or re-run `lmforge prepare` with data.val_fraction > 0 for a validation split.")
    rt = training_runtime(cfg.train.precision)
    res = evaluate_shard(model.to(rt.device), shard, cfg.data.seq_len, cfg.train.micro_batch_size, rt,
                         cfg.data.document_masking)
    res.update(checkpoint=str(path), data=str(data_dir), split=split)
    if out is not None:
        with user_file(out, force) as tmp:
            tmp.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return res
