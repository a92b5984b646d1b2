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

#: `--tasks` names every built-in task with this word.
ALL_BUILTIN = "builtin"


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


def resolve_tasks(spec: str, cfg, seed: int, limit: int, tok=None) -> list:
    """The tasks `spec` names (comma-separated: built-in names, "builtin" for all of them, or
    .jsonl / .parquet files of your own), in the order given.

    Raises:
        ConfigError: an unknown name, naming the choices.
        DataError: a task file that cannot be read (file and line).
    """
    from lmforge.config.fields import suggest
    from lmforge.errors import ConfigError
    from lmforge.evals.builtin import BUILTIN_TASKS, builtin_tasks
    from lmforge.evals.generation import GENERATION_TASKS
    from lmforge.evals.tasks import read_task_file

    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"--tasks is empty: name built-in tasks ({', '.join(BUILTIN_TASKS)}, or {ALL_BUILTIN!r} "
                          f"for all) or .jsonl / .parquet files of your own.")
    expanded: list[str] = []
    for n in names:
        expanded += list(BUILTIN_TASKS) if n == ALL_BUILTIN else [n]
    known = [*BUILTIN_TASKS, *GENERATION_TASKS]
    for n in expanded:
        if n not in known and not n.endswith((".jsonl", ".parquet")):
            raise ConfigError(f"--tasks names {n!r}: expected one of {known}, {ALL_BUILTIN!r}, or a .jsonl / .parquet "
                              f"file of items.{suggest(n, [*known, ALL_BUILTIN])}")
    if len(set(expanded)) != len(expanded):
        raise ConfigError(f"--tasks = {spec!r} names a task twice; list each once.")
    wanted = [n for n in expanded if n in BUILTIN_TASKS]
    built = {t.name: t for t in builtin_tasks(wanted, cfg.data.val_fraction, cfg.data.include_tests, seed, limit,
                                              tok=tok)} if wanted else {}
    from lmforge.data.conversations import cap_examples

    tasks = []
    for n in expanded:
        if n in GENERATION_TASKS:
            tasks.append(n)  # scored by running what the model writes (eval_tasks_stage)
            continue
        if n in built:
            tasks.append(built[n])
            continue
        task = read_task_file(n)
        task.items = cap_examples(task.items, limit, lambda x: x.where)
        tasks.append(task)
    return tasks


def fit_tasks(tasks: list, tok, max_seq_len: int) -> list:
    """Every item's continuations must be shorter than the model's context (a context is cut from
    the left, as lm-evaluation-harness does): a built-in task leaves such items out (counted in
    `too_long`), a file of yours is refused naming the item.

    Raises:
        DataError: an item of a file of yours, or a built-in task left with no item.
    """
    from lmforge.evals.builtin import BUILTIN_TASKS
    from lmforge.evals.scoring import continuation_tokens

    for task in tasks:
        if isinstance(task, str):
            continue
        kept = []
        for item in task.items:
            longest = max(continuation_tokens(tok, c, x) for c, x in task.requests(item))
            if longest < max_seq_len:
                kept.append(item)
            elif task.name not in BUILTIN_TASKS:
                raise DataError(f"{item.where}: a continuation of {longest} tokens does not fit the model's context "
                                f"of {max_seq_len} tokens. Shorten it, or leave the item out.")
        task.too_long, task.items = len(task.items) - len(kept), kept
        if not kept:
            raise DataError(f"task {task.name!r}: none of its items fits the model's context of {max_seq_len} tokens "
                            f"(all {task.too_long} are longer). Leave the task out of --tasks.")
    return tasks


def eval_tasks_stage(checkpoint: str | Path, tasks: str, limit: int = 300, seed: int = 0,
                     out: str | Path | None = None, force: bool = False, progress=None, samples: int = 0,
                     temperature: float = 0.8, ks: tuple[int, ...] = (1,)) -> dict:
    """Score a checkpoint on the tasks `tasks` names (`resolve_tasks`), fp32; returns (and with
    `out`, writes as JSON) {"checkpoint", "seed", "limit", "tasks": {name: figures}, "suite"}
    (lmforge.evals.suite; the `functions` task: lmforge.evals.generation, with `samples`,
    `temperature` and the pass@k `ks`). The same checkpoint and arguments give a byte-identical JSON.

    Raises:
        ConfigError: an unknown task name; an existing `out` without `force`; a k above `samples`.
        DataError: a bad task file (file and line), an item longer than the model allows.
        CheckpointError / ContractError: a bad checkpoint.
    """
    import statistics

    import torch

    from lmforge.errors import ConfigError
    from lmforge.evals.generation import function_prompts, functions_task
    from lmforge.evals.suite import score_task
    from lmforge.runtime import decode_runtime

    if limit < 0:
        raise ConfigError(f"--limit = {limit}: expected 0 (every item) or a positive number of items per task.")
    if samples < 0 or (samples and any(not 1 <= k <= samples for k in ks)) or any(k < 1 for k in ks):
        raise ConfigError(f"--samples {samples} --k {','.join(map(str, ks))}: pass@k needs samples >= 0 and "
                          f"1 <= k <= samples. Lower k or draw more samples.")
    if out is not None:
        check_user_file(out, force)
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
        with user_file(out, force) as tmp:
            tmp.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return res
