"""`lmforge eval`: held-out loss, perplexity and bits per byte of a checkpoint; with `--tasks`,
an evaluation suite (lmforge.evals: built-in tasks on modules the model never read, or your own
JSONL / Parquet tasks) scored by the field's rules, with random baselines, centred scores and
intervals."""

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
    inputs = [("--checkpoint", checkpoint), ("--data", data_dir)]
    if out is not None:  # refused before any work: a folder, an input, an existing file without --force, ...
        check_user_file(out, force, inputs)
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
        with user_file(out, force, inputs) as tmp:
            tmp.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return res


def eval_tasks_stage(checkpoint: str | Path, tasks: str, limit: int = 300, seed: int = 0,
                     out: str | Path | None = None, force: bool = False, progress=None, samples: int = 0,
                     temperature: float = 0.8, ks: tuple[int, ...] = (1,)) -> dict:
    """Score a checkpoint on the tasks `tasks` names (`resolve_tasks`), fp32; returns (and with
    `out`, writes as JSON) {"checkpoint", "seed", "limit", "tasks": {name: figures}, "suite"}
    (lmforge.evals.suite; the `functions` task: lmforge.evals.generation, with `samples`,
    `temperature` and the pass@k `ks`). The same checkpoint and arguments give a byte-identical JSON.

    Raises:
        ConfigError: an unknown task name; a k above `samples`.
        OutputError: an existing `out` without `force`; `out` one of the inputs (a task file).
        DataError: a bad task file (file and line), an item longer than the model allows.
        CheckpointError / ContractError: a bad checkpoint.
    """
    import statistics

    import torch

    from lmforge.errors import ConfigError
    from lmforge.evals.generation import function_prompts, functions_task
    from lmforge.evals.resolve import fit_tasks, resolve_tasks, task_files
    from lmforge.evals.suite import score_task
    from lmforge.runtime import decode_runtime

    if limit < 0:
        raise ConfigError(f"--limit = {limit}: expected 0 (every item) or a positive number of items per task.")
    if samples < 0 or (samples and any(not 1 <= k <= samples for k in ks)) or any(k < 1 for k in ks):
        raise ConfigError(f"--samples {samples} --k {','.join(map(str, ks))}: pass@k needs samples >= 0 and "
                          f"1 <= k <= samples. Lower k or draw more samples.")
    inputs = [("--checkpoint", checkpoint), *(("--tasks", f) for f in task_files(tasks))]
    if out is not None:  # refused before any work: never one of the task files (--force or not)
        check_user_file(out, force, inputs)
    model, tok, cfg, path = load_checkpoint(checkpoint)
    task_list = fit_tasks(resolve_tasks(tasks, cfg, seed, limit, tok), tok, model.config.max_seq_len)
    device = training_runtime("fp32").device
    model = model.to(device=device, dtype=torch.float32).eval()
    results = {}
    for task in task_list:
        if isinstance(task, str):  # functions
            prompts = function_prompts(cfg.data.val_fraction, cfg.data.include_tests, tok, limit)
            r = functions_task(model, tok, prompts, samples, temperature, ks, seed, decode_runtime(device),
                               limit=limit)
            name = task
        else:
            r, name = score_task(model, tok, task, device=device), task.name
        results[name] = r
        if progress is not None:
            progress(name, r)
    suite = statistics.mean(r["centred"] for r in results.values())
    res = {"checkpoint": str(path), "seed": seed, "limit": limit, "tasks": results, "suite": suite}
    if out is not None:
        with user_file(out, force, inputs) as tmp:
            tmp.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return res
