"""The writing primitives of a data folder, shared by `lmforge prepare`'s one process
(`lmforge.data.prepare`) and its tasks (`lmforge.data.stream_tasks`): the content hash of a
document (`hash64`) and the set of those seen (`SeenHashes`, exact deduplication), and the
writer of `{split}.bin` / `.idx` / `.hashes` (`ShardWriter`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from lmforge.data.data_report import DataReport
from lmforge.data.sources import SPLITS

#: `{split}.hashes`: every document's content hash (`hash64`), uint64 little-endian, in shard order.
HASHES_SUFFIX = ".hashes"
BATCH_DOCS = 64
#: The folder beside the data folder where `workers` > 1 keep their tasks' files until it is written.
TASKS_SUFFIX = ".prepare-tasks"
#: The file that marks such a folder as lmforge's, with what its tasks were run for.
TASKS_MARKER = "lmforge-prepare-tasks.json"


class SeenHashes:
    """The 64-bit content hashes of the documents kept so far, for exact deduplication, in 8
    bytes a document: a sorted numpy array, with the newest in a small set merged into it every
    `buffer` documents. (A Python set would take about 70 bytes a document.)"""

    def __init__(self, buffer: int = 1 << 16):
        self.sorted = np.zeros(0, dtype=np.uint64)
        self.recent: set[int] = set()
        self.buffer = buffer

    def add(self, h: int) -> bool:
        """Record `h`; False when it was seen before."""
        if h in self.recent:
            return False
        # a numpy scalar: a Python int above 2**63 would make searchsorted convert the whole array
        i = int(np.searchsorted(self.sorted, np.uint64(h)))
        if i < len(self.sorted) and int(self.sorted[i]) == h:
            return False
        self.recent.add(h)
        if len(self.recent) >= self.buffer:  # none of them is in `sorted`: a merge, no deduplication
            merged = np.concatenate([self.sorted, np.fromiter(self.recent, dtype=np.uint64, count=len(self.recent))])
            merged.sort()
            self.sorted = merged
            self.recent.clear()
        return True


#: Names of the first documents kept, for the examples of exact duplicates (beyond them a
#: duplicate's original is "an earlier document"): memory bounded whatever the corpus size.
NAMED_DOCUMENTS = 20_000


def hash64(data: bytes) -> int:
    """The first 8 bytes of sha256(`data`, a text's UTF-8), as an unsigned integer (big-endian):
    the content hash of deduplication and of `{split}.hashes`."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class ShardWriter:
    """`{split}.bin` / `.idx` / `.hashes` of `folder`, written document by document (`write`), with
    each split's counts in `split_meta` and every document added to `report`; `chunks[split]`,
    the chunk (`lmforge.data.parallel`) each document written came from. `close` when done."""

    def __init__(self, folder: Path, contract, report: DataReport, encode_batch, shown=lambda: None):
        self.contract, self.report, self.encode_batch, self.shown = contract, report, encode_batch, shown
        self.files = {s: open(folder / f"{s}.bin", "wb") for s in SPLITS}
        self.idx_files = {s: open(folder / f"{s}.idx", "wb") for s in SPLITS}
        self.hash_files = {s: open(folder / f"{s}{HASHES_SUFFIX}", "wb") for s in SPLITS}
        self.ends = {s: 0 for s in SPLITS}
        for s in SPLITS:
            self.idx_files[s].write(np.zeros(1, dtype=np.int64).tobytes())
        self.split_meta = {s: {"documents": 0, "tokens": 0, "bytes": 0, "max_id": -1} for s in SPLITS}
        self.chunks: dict[str, list[int]] = {s: [] for s in SPLITS}

    def write(self, batch: list) -> None:
        """`batch`: (document, split, hash64, UTF-8 bytes[, chunk, index in the stream]) tuples."""
        contract, dtype = self.contract, self.contract.dtype
        encoded = [np.array(ids, dtype=np.int64) for ids in self.encode_batch([b[0].text for b in batch])]
        start, end = np.array(contract.document_start, dtype=np.int64), np.array([contract.eos_id], dtype=np.int64)
        signatures = self.report.signatures_of(encoded)
        for (doc, split, h, nbytes, *place), ids, signature in zip(batch, encoded, signatures):
            arr = np.concatenate([start, ids, end])
            self.files[split].write(arr.astype(dtype).tobytes())
            self.ends[split] += len(arr)
            self.idx_files[split].write(np.int64(self.ends[split]).tobytes())
            self.hash_files[split].write(np.uint64(h).astype("<u8").tobytes())
            m = self.split_meta[split]
            m["documents"] += 1
            m["tokens"] += len(arr)
            m["bytes"] += nbytes
            m["max_id"] = max(m["max_id"], int(arr.max()))
            self.report.add(doc.name, split, ids, len(arr), nbytes, place[1] if place else None, signature)
            if place:
                self.chunks[split].append(place[0])
        self.shown()

    def close(self) -> None:
        for group in (self.files, self.idx_files, self.hash_files):
            for f in group.values():
                f.close()


__all__ = ["BATCH_DOCS", "HASHES_SUFFIX", "NAMED_DOCUMENTS", "TASKS_MARKER", "TASKS_SUFFIX", "SeenHashes", "ShardWriter",
           "hash64"]
