"""Which tasks `--tasks` (or `train.eval_tasks`) names, and fitting them to a model.

`resolve_tasks` turns a comma-separated spec into tasks: built-in names (BUILTIN_TASKS, or
"builtin" for all of them), "functions" (a generation task, run by its own code), or .jsonl /
.parquet files of your own items. `fit_tasks` keeps what fits the model's context.
"""

from __future__ import annotations

from lmforge.config.fields import suggest
from lmforge.data.conversations import cap_examples
from lmforge.errors import ConfigError, DataError
from lmforge.evals.builtin import BUILTIN_TASKS, builtin_tasks
from lmforge.evals.generation import GENERATION_TASKS
from lmforge.evals.scoring import continuation_tokens
from lmforge.evals.tasks import read_task_file

#: `--tasks` names every built-in task with this word.
ALL_BUILTIN = "builtin"


def task_names(spec: str | list[str], generation: bool = True) -> list[str]:
    """The names a spec lists, "builtin" expanded, checked (`generation`: "functions" allowed).

    Raises:
        ConfigError: an empty spec, an unknown name (with the closest), a name given twice.
    """
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    known = [*BUILTIN_TASKS, *(GENERATION_TASKS if generation else ())]
    if not names:
        raise ConfigError(f"--tasks is empty: name built-in tasks ({', '.join(known)}, or {ALL_BUILTIN!r} for the "
                          f"first {len(BUILTIN_TASKS)}) or .jsonl / .parquet files of your own.")
    expanded: list[str] = []
    for n in names:
        expanded += list(BUILTIN_TASKS) if n == ALL_BUILTIN else [n]
    for n in expanded:
        if n not in known and not n.endswith((".jsonl", ".parquet")):
            extra = "" if generation or n not in GENERATION_TASKS else " (a generation task: run it with lmforge eval)"
            raise ConfigError(f"tasks name {n!r}{extra}: expected one of {known}, {ALL_BUILTIN!r}, or a .jsonl / "
                              f".parquet file of items.{suggest(n, [*known, ALL_BUILTIN])}")
    if len(set(expanded)) != len(expanded):
        raise ConfigError(f"tasks {','.join(names)!r} name a task twice; list each once.")
    return expanded


def task_files(spec: str | list[str]) -> list[str]:
    """The files of your own a spec names (its .jsonl / .parquet entries), in the order given."""
    names = spec.split(",") if isinstance(spec, str) else [str(n) for n in spec]
    return [n.strip() for n in names if n.strip().endswith((".jsonl", ".parquet"))]


def spec_key(spec: str | list[str], key: str | None = None) -> str:
    """What a spec is called in messages: `key`, else "--tasks" for the command line's text and
    "train.eval_tasks" for the config's list."""
    return key or ("--tasks" if isinstance(spec, str) else "train.eval_tasks")


def _named(exc: DataError, key: str, name: str) -> DataError:
    """`exc` of a task file that a config key names, said with the key first (the file and line stay)."""
    return DataError(f"{key} names {name}: {exc}") if key != "--tasks" and not str(exc).startswith(key) else exc


def resolve_tasks(spec: str | list[str], cfg, seed: int, limit: int, tok=None, key: str | None = None) -> list:
    """The tasks `spec` names (comma-separated: built-in names, "builtin" for all of them, or
    .jsonl / .parquet files of your own), in the order given. `key` names the spec in errors
    (default `spec_key`: "--tasks", or "train.eval_tasks" for a list).

    Raises:
        ConfigError: an unknown name, naming the choices.
        DataError: a task file that cannot be read (the key, the file and line).
    """
    key = spec_key(spec, key)
    expanded = task_names(spec)
    wanted = [n for n in expanded if n in BUILTIN_TASKS]
    built = {t.name: t for t in builtin_tasks(wanted, cfg.data.val_fraction, cfg.data.include_tests, seed, limit,
                                              tok=tok)} if wanted else {}
    tasks = []
    for n in expanded:
        if n in GENERATION_TASKS:
            tasks.append(n)  # scored by running what the model writes (eval_tasks_stage)
            continue
        if n in built:
            tasks.append(built[n])
            continue
        try:
            task = read_task_file(n, key)
        except DataError as exc:
            raise _named(exc, key, n) from None
        task.items = cap_examples(task.items, limit, lambda x: x.where)
        tasks.append(task)
    return tasks


def check_task_files(spec: list[str], tok, max_seq_len: int, key: str = "train.eval_tasks") -> None:
    """Read and fit every task file `spec` (a config key's list) names, as the run will: a training
    stage calls it before it claims its run folder, so a bad file leaves nothing behind. Built-in
    tasks are not built here (they are made from the standard library, never refused).

    Raises:
        ConfigError / DataError: naming `key`, the file and the line.
    """
    files = task_files(spec)
    if not files:
        return
    task_names(spec, generation=False)
    tasks = []
    for n in files:
        try:
            tasks.append(read_task_file(n, key))
        except DataError as exc:
            raise _named(exc, key, n) from None
    fit_tasks(tasks, tok, max_seq_len, key)


def fit_tasks(tasks: list, tok, max_seq_len: int, key: str = "--tasks") -> list:
    """Every item's continuations must be shorter than the model's context (a context is cut from
    the left, as lm-evaluation-harness does): a built-in task leaves such items out (counted in
    `too_long`), a file of yours is refused naming the item (and `key`, when a config key names it).

    Raises:
        DataError: an item of a file of yours, or a built-in task left with no item.
    """
    for task in tasks:
        if isinstance(task, str):
            continue
        kept = []
        for item in task.items:
            longest = max(continuation_tokens(tok, c, x) for c, x in task.requests(item))
            if longest < max_seq_len:
                kept.append(item)
            elif task.name not in BUILTIN_TASKS:
                raise _named(DataError(f"{item.where}: a continuation of {longest} tokens does not fit the model's "
                                       f"context of {max_seq_len} tokens. Shorten it, or leave the item out."),
                             key, task.about.removeprefix("your file "))
        task.too_long, task.items = len(task.items) - len(kept), kept
        if not kept:
            raise DataError(f"task {task.name!r}: none of its items fits the model's context of {max_seq_len} tokens "
                            f"(all {task.too_long} are longer). Leave the task out of --tasks.")
    return tasks


__all__ = ["ALL_BUILTIN", "check_task_files", "fit_tasks", "resolve_tasks", "spec_key", "task_files", "task_names"]
