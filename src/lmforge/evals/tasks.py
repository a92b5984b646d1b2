"""A task's items, and the user's own tasks in one plain format.

Two kinds of item, the two request types of lm-evaluation-harness:

- `Choice`: a `query` (the context) and its `choices` (continuations), one of which (`gold`, an
  index from 0) is right; scored by the continuations' log-likelihoods (`evals.metrics`);
- `Continuation`: a `context` and the `continuation` that must follow, every token of it the
  model's greedy choice (LAMBADA's rule); the random baseline is 0.

A file of your own (`--tasks FILE.jsonl`, or .parquet) holds one item a line, either
{"query": str, "choices": [str, ...], "gold": int} or {"context": str, "continuation": str};
every line of one file is the same kind. Export a benchmark you have (HellaSwag, ARC, PIQA...)
once to this form and evaluate any checkpoint on it. A query's separator is yours to write
(usually the continuation starts with a space: " Paris"), exactly as the harness takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmforge.data.records import read_items, short
from lmforge.errors import DataError

#: The keys of each form of item (TASK_FORMS); a record with keys of both is refused.
CHOICE_KEYS = ("query", "choices", "gold")
CONTINUATION_KEYS = ("context", "continuation")
TASK_FORMS = ('one JSON object per line: {"query": "...", "choices": ["...", "..."], "gold": 0} (multiple choice) '
              'or {"context": "...", "continuation": "..."} (the continuation predicted greedily)')


@dataclass(frozen=True)
class Choice:
    query: str
    choices: tuple[str, ...]
    gold: int
    where: str = ""


@dataclass(frozen=True)
class Continuation:
    context: str
    continuation: str
    where: str = ""


@dataclass
class Task:
    """A named list of items of one kind, and what it measures (one line)."""

    name: str
    items: list
    about: str = ""
    too_long: int = 0  # items left out: a continuation longer than the model's context (built-in tasks)

    def requests(self, item) -> list[tuple[str, str]]:
        """The (context, continuation) requests of one item."""
        if isinstance(item, Choice):
            return [(item.query, c) for c in item.choices]
        return [(item.context, item.continuation)]

    @property
    def kind(self) -> str:
        return "choice" if self.items and isinstance(self.items[0], Choice) else "continuation"

    @property
    def baseline(self) -> float:
        """The expected accuracy of a random guess: the mean of 1/len(choices); 0 for continuations."""
        if self.kind != "choice":
            return 0.0
        return sum(1.0 / len(x.choices) for x in self.items) / len(self.items)


def _text(record: dict, key: str, where: str, empty_ok: bool = False) -> str:
    v = record[key]
    if not isinstance(v, str) or (not v and not empty_ok):
        raise DataError(f"{where}: \"{key}\" is {short(v)}: expected a{'' if empty_ok else ' non-empty'} string.")
    return v


def item_from_record(record: object, where: str) -> Choice | Continuation:
    """One item from one record (TASK_FORMS). Raises DataError naming `where` and the field."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {short(record)}; {TASK_FORMS}.")
    choice_keys = [k for k in CHOICE_KEYS if k in record]
    continuation_keys = [k for k in CONTINUATION_KEYS if k in record]
    if choice_keys and continuation_keys:  # neither form may win: the item would be scored as one it may not be
        mc, cont = ", ".join(map(repr, choice_keys)), ", ".join(map(repr, continuation_keys))
        raise DataError(f"{where}: the item holds keys of both forms, multiple choice ({mc}) and continuation "
                        f"({cont}); an item is one of them: {TASK_FORMS}. Remove the other form's keys.")
    if choice_keys:
        missing = [k for k in ("query", "choices", "gold") if k not in record]
        if missing:
            raise DataError(f"{where}: a multiple-choice item needs \"query\", \"choices\" and \"gold\"; "
                            f"{', '.join(repr(m) for m in missing)} missing (keys {sorted(record)}).")
        query = _text(record, "query", where, empty_ok=True)
        choices = record["choices"]
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise DataError(f"{where}: \"choices\" is {short(choices)}: expected a list of at least 2 non-empty "
                            f"strings.")
        if len(set(choices)) != len(choices):
            raise DataError(f"{where}: \"choices\" repeats an option ({short(choices)}); each must differ.")
        gold = record["gold"]
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
            raise DataError(f"{where}: \"gold\" is {short(gold)}: expected the index of the right choice, an integer "
                            f"from 0 to {len(choices) - 1}.")
        return Choice(query, tuple(choices), gold, where)
    if continuation_keys:
        missing = [k for k in ("context", "continuation") if k not in record]
        if missing:
            raise DataError(f"{where}: a continuation item needs \"context\" and \"continuation\"; "
                            f"{missing[0]!r} missing (keys {sorted(record)}).")
        return Continuation(_text(record, "context", where, empty_ok=True), _text(record, "continuation", where),
                            where)
    raise DataError(f"{where}: neither a multiple-choice nor a continuation item (keys {sorted(record)}); "
                    f"{TASK_FORMS}.")


def read_task_file(path: str | Path, key: str = "--tasks") -> Task:
    """A task from a .jsonl / .parquet file (named after the file's stem); `key` is what named the
    file ("--tasks", "train.eval_tasks"), for the errors.

    Raises:
        DataError: a missing or empty file, a malformed item (file and line), or items of both kinds.
    """
    path = Path(path)
    items = read_items(path, key, "task items", item_from_record, TASK_FORMS)
    kinds = {type(x) for x in items}
    if len(kinds) > 1:
        first = next(x for x in items if type(x) is not type(items[0]))
        raise DataError(f"{first.where}: a {type(first).__name__.lower()} item in a file whose first item "
                        f"({items[0].where}) is a {type(items[0]).__name__.lower()}: one kind per file. Split it.")
    return Task(path.stem, items, f"your file {path}")


__all__ = ["Choice", "Continuation", "TASK_FORMS", "Task", "item_from_record", "read_task_file"]
