"""Fast pretokenizing: the same byte-level BPE run by `tiktoken` (optional dependency).

lmforge's tokenizer is one HF `tokenizer.json`: Qwen2's split regex, then byte-level
BPE with merges in rank order. `tiktoken` runs exactly that algorithm (split with the
regex, then merge the adjacent pair whose concatenation has the lowest rank) several
times faster than HF `tokenizers`' `encode_batch`, which also builds offsets and
alignments the data path never reads. This module builds a `tiktoken.Encoding` from the
tokenizer file:

- ranks: every vocab token in byte form (the ByteLevel byte-to-unicode mapping undone),
  ranked by its id. That is HF's merge priority only when the i-th merge produces a
  token whose id grows with i and every non-byte token comes from exactly one merge,
  which is how HF's BPE trainer numbers a vocabulary; `tiktoken_encoding` checks it and
  refuses any other tokenizer (`FastEncodeUnsupported`), as it refuses another
  pre-tokenizer, a normalizer, BPE dropout, byte fallback or non-special added tokens.
- the split regex: the tokenizer's own, which must be `lmforge.tokenizer.SPLIT_PATTERN`.
- special tokens are NOT recognized: on the data path text that spells one is plain text
  (`encode_special_tokens = True`), and `encode_ordinary` does the same.

`tests/test_fast_encode.py` proves the ids equal HF `tokenizers`' on the standard
library. `batch_encoder(tokenizer)` returns this encoder, or the tokenizer's own
`encode_batch` when tiktoken is missing or the tokenizer is not one it can reproduce.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lmforge.errors import LmforgeError, require_package
from lmforge.tokenizer import SPLIT_PATTERN, TOKENIZER_FILE, byte_decoder

BatchEncoder = Callable[[Sequence[str]], list[list[int]]]


class FastEncodeUnsupported(LmforgeError):
    """The tokenizer is not one tiktoken reproduces exactly (or tiktoken is missing)."""


def token_bytes(token: str, where: str) -> bytes:
    """A ByteLevel vocab string (e.g. 'Ġself') -> its bytes (b' self')."""
    table = byte_decoder()
    try:
        return bytes(table[ch] for ch in token)
    except KeyError as exc:
        raise FastEncodeUnsupported(
            f"{where}: vocab token {token!r} has the character {exc.args[0]!r}, which is not in the "
            f"ByteLevel alphabet; only byte-level BPE can be run by tiktoken."
        ) from None


def _check_structure(spec: dict, where: str) -> None:
    def refuse(what: str, seen, expected) -> None:
        raise FastEncodeUnsupported(
            f"{where}: {what} is {seen!r}, expected {expected!r} (lmforge's byte-level BPE). "
            f"Encode with HF tokenizers instead (batch_encoder falls back to it)."
        )

    if spec.get("normalizer") is not None:
        refuse("normalizer", spec["normalizer"], None)
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(parts) != 2 or parts[0].get("type") != "Split" or parts[1].get("type") != "ByteLevel":
        refuse("pre_tokenizer", [p.get("type") for p in parts], ["Split", "ByteLevel"])
    split, byte_level = parts
    if (split.get("pattern") or {}).get("Regex") != SPLIT_PATTERN:
        refuse("the Split pattern", (split.get("pattern") or {}).get("Regex"), SPLIT_PATTERN)
    if split.get("behavior") != "Isolated" or split.get("invert"):
        refuse("the Split behaviour", (split.get("behavior"), split.get("invert")), ("Isolated", False))
    if byte_level.get("use_regex") or byte_level.get("add_prefix_space"):
        refuse("ByteLevel (use_regex, add_prefix_space)",
               (byte_level.get("use_regex"), byte_level.get("add_prefix_space")), (False, False))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        refuse("model.type", model.get("type"), "BPE")
    for key, expected in (("dropout", None), ("byte_fallback", False), ("ignore_merges", False),
                          ("continuing_subword_prefix", None), ("end_of_word_suffix", None)):
        value = model.get(key, expected)
        if value not in (expected, ""):
            refuse(f"model.{key}", value, expected)
    for added in spec.get("added_tokens", []):
        if not added.get("special"):
            refuse(f"added token {added.get('content')!r} (special)", added.get("special"), True)


def mergeable_ranks(spec: dict, where: str = TOKENIZER_FILE) -> dict[bytes, int]:
    """tiktoken ranks (token bytes -> id) for a parsed lmforge tokenizer.json.

    Raises:
        FastEncodeUnsupported: another structure, or ids that are not in merge order.
    """
    _check_structure(spec, where)
    model = spec["model"]
    vocab: dict[str, int] = model["vocab"]
    specials = {t["id"] for t in spec.get("added_tokens", [])}
    ranks: dict[bytes, int] = {}
    for tok, i in vocab.items():
        if i in specials:
            continue
        ranks[token_bytes(tok, where)] = i
    singles = {b for b in ranks if len(b) == 1}
    if len(singles) != 256:
        raise FastEncodeUnsupported(f"{where}: the vocab has {len(singles)} single-byte tokens, expected all 256.")
    merged_ids = []
    produced: set[bytes] = set()
    for m in model["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        ab = token_bytes(a + b, where)
        if ab not in ranks:
            raise FastEncodeUnsupported(f"{where}: merge {a!r} + {b!r} makes {a + b!r}, which is not in the vocab.")
        if ab in produced:
            raise FastEncodeUnsupported(
                f"{where}: two merges make {a + b!r}; tiktoken ranks tokens, not pairs, so it cannot "
                f"reproduce this tokenizer exactly."
            )
        produced.add(ab)
        ia, ib, iab = vocab[a], vocab[b], ranks[ab]
        if not (iab > ia and iab > ib) or (merged_ids and iab <= merged_ids[-1]):
            raise FastEncodeUnsupported(
                f"{where}: merge {len(merged_ids)} ({a!r} + {b!r}) makes id {iab}, not above the previous "
                f"merge's id {merged_ids[-1] if merged_ids else '-'} and its parts' ids ({ia}, {ib}); "
                f"tiktoken needs ids in merge order."
            )
        merged_ids.append(iab)
    unreachable = len(ranks) - len(singles) - len(produced)
    if unreachable:
        extra = next(t for t in ranks if len(t) > 1 and t not in produced)
        raise FastEncodeUnsupported(
            f"{where}: {unreachable} vocab token(s) (e.g. {extra!r}) come from no merge; tiktoken would "
            f"produce them where HF does not."
        )
    return ranks


def tiktoken_encoding(tokenizer_json: str | Path | dict, name: str = "lmforge"):
    """A `tiktoken.Encoding` that encodes like the HF tokenizer.json on the data path.

    Args:
        tokenizer_json: the path of a tokenizer.json (or a tokenizer folder), or its parsed dict.
    Returns:
        tiktoken.Encoding with no special tokens; use `encode_ordinary(text) -> list[int]`.
    Raises:
        FastEncodeUnsupported: tiktoken is not installed, or the tokenizer is not lmforge's
            byte-level BPE in merge order (see `mergeable_ranks`).
    """
    tiktoken = require_package("tiktoken", None, "faster pretokenizing", FastEncodeUnsupported)
    where = "tokenizer.json"
    if not isinstance(tokenizer_json, dict):
        path = Path(tokenizer_json)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        where = str(path)
        tokenizer_json = json.loads(path.read_text(encoding="utf-8"))
    ranks = mergeable_ranks(tokenizer_json, where)
    return tiktoken.Encoding(name, pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={})


class FastEncoder:
    """`encoder(texts) -> list of id lists`, like `Tokenizer.encode_batch`, with tiktoken on
    `threads` threads (tiktoken releases the GIL). Text that is not valid Unicode (lone
    surrogates) goes through `fallback`, so errors are the same as HF's."""

    def __init__(self, encoding, fallback: BatchEncoder | None = None, threads: int | None = None):
        self.encoding = encoding
        self.fallback = fallback
        self.threads = threads or cores()
        self._pool: ThreadPoolExecutor | None = None

    def _one(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            if self.fallback is None:
                raise
            return self.fallback([text])[0]
        return self.encoding.encode_ordinary(text)

    def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        if self.threads <= 1 or len(texts) <= 1:
            return [self._one(t) for t in texts]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="lmforge-encode")
        return list(self._pool.map(self._one, texts))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def batch_encoder(tokenizer, threads: int | None = None) -> BatchEncoder:
    """The fastest exact batch encoder for a `lmforge.tokenizer.Tokenizer`'s data path:
    a `FastEncoder` when tiktoken is installed and reproduces the tokenizer, else the
    tokenizer's own `encode_batch` (HF tokenizers). Both give identical ids."""
    try:  # the loaded tokenizer's own JSON: exactly what HF runs
        spec = json.loads(tokenizer.hf.to_str())
        enc = tiktoken_encoding(spec, name=f"lmforge:{Path(tokenizer.folder).name}")
    except FastEncodeUnsupported:
        return tokenizer.encode_batch
    return FastEncoder(enc, fallback=tokenizer.encode_batch, threads=threads)


__all__ = ["FastEncodeUnsupported", "FastEncoder", "batch_encoder", "cores", "byte_decoder", "mergeable_ranks",
           "tiktoken_encoding", "token_bytes"]
