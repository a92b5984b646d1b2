"""Reports on a tokenizer: how well its vocabulary compresses the user's text.

`tokenizer_report(tok, texts_by_split)` (written as `report.json` beside tokenizer.json by
`train-tokenizer` and `import-tokenizer`, and printed):

- `bytes_per_token` per split: UTF-8 bytes / tokens of the documents (each encoded whole,
  no special tokens), on up to `SAMPLE_BYTES` of each split;
- `bytes_per_token_by_kind`: the same per kind of line, each line (with its newline)
  encoded on its own, on the held-out sample (the training one when there is none):
      whitespace  a line of whitespace only (blank lines, whitespace runs)
      non_ascii   a line with a character outside ASCII (other scripts, symbols)
      prose       a line whose non-space characters are at least 70% letters and that has
                  at least 3 words (comments, docstrings, text)
      code        every other line;
- `tokens_unused` and `tokens_rare` (used once or twice) on the samples, with examples;
- `longest_tokens`: the 10 longest by UTF-8 bytes; `special_tokens`: name -> id and text;
- `reference`: the same bytes per token under GPT-2's encoding (tiktoken), where it can be
  loaded without a network (its files cached); otherwise `available: false` and why.
Higher bytes per token is better compression (fewer tokens for the same text).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from lmforge.errors import LmforgeError, require_package

SAMPLE_BYTES = 2_000_000
KINDS = ("code", "prose", "whitespace", "non_ascii")
_WORD = re.compile(r"[A-Za-z]+")


def line_kind(line: str) -> str:
    """The kind of one line (module docstring)."""
    if not line.strip():
        return "whitespace"
    if not line.isascii():
        return "non_ascii"
    text = line.strip()
    letters = sum(c.isalpha() for c in text)
    non_space = sum(not c.isspace() for c in text)
    if non_space and letters / non_space >= 0.7 and len(_WORD.findall(text)) >= 3:
        return "prose"
    return "code"


def sample(texts: Iterable[str], limit: int = SAMPLE_BYTES) -> list[str]:
    out, used = [], 0
    for t in texts:
        out.append(t)
        used += len(t.encode("utf-8"))
        if used >= limit:
            break
    return out


def _reference():
    """GPT-2's encoding through tiktoken if it loads offline, else (None, why)."""
    try:
        tiktoken = require_package("tiktoken", None, "the tokenizer report's GPT-2 reference")
    except LmforgeError:
        return None, "tiktoken is not installed"
    try:
        import os

        if not os.environ.get("TIKTOKEN_CACHE_DIR") and not os.environ.get("DATA_GYM_CACHE_DIR"):
            import tempfile

            cache = os.path.join(tempfile.gettempdir(), "data-gym-cache")
            if not os.path.isdir(cache) or not os.listdir(cache):
                return None, "GPT-2's encoding is not cached here and lmforge never downloads at run time"
        return tiktoken.get_encoding("gpt2"), ""
    except Exception as exc:  # tiktoken raises network and file errors of several kinds
        return None, f"GPT-2's encoding could not be loaded ({type(exc).__name__})"


def tokenizer_report(tok, texts_by_split: dict[str, list[str]]) -> dict:
    """The report of the module docstring; `texts_by_split` ({"train": [...], "val": [...]},
    either may be empty) are the documents to measure on."""
    hf = tok.hf
    counts: Counter = Counter()
    report: dict = {"vocab_size": tok.vocab_size, "bytes_per_token": {}, "sample_bytes": {}}
    ref, why = _reference()
    ref_bpt = {}
    for split, texts in texts_by_split.items():
        if not texts:
            continue
        encs = hf.encode_batch(texts, add_special_tokens=False)
        n_tokens = sum(len(e.ids) for e in encs)
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        for e in encs:
            counts.update(e.ids)
        report["bytes_per_token"][split] = round(n_bytes / max(n_tokens, 1), 4)
        report["sample_bytes"][split] = n_bytes
        if ref is not None:
            ref_tokens = sum(len(ref.encode_ordinary(t)) for t in texts)
            ref_bpt[split] = round(n_bytes / max(ref_tokens, 1), 4)
    kind_texts = texts_by_split.get("val") or texts_by_split.get("train") or []
    by_kind = {k: [0, 0] for k in KINDS}  # bytes, tokens
    lines = [line for t in kind_texts for line in t.splitlines(keepends=True)]
    if lines:
        for line, enc in zip(lines, hf.encode_batch(lines, add_special_tokens=False)):
            k = line_kind(line)
            by_kind[k][0] += len(line.encode("utf-8"))
            by_kind[k][1] += len(enc.ids)
    report["bytes_per_token_by_kind"] = {k: (round(b / t, 4) if t else None) for k, (b, t) in by_kind.items()}
    report["bytes_by_kind"] = {k: b for k, (b, _) in by_kind.items()}
    specials = set(tok.contract.special_tokens.values())
    ordinary = [i for i in range(tok.vocab_size) if i not in specials]
    if counts:
        unused = [i for i in ordinary if counts[i] == 0]
        rare = [i for i in ordinary if 0 < counts[i] <= 2]
        report["tokens_unused"] = len(unused)
        report["tokens_rare"] = len(rare)
        report["tokens_unused_examples"] = [hf.decode([i]) for i in unused[:10]]
        report["tokens_rare_examples"] = [hf.decode([i]) for i in rare[:10]]
    pieces = [(len(hf.decode([i]).encode("utf-8")), i) for i in ordinary]
    report["longest_tokens"] = [{"id": i, "text": hf.decode([i]), "bytes": n} for n, i in sorted(pieces, reverse=True)[:10]]
    report["special_tokens"] = {name: {"id": i, "text": tok.spellings.get(name)}
                                for name, i in tok.contract.special_tokens.items()}
    report["reference"] = ({"encoding": "gpt2 (tiktoken)", "available": True, "bytes_per_token": ref_bpt}
                           if ref is not None else {"encoding": "gpt2 (tiktoken)", "available": False, "why": why})
    return report


def report_lines(report: dict) -> str:
    bpt = ", ".join(f"{s} {v:.2f}" for s, v in report["bytes_per_token"].items()) or "no text"
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in report["bytes_per_token_by_kind"].items() if v is not None)
    lines = [f"tokenizer report: bytes per token {bpt}; by kind of line: {kinds}"]
    if "tokens_unused" in report:
        lines.append(f"tokenizer report: {report['tokens_unused']:,} of {report['vocab_size']:,} tokens unused and "
                     f"{report['tokens_rare']:,} used once or twice on the sample; longest: "
                     + ", ".join(repr(t["text"]) for t in report["longest_tokens"][:3]))
    ref = report["reference"]
    lines.append("tokenizer report: GPT-2's encoding: " + (
        ", ".join(f"{s} {v:.2f} bytes/token" for s, v in ref["bytes_per_token"].items()) if ref["available"]
        else f"not available ({ref['why']})"))
    return "\n".join(lines)


__all__ = ["tokenizer_report", "report_lines", "line_kind", "sample", "KINDS", "SAMPLE_BYTES"]

# the data report (prepare): lmforge.data.data_report
from lmforge.data.data_report import DataReport, data_report_lines  # noqa: E402

__all__ += ["DataReport", "data_report_lines"]
