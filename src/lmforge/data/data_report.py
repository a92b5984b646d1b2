"""The data report of a prepared folder (`lmforge prepare`'s report.json): per split the
documents, tokens, bytes per token and length quartiles, the exact duplicates dropped, the
near-duplicates (MinHash) within and between the splits, the largest documents (`DataReport`,
`data_report_lines`). `DataReport.merged` joins the reports of `lmforge.data.parallel`'s tasks into
the one a single process would have written.
"""

from __future__ import annotations

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
        self.filtered: list[dict] | None = None  # data.filters: per filter documents, bytes, examples
        self.near_removed: dict | None = None  # data.dedup = "minhash": documents, bytes, examples

    def signature(self, ids):
        """64 uint32 MinHash values of the document's token 5-grams (a short document: its one
        n-gram), by one-permutation hashing with rotation (module comment above SHINGLE)."""
        return self.signatures_of([ids])[0]

    def signatures_of(self, docs: list):
        """(len(docs), 64) uint32: `signature` of each of `docs` (token id sequences), computed
        for all of them at once. Per document: each 5-gram hashed to 64 bits (h), a bucket the
        top 6 bits, its value the bucket's smallest h (57 bits); an empty bucket takes the next
        non-empty one's value (circularly) plus 2^57 x the distance; the top 32 of 64 bits kept."""
        np = self._np
        arrays = [np.asarray(d, dtype=np.uint64) for d in docs]
        arrays = [a if len(a) >= SHINGLE else np.concatenate([a, np.zeros(SHINGLE - len(a), np.uint64)]) for a in arrays]
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        windows = lengths - SHINGLE + 1
        flat = np.concatenate(arrays)
        n = len(flat) - SHINGLE + 1
        # the windows inside each document (none across two)
        starts = np.repeat(np.cumsum(lengths) - lengths - np.cumsum(windows) + windows, windows) + np.arange(windows.sum())
        with np.errstate(over="ignore"):
            h = flat[:n] * self.mul[0]
            for k in range(1, SHINGLE):
                h += flat[k: k + n] * self.mul[k]
            h = h[starts] * self.a[0] + self.b[0]
            h ^= h >> np.uint64(31)  # the multiply's high bits mixed down: the bucket is the top 6 bits
            h *= self.a[1]
        key = np.repeat(np.arange(len(docs), dtype=np.int64), windows) * N_HASHES + (h >> np.uint64(58)).astype(np.int64)
        top = np.uint64(2**64 - 1)
        values = np.full(len(docs) * N_HASHES, top, dtype=np.uint64)
        np.minimum.at(values, key, h)  # each bucket's minimum (no h is 2^64 - 1 in an empty bucket's place)
        present = np.zeros(len(values), dtype=bool)
        present[key] = True
        values, present = (values & np.uint64((1 << 57) - 1)).reshape(-1, N_HASHES), present.reshape(-1, N_HASHES)
        # the next non-empty bucket at or after each (circularly): a running minimum from the right
        ahead = np.where(np.concatenate([present, present], axis=1), np.arange(2 * N_HASHES), 2 * N_HASHES)
        nxt = np.minimum.accumulate(ahead[:, ::-1], axis=1)[:, ::-1][:, :N_HASHES]
        dist = (nxt - np.arange(N_HASHES)).astype(np.uint64)
        sig = np.take_along_axis(values, nxt % N_HASHES, axis=1) + dist * np.uint64(1 << 57)
        return (sig >> np.uint64(31)).astype(np.uint32)

    def add(self, name: str, split: str, ids, n_tokens: int, nbytes: int, doc: int | None = None,
            signature=None) -> None:
        """One document: its text's token ids (for the signature), its tokens as stored (with
        BOS/EOS: what `seq_len` is compared with) and its UTF-8 bytes; `doc`, its index among the
        documents kept (default: the documents added so far; a task of `lmforge.data.parallel`
        gives its documents' places in the one stream); `signature`, the ids' (`signatures`), when
        computed already."""
        import heapq

        doc = self.documents if doc is None else doc
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
        self._keep(self.signature(ids) if signature is None else signature, doc, name, split)

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

    def part(self) -> dict:
        """This report's state, picklable, for `merged` (a task's report)."""
        return {"documents": self.documents, "per_split": self._per_split, "largest": list(self._largest),
                "sampling": self.sampling, "sigs": self.signatures.copy(), "docs": self._docs[: self._kept].copy(),
                "names": list(self._kept_names), "splits": list(self._kept_splits)}

    @classmethod
    def merged(cls, parts: list[dict], exact_count: int, exact: list[tuple[str, str]],
               max_signatures: int = MAX_SIGNATURES) -> "DataReport":
        """The report of the documents of every part (`part()` of reports whose `add` was given
        each document's index in one stream, no index twice), equal to the one report that would
        have had them added in the order of their indices; `exact_count` and `exact`, the exact
        duplicates dropped (count, first (kept, dropped) names). The sample of signatures is the
        one a single report keeps: those whose first value is a multiple of 2^k, k the smallest
        for which they fit under `max_signatures` (a part at k_p had more than fit below k_p)."""
        import heapq

        out = cls(max_signatures=max_signatures)
        np = out._np
        out.documents = sum(p["documents"] for p in parts)
        for p in parts:
            for split, m in p["per_split"].items():
                into = out._per_split.setdefault(split, {"documents": 0, "tokens": 0, "bytes": 0, "lengths": {}})
                for key in ("documents", "tokens", "bytes"):
                    into[key] += m[key]
                for n, c in m["lengths"].items():
                    into["lengths"][n] = into["lengths"].get(n, 0) + c
        out._largest = heapq.nlargest(10, [item for p in parts for item in p["largest"]])
        heapq.heapify(out._largest)
        sigs = np.concatenate([p["sigs"] for p in parts] + [np.zeros((0, N_HASHES), np.uint32)])
        docs = np.concatenate([p["docs"] for p in parts] + [np.zeros(0, np.int64)])
        names = [x for p in parts for x in p["names"]]
        splits = [x for p in parts for x in p["splits"]]
        out.sampling = max([p["sampling"] for p in parts] + [0])
        while True:
            stay = (sigs[:, 0].astype(np.int64) % (1 << out.sampling)) == 0
            if int(stay.sum()) <= out.max_signatures:
                break
            out.sampling += 1
        order = [int(i) for i in np.flatnonzero(stay)[np.argsort(docs[stay], kind="stable")]]
        out._kept = len(order)
        out._sigs[: out._kept], out._docs[: out._kept] = sigs[order], docs[order]
        out._kept_names, out._kept_splits = [names[i] for i in order], [splits[i] for i in order]
        out.exact_count, out.exact = exact_count, list(exact[:EXAMPLES])
        return out

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
        to 5 example name pairs); what data.filters and data.dedup = "minhash" removed, when set
        (`filters`, `near_duplicates_removed`); the 10 largest documents."""
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
        if self.filtered is not None:
            report["filters"] = self.filtered
        if self.near_removed is not None:
            report["near_duplicates_removed"] = self.near_removed
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
    for f in report.get("filters", []):
        lines.append(f"data report: filter {f['name']} removed {f['documents']:,} documents ({f['bytes']:,} bytes)")
    if "near_duplicates_removed" in report:
        near = report["near_duplicates_removed"]
        lines.append(f"data report: near-duplicates removed (MinHash) {near['documents']:,} documents "
                     f"({near['bytes']:,} bytes)")
    big = report["largest_documents"][:3]
    lines.append("data report: largest documents: " + ", ".join(f"{d['name']} ({d['tokens']:,} tokens)" for d in big))
    return "\n".join(lines)


__all__ = ["DataReport", "data_report_lines"]
