"""The embedded default SFT set: functions of the running interpreter's standard library.

Each function (or method) with a docstring and a body after it is one conversation: the
user turn is `STDLIB_PROMPT` + its signature + its docstring, the assistant turn its body
(dedented so that the `def` starts at column 0). Split by module with the pretraining rule
(`split_of(module, data.val_fraction)`), so a module held out of pretraining is held out of
SFT too. phi-1 (Gunasekar et al. 2023, arXiv 2306.11644) trains the same docstring -> body task.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from lmforge.data.conversations import Conversation, cap_examples
from lmforge.data.inputs import SourceStats
from lmforge.data.sources import iter_documents, split_of

STDLIB_PROMPT = "Write the body of this Python function:\n"


@dataclass(frozen=True)
class FunctionExample:
    """One standard-library function: `signature` (the `def` line(s), ending in ':'),
    `docstring` (its source lines), `body` (the statements after the docstring), all
    dedented so that the `def` starts at column 0."""

    module: str
    qualname: str
    signature: str
    docstring: str
    body: str

    def conversation(self) -> Conversation:
        user = STDLIB_PROMPT + self.signature + "\n" + self.docstring
        messages = ({"role": "user", "content": user}, {"role": "assistant", "content": self.body})
        return Conversation(messages, f"{self.module}:{self.qualname}", self.module)


def place_body(signature: str, body: str) -> str:
    """The function's source with `body` under `signature` (what the parse check parses)."""
    return signature + "\n" + body + "\n"


def _dedent(lines: list[str], col: int) -> list[str] | None:
    out = []
    for line in lines:
        prefix = line[:col]
        if prefix.strip():  # e.g. a continuation line of a string at a lower indent
            return None
        out.append(line[col:])
    return out


def function_examples(source: str, module: str) -> list[FunctionExample]:
    """Functions (and methods) of one module's source with a docstring and a body after it.

    Skipped: one-line definitions, a docstring on the `def` line, text that cannot be
    dedented, and anything whose reference body does not parse under its signature.
    A module that does not parse yields nothing.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    # ast numbers lines at \n, \r\n and \r only (str.splitlines also splits at \f, \x1c, ...)
    lines = source.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    found = []

    def visit(statements: list, prefix: str) -> None:
        # Only statement lists can hold a `def`: walk those, not every expression node.
        for child in statements:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    ex = _example(child, lines, module, qual)
                    if ex is not None:
                        found.append(ex)
                visit(child.body, qual + ".")
                continue
            for name in ("body", "orelse", "finalbody", "handlers", "cases"):
                inner = getattr(child, name, None)
                if isinstance(inner, list):
                    visit(inner, prefix)

    visit(tree.body, "")
    return found


def _example(node, lines: list[str], module: str, qualname: str) -> FunctionExample | None:
    body = node.body
    if len(body) < 2 or ast.get_docstring(node, clean=False) is None:
        return None
    doc = body[0]
    if doc.lineno <= node.lineno or body[1].lineno <= doc.end_lineno:
        return None
    sig = _dedent(lines[node.lineno - 1: doc.lineno - 1], node.col_offset)
    docstring = _dedent(lines[doc.lineno - 1: doc.end_lineno], node.col_offset)
    rest = _dedent(lines[doc.end_lineno: node.end_lineno], node.col_offset)
    if sig is None or docstring is None or rest is None:
        return None
    while rest and not rest[0].strip():
        rest = rest[1:]
    ex = FunctionExample(module, qualname, "\n".join(sig).rstrip(), "\n".join(docstring).rstrip(),
                         "\n".join(rest).rstrip())
    if not ex.body.strip():
        return None
    try:
        ast.parse(place_body(ex.signature, ex.body))
    except (SyntaxError, ValueError):
        return None
    return ex


@dataclass
class StdlibStats:
    modules: int = 0
    functions: int = 0
    too_long: int = 0
    per_module_cap: int = 0
    val_duplicates: int = 0
    source: SourceStats = field(default_factory=SourceStats)


#: At most this many functions of one module in the default set (a module such as tkinter
#: has hundreds of short look-alike methods that would otherwise fill it).
STDLIB_MAX_PER_MODULE = 20


def stdlib_examples(val_fraction: float, max_chars: int = 0, max_train: int = 0, include_tests: bool = False,
                    stats: StdlibStats | None = None, documents: Iterable | None = None,
                    max_per_module: int = STDLIB_MAX_PER_MODULE) -> dict[str, list[FunctionExample]]:
    """The default SFT set, split into {"train": [...], "val": [...]}, deterministic.

    The modules are those pretraining reads (`iter_documents("stdlib", ...)`) and each goes
    to the split `split_of(module, val_fraction)` gives it, the pretraining rule. Examples
    whose prompt + body exceed `max_chars` characters are left out (counted in
    `stats.too_long`), and at most `max_per_module` functions of a module are kept (0 = all;
    chosen by a stable hash of their qualified name; the rest count in `stats.per_module_cap`).
    Every validation module is used. Training modules are parsed in the
    order of a stable hash of their name until `max_train` training examples are found
    (0 = all), so a cap spreads over the whole library and parsing stops early. A
    validation example whose text equals a training one (a function copied between
    modules) is left out of validation (`stats.val_duplicates`).
    `documents` (Document objects) replaces the standard library walk (tests).
    """
    stats = stats if stats is not None else StdlibStats()
    if documents is None:
        documents = iter_documents("stdlib", None, val_fraction, include_tests, "skip", stats.source)
    by_split: dict[str, list] = {"train": [], "val": []}
    for doc in documents:
        by_split[split_of(doc.key, val_fraction)].append(doc)
    by_split["train"].sort(key=lambda d: hashlib.sha256(d.key.encode("utf-8")).digest())
    out: dict[str, list[FunctionExample]] = {"train": [], "val": []}
    for split, docs in by_split.items():
        for doc in docs:
            if split == "train" and max_train and len(out["train"]) >= max_train:
                break
            stats.modules += 1
            kept = []
            for ex in function_examples(doc.text, doc.key):
                stats.functions += 1
                if max_chars and len(STDLIB_PROMPT) + len(ex.signature) + len(ex.docstring) + len(ex.body) > max_chars:
                    stats.too_long += 1
                    continue
                kept.append(ex)
            capped = cap_examples(kept, max_per_module, lambda e: e.qualname)
            stats.per_module_cap += len(kept) - len(capped)
            out[split].extend(capped)
    if max_train:
        out["train"] = out["train"][:max_train]
    seen = {(e.signature, e.docstring, e.body) for e in out["train"]}
    kept = [e for e in out["val"] if (e.signature, e.docstring, e.body) not in seen]
    stats.val_duplicates = len(out["val"]) - len(kept)
    out["val"] = kept
    return out


__all__ = ["FunctionExample", "StdlibStats", "STDLIB_PROMPT", "function_examples", "place_body", "stdlib_examples"]
