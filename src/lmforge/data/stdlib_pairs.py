"""The embedded default preference pairs: standard-library functions and a broken copy.

The prompt is the SFT user turn of a standard-library function (`FunctionExample.conversation`:
`STDLIB_PROMPT` + signature + docstring); the chosen reply is its real body; the rejected
reply is the same body with one small, parseable mutation at one site. Every kind goes
both ways, so that no token's frequency tells the two sides apart:

    compare_eq    `==` <-> `!=`
    compare_lt    `<` <-> `<=`, `>` <-> `>=`
    bool_op       `and` <-> `or`
    bool_const    `True` <-> `False`
    plus_minus_1  `+ 1` <-> `- 1` (binary)
    swap_args     f(a, b) -> f(b, a) (two simple positional arguments that differ)
    not           `not x` -> `x`, and `if x:` -> `if not x:` (a unary `not` dropped or added)

The mutation is made in the source text at one token (the rest of the body keeps its exact
formatting: a re-rendered body would give the pair away), and kept only if the body still
parses under its signature and differs from the original. Lengths differ by at most
`MAX_LENGTH_CHANGE` characters (4: an added or dropped `not `). The kind and direction of
each function's mutation are chosen to keep every (kind, direction) equally frequent over
the set (greedy balance, seeded: a function whose only options would put a direction ahead of its
reverse is skipped and counted), and the site at random among that option's sites.

The split is SFT's: the same functions (`stdlib_examples`), split by module with the
pretraining rule, so held-out modules stay held out of pretraining, SFT and DPO alike.
(The idea of pairs from the standard library: shared/research/LORA-DPO.md, section 5.)
"""

from __future__ import annotations

import ast
import io
import random
import tokenize
from collections import Counter
from dataclasses import dataclass, field

from lmforge.data.stdlib_functions import FunctionExample, StdlibStats, place_body, stdlib_examples

MAX_LENGTH_CHANGE = 4
KINDS = ("compare_eq", "compare_lt", "bool_op", "bool_const", "plus_minus_1", "swap_args", "not")
_SWAPS = {"==": ("compare_eq", "!="), "!=": ("compare_eq", "=="), "<": ("compare_lt", "<="),
          "<=": ("compare_lt", "<"), ">": ("compare_lt", ">="), ">=": ("compare_lt", ">"),
          "and": ("bool_op", "or"), "or": ("bool_op", "and"), "True": ("bool_const", "False"),
          "False": ("bool_const", "True")}

# (kind, direction label, start offset, end offset, replacement) within the body text
Edit = tuple[str, str, int, int, str]


@dataclass
class PairStats:
    """Counts of the default pair set: pairs per split, per kind and direction, and the
    functions without any site (skipped)."""

    pairs: Counter = field(default_factory=Counter)
    kinds: dict[str, Counter] = field(default_factory=lambda: {"train": Counter(), "val": Counter()})
    directions: dict[str, Counter] = field(default_factory=lambda: {"train": Counter(), "val": Counter()})
    no_site: int = 0
    unbalanced: int = 0
    """Functions whose only mutations would have put a direction ahead of its reverse."""
    functions: StdlibStats = field(default_factory=StdlibStats)

    def as_dict(self) -> dict:
        return {"pairs": dict(self.pairs), "kinds": {s: dict(sorted(c.items())) for s, c in self.kinds.items()},
                "directions": {s: {f"{k} {d}": n for (k, d), n in sorted(c.items())} for s, c in self.directions.items()}, "skipped_no_site": self.no_site,
                "skipped_for_balance": self.unbalanced}


def _offsets(text: str) -> list[int]:
    starts, at = [], 0
    for line in text.splitlines(keepends=True):
        starts.append(at)
        at += len(line)
    starts.append(at)
    return starts


def body_edits(example: FunctionExample) -> list[Edit]:
    """Every candidate one-site mutation of the example's body (module docstring)."""
    source = place_body(example.signature, example.body)
    base = len(example.signature) + 1  # the body starts after the signature and its newline
    lines = _offsets(source)

    def at(row: int, col: int) -> int:  # tokenize/ast (1-based row, 0-based col) -> offset in the body
        return lines[row - 1] + col - base

    edits: list[Edit] = []
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
        tree = ast.parse(source)
    except (SyntaxError, tokenize.TokenError, IndentationError, ValueError):
        return []
    significant = [t for t in toks if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT,
                                                        tokenize.INDENT, tokenize.DEDENT)]
    for i, t in enumerate(significant):
        start, end = at(*t.start), at(*t.end)
        if start < 0:
            continue  # in the signature
        prev = significant[i - 1] if i > 0 else None
        nxt = significant[i + 1] if i + 1 < len(significant) else None
        if t.string in _SWAPS and t.type in (tokenize.OP, tokenize.NAME):
            kind, new = _SWAPS[t.string]
            edits.append((kind, f"{t.string}->{new}", start, end, new))
        elif t.type == tokenize.OP and t.string in "+-" and nxt is not None and nxt.string == "1" \
                and nxt.start == (t.end[0], t.end[1] + 1) and prev is not None \
                and (prev.type in (tokenize.NAME, tokenize.NUMBER) or prev.string in ")]") \
                and prev.string not in ("return", "in", "and", "or", "not", "if", "else", "is", "yield", "lambda"):
            new = "-" if t.string == "+" else "+"
            edits.append(("plus_minus_1", f"{t.string} 1->{new} 1", start, end, new))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and len(node.args) == 2 and not node.keywords and all(
                isinstance(a, (ast.Name, ast.Constant)) and not isinstance(getattr(a, "value", None), str)
                for a in node.args):
            a, b = node.args
            sa, ea = at(a.lineno, a.col_offset), at(a.end_lineno, a.end_col_offset)
            sb, eb = at(b.lineno, b.col_offset), at(b.end_lineno, b.end_col_offset)
            if sa < 0 or a.lineno != b.lineno:
                continue
            ta, tb = example.body[sa:ea], example.body[sb:eb]
            if ta != tb:
                edits.append(("swap_args", "swap", sa, eb, tb + example.body[ea:sb] + ta))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            s = at(node.lineno, node.col_offset)
            if s >= 0 and example.body[s: s + 4] == "not ":
                edits.append(("not", "drop", s, s + 4, ""))
        elif isinstance(node, (ast.If, ast.While)) and not (isinstance(node.test, ast.UnaryOp)
                                                             and isinstance(node.test.op, ast.Not)):
            s = at(node.test.lineno, node.test.col_offset)
            if s >= 0 and not isinstance(node.test, (ast.BoolOp, ast.NamedExpr, ast.IfExp, ast.Lambda)):
                edits.append(("not", "add", s, s, "not "))
    return edits


def apply_edit(example: FunctionExample, edit: Edit) -> str | None:
    """The mutated body, or None when it does not parse under the signature or equals the original."""
    _, _, start, end, new = edit
    body = example.body[:start] + new + example.body[end:]
    if body == example.body or abs(len(body) - len(example.body)) > MAX_LENGTH_CHANGE:
        return None
    try:
        if ast.dump(ast.parse(place_body(example.signature, body))) == \
                ast.dump(ast.parse(place_body(example.signature, example.body))):
            return None
    except (SyntaxError, ValueError):
        return None
    return body


def reverse(direction: str) -> str:
    """The opposite direction of a mutation ("== -> !=" <-> "!= -> =="; add <-> drop; a swap is its own)."""
    if direction in ("add", "drop"):
        return "drop" if direction == "add" else "add"
    if "->" in direction:
        a, b = direction.split("->")
        return f"{b}->{a}"
    return direction


def mutate(examples: list[FunctionExample], seed: int, stats: PairStats, split: str, per_function: int = 1
           ) -> list[dict]:
    """Pair records of the examples that have a site (module docstring), balanced over (kind,
    direction), in the examples' order: up to `per_function` pairs per example, each another
    mutation of it (held-out sets take several, to have more pairs to score)."""
    rng = random.Random(f"{seed}:{split}")
    order = list(range(len(examples)))
    rng.shuffle(order)
    chosen: dict[int, list[tuple[tuple[str, str], str]]] = {}
    dirs = stats.directions[split]
    options: dict[int, dict[tuple[str, str], list[str]]] = {}
    for i in order:
        ex = examples[i]
        found: dict[tuple[str, str], list[str]] = {}
        for edit in body_edits(ex):
            body = apply_edit(ex, edit)
            if body is not None and body not in found.get((edit[0], edit[1]), []):
                found.setdefault((edit[0], edit[1]), []).append(body)
        if found:
            options[i] = found
        else:
            stats.no_site += 1
    # passes over the functions: one pair each per pass, so that a later function's mutation
    # can balance an earlier one's in the next pass
    for _ in range(per_function):
        for i in order:
            if i not in options:
                continue
            picked = chosen.setdefault(i, [])
            used = set(picked)
            candidates = [(k, b) for k, bodies in options[i].items() for b in bodies if (k, b) not in used]
            # a direction may not get ahead of its reverse (symmetry); among the rest, the rarest
            # option so far (kind first, then direction), ties broken at random
            allowed = [(k, b) for k, b in candidates if dirs[k] <= dirs[(k[0], reverse(k[1]))]]
            if not allowed:
                continue
            (kind, direction), body = min(allowed, key=lambda kb: (stats.kinds[split][kb[0][0]], dirs[kb[0]],
                                                                   rng.random()))
            stats.kinds[split][kind] += 1
            dirs[(kind, direction)] += 1
            picked.append(((kind, direction), body))
    stats.unbalanced += sum(1 for i in options if not chosen.get(i))
    records = []
    for i, ex in enumerate(examples):
        conv = ex.conversation()
        for (kind, _), body in chosen.get(i, ()):
            records.append({"prompt": [dict(conv.messages[0])], "chosen": [dict(conv.messages[1])],
                            "rejected": [{"role": "assistant", "content": body}], "mutation": kind,
                            "name": f"{ex.module}:{ex.qualname}"})
    stats.pairs[split] = len(records)
    return records


def stdlib_preference_pairs(val_fraction: float, seed: int = 0, max_train: int = 0, max_chars: int = 0,
                            include_tests: bool = False, stats: PairStats | None = None,
                            documents=None) -> dict[str, list[dict]]:
    """The default preference set, {"train": [...], "val": [...]}, as explicit conversational
    records `{"prompt": [user], "chosen": [assistant], "rejected": [assistant], "mutation": kind,
    "name": "module:qualname"}` (`lmforge.data.preferences.pair_from_record` reads them).
    One pair per training function; a held-out function gives up to 8 (other sites or kinds,
    balance permitting).
    Deterministic for `seed`; the functions and split are `stdlib_examples(val_fraction,
    max_chars, max_train, include_tests)`'s, SFT's. `documents` replaces the library (tests)."""
    stats = stats if stats is not None else PairStats()
    functions = stdlib_examples(val_fraction, max_chars, max_train, include_tests, stats.functions, documents)
    return {split: mutate(exs, seed, stats, split, per_function=1 if split == "train" else 8)
            for split, exs in functions.items()}


__all__ = ["stdlib_preference_pairs", "body_edits", "apply_edit", "mutate", "PairStats", "KINDS",
           "MAX_LENGTH_CHANGE"]
