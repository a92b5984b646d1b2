"""The built-in tasks: Python the model has not seen, from the embedded corpus's held-out modules.

Every item comes from standard-library modules pretraining never read: those its split holds
out (`split_of(module, data.val_fraction)` is "val", the checkpoint's own split) and, when the
checkpoint was trained without them (`data.include_tests = false`, the default), the test
modules (`test/`, `tests/` folders: about 900 of them, so a task has thousands of items to draw
from without moving a single module out of pretraining). Modules are read in a stable hashed
order until a task has enough items; SFT's per-module cap is not applied. Deterministic for a
seed: the distractors and the gold option's position are drawn from (seed, item).

    mutants     the real body of a function against a one-site mutant of it (the DPO pairs'
                mutations: == / !=, < / <=, and / or, True / False, + 1 / - 1, swapped
                arguments, a `not` added or dropped) of the same token count (no length cue),
                directions balanced; context: signature and docstring. 2 choices (see
                `mutants`: with three mutants an untrained model scores 1/8, not 1/4).
    docstrings  which of four docstrings (the real one and three of other held-out functions)
                belongs to a body: each option is the docstring followed by the body, after the
                signature. 4 choices.
    next_line   the next line of a module among four lines of the same module, after the eight
                lines before it. 4 choices.
    identifier  the final identifier of a line, predicted greedily (every token the argmax),
                after the eight lines before it and the line's start; only identifiers that
                appear in those lines (a name the context makes predictable). Baseline 0.
"""

from __future__ import annotations

import hashlib
import keyword
import random
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import PurePath

from lmforge.data.conversations import cap_examples
from lmforge.data.sources import Document, iter_documents, split_of
from lmforge.data.stdlib_functions import FunctionExample, function_examples
from lmforge.data.stdlib_pairs import apply_edit, body_edits, reverse
from lmforge.evals.tasks import Choice, Continuation, Task

#: The built-in tasks, in the order a suite reports them.
BUILTIN_TASKS = ("mutants", "docstrings", "next_line", "identifier")
#: Items per task by default (the Wilson interval at 300 items is about +-5.5 points at 50%).
DEFAULT_LIMIT = 300
#: Lines of context before a line (next_line, identifier), and the prompt + body cap (characters).
CONTEXT_LINES = 8
MAX_CHARS = 1500
#: Items a module gives at most (next_line, identifier), so that a task spreads over modules.
PER_MODULE = 8
#: Mutant pairs a function gives at most (each another site).
PAIRS_PER_FUNCTION = 4
_MIN_LINE = 8
ABOUT = {"mutants": "the real body against a one-site mutant (balanced directions)", "docstrings": "which of 4 docstrings fits the body",
         "next_line": "the next line among 4 of the module", "identifier": "a line's final identifier, greedy"}
_TAIL = re.compile(r"^(.*[^A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]{2,})$")


def _rng(seed: int, key: str) -> random.Random:
    return random.Random(f"{seed}:{key}")


def _place(choices: list[str], gold_text: str, rng: random.Random) -> tuple[tuple[str, ...], int]:
    gold = rng.randrange(len(choices) + 1)
    return tuple(choices[:gold] + [gold_text] + choices[gold:]), gold


def mutants(functions: list[FunctionExample], seed: int, count=None) -> list[Choice]:
    """The real body against a one-site mutant of it, as pairs (up to PAIRS_PER_FUNCTION per
    function, each another site). `count(text)`: token count; when given, only mutants as long
    as the real body in tokens are kept, so that the mean-loss and summed log-probability rules
    agree (neither rewards a shorter or longer option).

    Why pairs and not the real body among three mutants: each mutant differs from the real body
    at one site, so a model that only has an arbitrary preference at each site (an untrained
    one) picks the real body when all three sites favour it, 1/8 of the time, not 1/4 —
    random weights scored 12-17% against a 25% baseline. With two options the roles are
    symmetric. And directions are balanced over the task as the DPO pairs balance them
    (`stdlib_pairs.mutate`): a direction (`==` -> `!=`) may not get ahead of its reverse, so a
    model that merely prefers one token of a pair wins as often as it loses (real code holds
    far more `==` than `!=`). Functions are visited in a seeded order."""
    rng = random.Random(f"{seed}:mutants")
    order = list(range(len(functions)))
    rng.shuffle(order)
    dirs: Counter = Counter()
    made: dict[int, list[Choice]] = {}
    for i in order:
        ex = functions[i]
        key = f"{ex.module}:{ex.qualname}"
        length = count(ex.body) if count else None
        options, seen = [], {ex.body}
        for edit in body_edits(ex):
            b = apply_edit(ex, edit)
            if b is not None and b not in seen and (length is None or count(b) == length):
                seen.add(b)
                options.append(((edit[0], edit[1]), b, edit[2]))
        item_rng = _rng(seed, key)
        item_rng.shuffle(options)
        for kd, b, at in options:
            back = (kd[0], reverse(kd[1]))
            if back != kd and dirs[kd] > dirs[back]:
                continue  # never more than one ahead of its reverse
            dirs[kd] += 1
            choices, gold = _place([b], ex.body, item_rng)
            made.setdefault(i, []).append(Choice(ex.signature + "\n" + ex.docstring + "\n", choices, gold,
                                                 f"{key}@{at}"))
            if len(made[i]) == PAIRS_PER_FUNCTION:
                break
    return [x for i in sorted(made) for x in made[i]]


def docstrings(functions: list[FunctionExample], seed: int) -> list[Choice]:
    out = []
    docs = sorted({ex.docstring for ex in functions})
    for ex in functions:
        key = f"{ex.module}:{ex.qualname}"
        others = [d for d in docs if d != ex.docstring]
        if len(others) < 3:
            continue
        rng = _rng(seed, key)
        picked = rng.sample(others, 3)
        choices, gold = _place([d + "\n" + ex.body for d in picked], ex.docstring + "\n" + ex.body, rng)
        out.append(Choice(ex.signature + "\n", choices, gold, key))
    return out


def _lines(documents: Iterable[Document]):
    for doc in documents:
        yield doc.key, doc.text.replace("\r\n", "\n").split("\n")


def next_line(documents: list[Document], seed: int, enough: int = 0) -> list[Choice]:
    out: list[Choice] = []
    for key, lines in _lines(documents):
        if enough and len(out) >= enough:
            break
        eligible = sorted({ln for ln in lines if len(ln.strip()) >= _MIN_LINE})
        found: list[Choice] = []
        for i in range(CONTEXT_LINES, len(lines)):
            line = lines[i]
            if len(line.strip()) < _MIN_LINE:
                continue
            where = f"{key}:{i + 1}"
            rng = _rng(seed, where)
            others = [x for x in rng.sample(eligible, min(len(eligible), 8)) if x != line][:3]
            if len(others) < 3:
                continue
            context = "\n".join(lines[i - CONTEXT_LINES:i]) + "\n"
            choices, gold = _place(others, line, rng)
            found.append(Choice(context, choices, gold, where))
        out += cap_examples(found, PER_MODULE, lambda x: x.where)
    return out


def identifier(documents: list[Document], seed: int, enough: int = 0) -> list[Continuation]:
    out: list[Continuation] = []
    for key, lines in _lines(documents):
        if enough and len(out) >= enough:
            break
        found: list[Continuation] = []
        for i in range(CONTEXT_LINES, len(lines)):
            m = _TAIL.match(lines[i].rstrip())
            if m is None or keyword.iskeyword(m.group(2)) or not m.group(1).strip():
                continue
            before = "\n".join(lines[i - CONTEXT_LINES:i]) + "\n"
            if not re.search(rf"\b{re.escape(m.group(2))}\b", before):
                continue
            found.append(Continuation(before + m.group(1), m.group(2), f"{key}:{i + 1}"))
        out += cap_examples(found, PER_MODULE, lambda x: x.where)
    return out


def held_out_documents(val_fraction: float, include_tests: bool) -> list[Document]:
    """The standard library's modules a checkpoint with this split never trained on (module
    docstring), in a stable hashed order."""
    docs = []
    for doc in iter_documents("stdlib", None, val_fraction, include_tests=True):
        is_test = bool({"test", "tests"} & set(PurePath(doc.name).parts[:-1]))
        if split_of(doc.key, val_fraction) == "val" or (is_test and not include_tests):
            docs.append(doc)
    return sorted(docs, key=lambda d: hashlib.sha256(d.key.encode()).digest())


def _functions(documents: list[Document], enough: int) -> list[FunctionExample]:
    out: list[FunctionExample] = []
    for doc in documents:
        if enough and len(out) >= enough:
            break
        out += [ex for ex in function_examples(doc.text, doc.key)
                if len(ex.signature) + len(ex.docstring) + len(ex.body) <= MAX_CHARS]
    return out


def builtin_tasks(names: Iterable[str], val_fraction: float, include_tests: bool = False, seed: int = 0,
                  limit: int = DEFAULT_LIMIT, documents: list[Document] | None = None, tok=None) -> list[Task]:
    """The built-in tasks `names` (BUILTIN_TASKS) on the modules a checkpoint with this split
    never read (`held_out_documents`; `documents` replaces them, tests), at most `limit` items
    each (0: all; chosen by a stable hash of where the item comes from). `tok`: the model's
    tokenizer (mutants keep the real body's token count)."""
    names = list(names)
    if documents is None:
        documents = held_out_documents(val_fraction, include_tests)
    enough = 4 * limit
    functions = _functions(documents, 3 * enough) if {"mutants", "docstrings"} & set(names) else []
    count = (lambda text: len(tok.encode(text))) if tok is not None else None
    makers = {"mutants": lambda: mutants(functions, seed, count), "docstrings": lambda: docstrings(functions, seed),
              "next_line": lambda: next_line(documents, seed, enough),
              "identifier": lambda: identifier(documents, seed, enough)}
    tasks = []
    for name in names:
        items = makers[name]()
        tasks.append(Task(name, cap_examples(items, limit, lambda x: x.where), ABOUT[name]))
    return tasks


__all__ = ["ABOUT", "BUILTIN_TASKS", "CONTEXT_LINES", "DEFAULT_LIMIT", "builtin_tasks", "held_out_documents"]
