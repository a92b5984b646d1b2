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


# -- the data report (prepare) -----------------------------------------------------------------
#: MinHash over token 5-grams: 64 values by one-permutation hashing (each shingle hashed once,
#: the 64 values the minima of 64 buckets of the hash range, empty buckets filled by rotation:
#: Li, Owen & Zhang 2012, "One Permutation Hashing"; Shrivastava & Li 2014, "Densifying One
#: Permutation Hashing via Rotation"; 1/64 of the hashing of 64 hash functions, the same Jaccard
#: estimate), LSH with 16 bands of 4 (a pair of Jaccard similarity s becomes a candidate with
#: probability 1 - (1 - s^4)^16: 0.99 at s = 0.8, 0.05 at s = 0.3); a candidate is a
#: near-duplicate when its signatures agree on >= 80% of the values (Broder 1997; Leskovec,
#: Rajaraman & Ullman, Mining of Massive Datasets, ch. 3).
SHINGLE = 5
N_HASHES = 64
BANDS = 16
NEAR = 0.8
EXAMPLES = 5
#: Signatures kept at most (64 uint32 each: 64 MB at this cap, allocated once and filled as
#: documents come, so untouched pages cost nothing). Above it the report keeps a
#: consistent sample: the documents whose first MinHash value is a multiple of 2^k, k raised by
#: one (half the sample) each time the cap is reached. Two documents of Jaccard similarity s share
#: that value with probability s, so near-duplicates stay in the sample together (or leave it
#: together); the report says the sample's share and counts the pairs found in it.
MAX_SIGNATURES = 250_000


class DataReport:
    """Collects, document by document, what `prepare`'s report.json holds (see `finish`), in
    memory bounded whatever the number of documents: per split the counts, sums and a count of
    each document length (the quartiles are exact from them: there are at most as many distinct
    lengths as the longest document has tokens), the 10 largest documents, and MinHash
    signatures (64 uint32 per document, at most `max_signatures` of them: a consistent sample
    above that, see MAX_SIGNATURES) with the names and splits of the documents they belong to."""

    def __init__(self, seed: int = 0, max_signatures: int = MAX_SIGNATURES):
        import numpy as np

        rng = np.random.default_rng(seed)
        self._np = np
        self.mul = rng.integers(1, 2**63, size=SHINGLE, dtype=np.uint64) | np.uint64(1)
        self.a = rng.integers(1, 2**63, size=N_HASHES, dtype=np.uint64) | np.uint64(1)
        self.b = rng.integers(0, 2**63, size=N_HASHES, dtype=np.uint64)
        self.documents = 0
        self._per_split: dict[str, dict] = {}  # split -> documents, tokens, bytes, {length: count}
        self._largest: list[tuple[int, int, str, str]] = []  # heap of (tokens, -index, name, split)
        self.max_signatures = max(2, max_signatures)
        self.sampling = 0  # k: the signatures kept are those whose first value is a multiple of 2^k
        self._sigs = np.empty((self.max_signatures, N_HASHES), dtype=np.uint32)  # pages touched as filled
        self._docs = np.empty(len(self._sigs), dtype=np.int64)  # the document index of each kept signature
        self._kept_names: list[str] = []  # name and split of each kept signature's document
        self._kept_splits: list[str] = []
        self._kept = 0
        self.exact_count = 0
        self.exact: list[tuple[str, str]] = []  # (kept, dropped) names: the first EXAMPLES

    def signature(self, ids):
        """64 uint32 MinHash values of the document's token 5-grams (a short document: its one
        n-gram), by one-permutation hashing with rotation (module comment above SHINGLE)."""
        np = self._np
        ids = np.asarray(ids, dtype=np.uint64)
        if len(ids) < SHINGLE:
            ids = np.concatenate([ids, np.zeros(SHINGLE - len(ids), dtype=np.uint64)])
        grams = np.lib.stride_tricks.sliding_window_view(ids, SHINGLE)
        with np.errstate(over="ignore"):
            h = (grams * self.mul).sum(axis=1, dtype=np.uint64) * self.a[0] + self.b[0]
            h ^= h >> np.uint64(31)  # the multiply's high bits mixed down: the bucket is the top 6 bits
            h *= self.a[1]
        h.sort()
        starts = np.searchsorted(h, np.arange(N_HASHES, dtype=np.uint64) << np.uint64(58))
        present = starts < len(h)
        present[present] = (h[starts[present]] >> np.uint64(58)) == np.flatnonzero(present).astype(np.uint64)
        low = np.uint64((1 << 57) - 1)  # each bucket's minimum, 57 bits of it
        values = np.where(present, h[np.minimum(starts, len(h) - 1)] & low, np.uint64(0))
        # an empty bucket takes the next non-empty one's value (circularly), offset by the distance
        full = np.flatnonzero(present)
        nxt = full[np.searchsorted(full, np.arange(N_HASHES)) % len(full)]
        dist = (nxt - np.arange(N_HASHES)) % N_HASHES
        sig = values[nxt] + dist.astype(np.uint64) * np.uint64(1 << 57)
        return (sig >> np.uint64(31)).astype(np.uint32)

    def add(self, name: str, split: str, ids, n_tokens: int, nbytes: int) -> None:
        """One document: its text's token ids (for the signature), its tokens as stored (with
        BOS/EOS: what `seq_len` is compared with) and its UTF-8 bytes."""
        import heapq

        doc = self.documents
        self.documents += 1
        m = self._per_split.setdefault(split, {"documents": 0, "tokens": 0, "bytes": 0, "lengths": {}})
        m["documents"] += 1
        m["tokens"] += n_tokens
        m["bytes"] += nbytes
        m["lengths"][n_tokens] = m["lengths"].get(n_tokens, 0) + 1
        item = (n_tokens, -doc, name, split)
        if len(self._largest) < 10:
            heapq.heappush(self._largest, item)
        elif item > self._largest[0]:
            heapq.heapreplace(self._largest, item)
        self._keep(self.signature(ids), doc, name, split)

    def _sampled(self, first) -> bool:
        return int(first) % (1 << self.sampling) == 0

    def _keep(self, sig, doc: int, name: str, split: str) -> None:
        """Keep `sig` (of document `doc`) if the sample takes it, halving the sample while it is full."""
        np = self._np
        if not self._sampled(sig[0]):
            return
        while self._kept >= self.max_signatures:
            self.sampling += 1
            stay = (self._sigs[: self._kept, 0].astype(np.int64) % (1 << self.sampling)) == 0
            n = int(stay.sum())
            self._sigs[:n], self._docs[:n] = self._sigs[: self._kept][stay], self._docs[: self._kept][stay]
            self._kept_names = [x for x, keep in zip(self._kept_names, stay) if keep]
            self._kept_splits = [x for x, keep in zip(self._kept_splits, stay) if keep]
            self._kept = n
            if not self._sampled(sig[0]):
                return
        self._sigs[self._kept], self._docs[self._kept] = sig, doc
        self._kept_names.append(name)
        self._kept_splits.append(split)
        self._kept += 1

    @property
    def signatures(self):
        """(n, N_HASHES) uint32: the signatures kept (every document's below the cap)."""
        return self._sigs[: self._kept]

    def duplicate(self, kept: str, dropped: str) -> None:
        """An exact duplicate `dropped` of the document `kept` (a name, or words for one)."""
        self.exact_count += 1
        if len(self.exact) < EXAMPLES:
            self.exact.append((kept, dropped))

    def _candidates(self) -> list[tuple[int, int, float]]:
        """(i, j, estimated Jaccard) of every candidate pair at or above NEAR, i and j indices
        into the kept signatures."""
        np = self._np
        if not self._kept:
            return []
        sigs = self.signatures
        rows = N_HASHES // BANDS
        pairs: set[tuple[int, int]] = set()
        for band in range(BANDS):
            # the band's 4 values as one 16-byte key a row; rows with equal keys share a bucket (found
            # by sorting, in arrays: no dict of hundreds of thousands of entries)
            keys = np.ascontiguousarray(sigs[:, band * rows: (band + 1) * rows]).view(np.dtype((np.void, 4 * rows)))
            keys = keys.ravel()
            order = np.argsort(keys, kind="stable")  # equal keys keep row order: the first is the smallest
            ordered = keys[order]
            starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
            sizes = np.diff(np.append(starts, len(order)))
            for start, size in zip(starts[(sizes > 1) & (sizes <= 1000)], sizes[(sizes > 1) & (sizes <= 1000)]):
                members = order[start: start + size]  # a bucket of 1000+ look-alikes: counted by its first
                first = int(members[0])
                pairs.update((first, int(j)) for j in members[1:])
        out = []
        for i, j in sorted(pairs):
            sim = float((sigs[i] == sigs[j]).mean())
            if sim >= NEAR:
                out.append((i, j, sim))
        return out

    def near_duplicates(self) -> list[tuple[int, int, float]]:
        """(i, j, estimated Jaccard) of every candidate pair at or above NEAR among the kept
        signatures; i and j are document indices (in the order added)."""
        return sorted((int(self._docs[i]), int(self._docs[j]), sim) for i, j, sim in self._candidates())

    def finish(self, seq_len: int) -> dict:
        """The report: per split documents, tokens, bytes per token, length quartiles (tokens)
        and the share of tokens in documents longer than `seq_len`; exact duplicates (dropped by
        prepare) and near-duplicates within train, within val and between them (counts and up
        to 5 example name pairs); the 10 largest documents."""
        np = self._np
        report: dict = {"seq_len": seq_len, "splits": {}}
        for split in ("train", "val"):
            m = self._per_split.get(split)
            if not m:
                continue
            lengths = np.asarray(sorted(m["lengths"]), dtype=np.int64)
            counts = np.asarray([m["lengths"][n] for n in lengths.tolist()], dtype=np.int64)
            tokens, b = m["tokens"], m["bytes"]
            report["splits"][split] = {
                "documents": m["documents"], "tokens": tokens, "bytes": b,
                "bytes_per_token": round(b / max(tokens, 1), 4),
                "length_tokens": {"min": int(lengths[0]), "q1": _percentile(lengths, counts, 25),
                                  "median": _percentile(lengths, counts, 50), "q3": _percentile(lengths, counts, 75),
                                  "max": int(lengths[-1])},
                "share_of_tokens_in_documents_longer_than_seq_len": round(
                    float((lengths * counts)[lengths > seq_len + 1].sum() / tokens), 4),
            }
        groups = {"within_train": [], "within_val": [], "between_train_and_val": []}
        for i, j, sim in self._candidates():
            si, sj = self._kept_splits[i], self._kept_splits[j]
            key = "within_" + si if si == sj else "between_train_and_val"
            groups[key].append((self._kept_names[i], self._kept_names[j], round(sim, 3)))
        report["exact_duplicates_dropped"] = {"count": self.exact_count,
                                              "examples": [list(p) for p in self.exact[:EXAMPLES]]}
        report["near_duplicates"] = {k: {"pairs": len(v), "examples": [list(p) for p in v[:EXAMPLES]]}
                                     for k, v in groups.items()}
        report["near_duplicates"]["method"] = (f"MinHash of token {SHINGLE}-grams, {N_HASHES} hashes, LSH "
                                               f"{BANDS} bands; estimated Jaccard >= {NEAR}")
        report["near_duplicates"]["sample"] = {
            "documents": self.documents, "with_signature": self._kept, "share": 1.0 / (1 << self.sampling),
            "max_signatures": self.max_signatures,
            "how": ("every document" if not self.sampling else
                    f"the documents whose first MinHash value is a multiple of {1 << self.sampling} (signatures "
                    f"capped at {self.max_signatures:,}): the pairs counted are those of that sample")}
        report["largest_documents"] = [{"name": name, "split": split, "tokens": int(n)}
                                       for n, _, name, split in sorted(self._largest, reverse=True)]
        return report


def _percentile(values, counts, q: float) -> float:
    """numpy.percentile's default (linear) of the multiset holding counts[i] copies of the sorted
    values[i], without expanding it."""
    import numpy as np

    n = int(counts.sum())
    pos = (n - 1) * q / 100
    lo, frac = int(pos // 1), pos - int(pos // 1)
    ends = np.cumsum(counts)  # value i covers ranks [ends[i] - counts[i], ends[i])
    a = values[int(np.searchsorted(ends, lo, side="right"))]
    b = values[int(np.searchsorted(ends, min(lo + 1, n - 1), side="right"))]
    return float(a + (b - a) * frac)


def data_report_lines(report: dict) -> str:
    lines = []
    for split, m in report["splits"].items():
        q = m["length_tokens"]
        lines.append(f"data report: {split}: {m['documents']:,} documents, {m['tokens']:,} tokens, "
                     f"{m['bytes_per_token']:.2f} bytes/token; length in tokens min {q['min']:,}, quartiles "
                     f"{q['q1']:,.0f} / {q['median']:,.0f} / {q['q3']:,.0f}, max {q['max']:,}; "
                     f"{m['share_of_tokens_in_documents_longer_than_seq_len']:.0%} of tokens in documents longer "
                     f"than seq_len {report['seq_len']}")
    nd = report["near_duplicates"]
    lines.append(f"data report: exact duplicates dropped {report['exact_duplicates_dropped']['count']}; near-duplicate "
                 f"pairs: within train {nd['within_train']['pairs']}, within val {nd['within_val']['pairs']}, "
                 f"between train and val {nd['between_train_and_val']['pairs']}"
                 + (f" (e.g. {nd['between_train_and_val']['examples'][0][:2]})"
                    if nd["between_train_and_val"]["examples"] else "")
                 + (f"; counted on a sample of {nd['sample']['with_signature']:,} of {nd['sample']['documents']:,} "
                    f"documents (1/{round(1 / nd['sample']['share'])}: signatures capped at "
                    f"{nd['sample']['max_signatures']:,})" if nd.get("sample", {}).get("share", 1.0) < 1.0 else ""))
    big = report["largest_documents"][:3]
    lines.append("data report: largest documents: " + ", ".join(f"{d['name']} ({d['tokens']:,} tokens)" for d in big))
    return "\n".join(lines)


__all__ += ["DataReport", "data_report_lines"]
