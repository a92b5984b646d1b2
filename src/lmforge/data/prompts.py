"""Prompts for reinforcement learning: what `lmforge rl` samples completions for.

A prompt is a chat to continue (the user's turn(s), rendered with the chat template and the
generation prompt) plus the fields a reward reads. Two sources:

- "stdlib": the SFT task (lmforge.data.stdlib_functions: a standard-library function's
  signature and docstring, "write the body"), same split as SFT and pretraining; each record
  carries `module`, `qualname`, `signature` (what the static and doctest rewards read) and
  `reference` (the real body, never shown to the model).
- a JSONL or Parquet file of records {"prompt": text}, {"prompt": [{role, content}, ...]} or
  {"messages": [{role, content}, ...]} (TRL's standard and conversational prompt forms; a list
  of messages ends with the user's turn), with any extra fields, handed to a reward of your own
  as keyword arguments (TRL's convention). The fields lmforge's own rewards read (`READ_FIELDS`:
  signature, module, qualname, reference) are strings where a record has them.

`PromptStream` deals prompt indices as `RowStream` deals rows (a seeded shuffle per epoch, ranks
taking their share of one global order, `state_dict` for exact resume), and says where in that
global order each micro-batch starts, which seeds its sampling: the same prompts get the same
completions whatever the number of ranks.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lmforge.data.conversations import validate_messages
from lmforge.data.packing import RowStream
from lmforge.data.records import check_text, content_key, read_items, short
from lmforge.errors import DataError
from lmforge.fileio import shown_path

#: What a prompt record may look like (for error messages).
PROMPT_FORMS = ('one JSON object per line: {"prompt": "text"}, {"prompt": [{"role": "user", "content": "..."}]} '
                'or {"messages": [{"role": "user", "content": "..."}]}, plus any fields your reward reads')

#: What every reward receives besides a record's fields (TRL's names): a record may not have them.
RESERVED_FIELDS = ("completions", "prompts")

#: The fields lmforge's own rewards and validation read (the static check reads "signature"
#: wherever a prompt has one): a string where a record has them.
READ_FIELDS = ("signature", "module", "qualname", "reference")


@dataclass
class Prompt:
    """One prompt: `messages` (the turns to continue: system/user/assistant, ending with a user
    turn), `where` (file:line, or module:qualname), `key` (what the split is decided on), and
    `fields` (every other field of the record: what a reward reads)."""

    messages: list[dict]
    where: str
    key: str
    fields: dict = field(default_factory=dict)


def prompt_from_record(record: object, where: str) -> Prompt:
    """A prompt from one record (TRL's forms). Raises DataError naming `where` and the field."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {short(record)}; {PROMPT_FORMS}.")
    if "prompt" in record and "messages" in record:
        raise DataError(f"{where}: both \"prompt\" and \"messages\"; give one of them.")
    if "prompt" in record and isinstance(record["prompt"], list):  # TRL's conversational form
        if not record["prompt"]:
            raise DataError(f"{where}: \"prompt\" is an empty list; expected a string, or a list of messages "
                            f"ending with the user's turn ([{{\"role\": \"user\", \"content\": \"...\"}}]).")
        messages = _user_last(validate_messages(record["prompt"], where, require_reply=False), where)
    elif "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise DataError(f"{where}: prompt is {short(record['prompt'])}; expected a string or a list of messages "
                            f"([{{\"role\": \"user\", \"content\": \"...\"}}]). Fix or remove the record.")
        text = check_text(record["prompt"], where, "prompt")
        messages = [{"role": "user", "content": text}]
    elif "messages" in record:
        messages = _user_last(validate_messages(record["messages"], where, require_reply=False), where)
    else:
        raise DataError(f"{where}: no \"prompt\" or \"messages\" field (keys {sorted(record)}); {PROMPT_FORMS}.")
    extra = {k: v for k, v in record.items() if k not in ("prompt", "messages")}
    for name in RESERVED_FIELDS:
        if name in extra:
            raise DataError(f"{where}: a field named \"{name}\": every reward already receives {name}= (TRL's "
                            f"calling convention: completions=, prompts=, then the record's other fields), so it "
                            f"cannot be passed too. Rename the field in the file.")
    for name in READ_FIELDS:
        if name in extra and not isinstance(extra[name], str):
            raise DataError(f"{where}: \"{name}\" is {short(extra[name])}; expected a string (lmforge's rewards read "
                            f"it: {_READ_BY[name]}). Fix the record, or name your field otherwise.")
    try:
        json.dumps(extra)
    except (TypeError, ValueError):
        raise DataError(f"{where}: its extra fields must be plain JSON values (a reward receives them).") from None
    return Prompt(messages, where, content_key([[m["role"], m["content"]] for m in messages]), extra)


def _user_last(messages: Sequence[dict], where: str) -> list[dict]:
    if messages[-1]["role"] != "user":
        raise DataError(f"{where}: the last message is {messages[-1]['role']!r}: a prompt ends with the user's "
                        f"turn (the model writes the next one).")
    return list(messages)


_READ_BY = {"signature": "the static check, and the doctests and behaviour rewards",
            "module": "the static check's names, the doctests and behaviour rewards",
            "qualname": "the doctests and behaviour rewards", "reference": "the behaviour reward"}

_KINDS = ((stat.S_ISFIFO, "a FIFO (a named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def read_prompts(path) -> list[Prompt]:
    """Every prompt of a `.jsonl` or `.parquet` file, validated, in file order (data.records.read_items).

    Raises:
        DataError: `path` is not a regular file (a FIFO is never opened: without a writer that
        would wait forever), or a record is malformed (naming the file and line).
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None  # missing or unreadable: read_items says which
    for test, kind in _KINDS:
        if mode is not None and test(mode):
            raise DataError(f"rl.data = {shown_path(path)!r} is {kind}, not a regular file; expected a .jsonl or "
                            f".parquet file of prompts (or \"stdlib\"). Write the prompts to a file and point "
                            f"rl.data at it.")
    return read_items(path, "rl.data", "prompts", prompt_from_record, PROMPT_FORMS)


def stdlib_prompts(val_fraction: float, max_chars: int, include_tests: bool, max_train: int = 0,
                   keep=None) -> dict[str, list[Prompt]]:
    """The SFT task's functions as prompts, {"train", "val"} (the SFT split); `keep(example)`: the
    functions to keep (the RL stage keeps those whose reference passes the static check)."""
    from lmforge.data.stdlib_functions import stdlib_examples

    examples = stdlib_examples(val_fraction, max_chars=max_chars, max_train=max_train, include_tests=include_tests)
    out: dict[str, list[Prompt]] = {}
    for split, exs in examples.items():
        out[split] = [Prompt([dict(ex.conversation().messages[0])], f"{ex.module}:{ex.qualname}",
                             f"{ex.module}:{ex.qualname}",
                             {"module": ex.module, "qualname": ex.qualname, "signature": ex.signature,
                              "reference": ex.body})
                      for ex in exs if keep is None or keep(ex)]
    return out


@dataclass
class PromptDraw:
    """One micro-batch of prompts: their indices, and where the draw starts in the global order
    (epoch, row): what seeds its sampling."""

    indices: list[int]
    epoch: int
    start: int


class PromptStream(RowStream):
    """An endless, resumable stream of `PromptDraw`s of `micro_batch_size` prompts (module docstring).

    Raises:
        DataError: no prompt.
    """

    def __init__(self, n_prompts: int, micro_batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if n_prompts < 1:
            raise DataError("no prompt to train on: rl.data holds none (after the split and the caps).")
        super().__init__(np.ones(n_prompts, dtype=np.int64), None, None, 1, micro_batch_size, 0, seed,
                         packing=False, document_masking=False, shuffle=True, rank=rank, world_size=world_size)

    def make_batch(self, rows: Sequence) -> list[int]:
        return [int(row[0][0]) for row in rows]

    def next_batch(self) -> PromptDraw:  # type: ignore[override]
        epoch, start = self._ahead(self.rank * self.micro_batch_size)
        return PromptDraw(super().next_batch(), epoch, start)


def split_prompts(prompts: Sequence[Prompt], val_fraction: float) -> dict[str, list[Prompt]]:
    """{"train", "val"} by `sources.split_of(prompt.key, val_fraction)`, order kept."""
    from lmforge.data.sources import split_of

    out: dict[str, list[Prompt]] = {"train": [], "val": []}
    for p in prompts:
        out[split_of(p.key, val_fraction)].append(p)
    return out


__all__ = ["PROMPT_FORMS", "READ_FIELDS", "RESERVED_FIELDS", "Prompt", "PromptDraw", "PromptStream",
           "prompt_from_record", "read_prompts", "split_prompts", "stdlib_prompts"]
