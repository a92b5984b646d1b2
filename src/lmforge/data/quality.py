"""What `lmforge prepare` removes beyond exact duplicates, on request (`data.filters`,
`data.dedup = "minhash"`), through datatrove's own blocks: its quality filters (each document
judged alone, by its text) and its MinHash deduplication stages (near-duplicates found across
the whole corpus, the first copy in the stream kept).

Filters (`FILTERS`): datatrove's Gopher quality and repetition filters (Rae et al. 2021,
"Scaling Language Models: Methods, Analysis & Insights from Training Gopher", appendix A), C4's
quality rules (Raffel et al. 2020, section 2.2) and FineWeb's (Penedo et al. 2024), with
datatrove's default thresholds. A document goes through them in the order listed and is removed by
the first that rejects it; its copies are removed with it (a filter sees the text only).
They are tuned for English prose: code and tables fail most of them. Their word tokenizer is
spaCy's blank English pipeline (no model download): the `filters` extra.

MinHash (`minhash_config`, `signature_step`, `buckets_step`, `near_duplicates`): datatrove's
signature stage (word 5-grams of the simplified text, 14 bands of 8 hashes: a pair of Jaccard
similarity 0.8 is found with probability 0.92, 0.72 is the threshold where it is 1/2; Broder 1997;
Leskovec, Rajaraman & Ullman, Mining of Massive Datasets, ch. 3) and bucket stage (the pairs
whose band signatures are equal), then lmforge's clustering: the pairs' connected components,
each kept as its first document in the one stream. datatrove's own cluster stage keeps the
document with the lowest (task, index), which moves with the number of tasks; the first in the
stream does not, so the data folder is the same at any `data.workers`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lmforge import errors
from lmforge.config.sources import DEDUP, FILTER_NAMES
from lmforge.errors import ConfigError

#: data.filters' names (lmforge.config.sources.FILTER_NAMES): datatrove's filter class (module,
#: class), each with its defaults.
FILTERS = {
    "gopher_quality": ("datatrove.pipeline.filters.gopher_quality_filter", "GopherQualityFilter"),
    "gopher_repetition": ("datatrove.pipeline.filters.gopher_repetition_filter", "GopherRepetitionFilter"),
    "c4_quality": ("datatrove.pipeline.filters.c4_filters", "C4QualityFilter"),
    "fineweb_quality": ("datatrove.pipeline.filters.fineweb_quality_filter", "FineWebQualityFilter"),
}
#: Example names the report keeps per filter, and of near-duplicates removed.
EXAMPLES = 3


@dataclass(frozen=True)
class Quality:
    """What a prepare removes beyond exact duplicates: `filters` (FILTERS names, in order) and
    `dedup` ("exact", or "minhash": near-duplicates too)."""

    filters: tuple[str, ...] = ()
    dedup: str = "exact"

    @property
    def active(self) -> bool:
        return bool(self.filters) or self.dedup == "minhash"

    def settings(self) -> dict:
        """The settings as a fingerprint or a mixture's input records them ({} when none)."""
        return {"filters": list(self.filters), "dedup": self.dedup} if self.active else {}

    def require(self) -> None:
        """ConfigError naming the extra to install when spaCy (the filters' and MinHash's word
        tokenizer) or regex is missing."""
        if self.active:
            for module in ("spacy", "regex"):
                errors.require_package(module, "filters", "data.filters / data.dedup = \"minhash\" (datatrove's "
                                       "word tokenizer)", ConfigError)


class DocFilters:
    """`verdict(text)`: 0 when every filter keeps the document, else 1 + the index of the first
    that removes it; `tally`, what each removed (`FilterTally`)."""

    def __init__(self, names: tuple[str, ...]):
        import importlib

        self.names = tuple(names)
        self.filters = [getattr(importlib.import_module(m), c)() for m, c in (FILTERS[n] for n in self.names)]
        self.tally = FilterTally(self.names)

    def verdict(self, text: str) -> int:
        from datatrove.data import Document

        for i, f in enumerate(self.filters):
            kept = f.filter(Document(text=text, id="0"))  # a Document each: C4's filter rewrites the text it judges
            if not (kept[0] if isinstance(kept, tuple) else kept):
                return i + 1
        return 0


class FilterTally:
    """Per filter: the documents and UTF-8 bytes it removed and the first EXAMPLES names."""

    def __init__(self, names: tuple[str, ...]):
        self.names = tuple(names)
        self.documents = [0] * len(self.names)
        self.bytes = [0] * len(self.names)
        self.examples: list[list[str]] = [[] for _ in self.names]

    def add(self, verdict: int, name: str, nbytes: int) -> None:
        i = verdict - 1
        self.documents[i] += 1
        self.bytes[i] += nbytes
        if len(self.examples[i]) < EXAMPLES:
            self.examples[i].append(name)

    def report(self) -> list[dict]:
        return [{"name": n, "documents": d, "bytes": b, "examples": e}
                for n, d, b, e in zip(self.names, self.documents, self.bytes, self.examples)]


def minhash_config():
    """datatrove's MinhashConfig at its defaults (5-grams, 14 buckets of 8), hashed with SHA-1:
    its default xxhash hashes text, which xxhash 4 refuses."""
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.hashing import HashConfig

    return MinhashConfig(hash_config=HashConfig(precision=64, hash_fc="sha1"))


def signature_step(folder: str):
    """datatrove's MinHash signature stage writing into `folder` (bucket_XXX/RANK.minhash.sig; a
    document's index is its place among those its task was given)."""
    from datatrove.pipeline.dedup.minhash import MinhashDedupSignature

    return MinhashDedupSignature(output_folder=folder, config=minhash_config())


def buckets_step(signatures: str, folder: str):
    """datatrove's MinHash bucket stage: the pairs of equal band signatures of `signatures`'
    files, written into `folder` (one .dups file a band); run as `bucket_tasks()` tasks."""
    from datatrove.pipeline.dedup.minhash import MinhashDedupBuckets

    return MinhashDedupBuckets(input_folder=signatures, output_folder=folder, config=minhash_config())


def bucket_tasks() -> int:
    return minhash_config().num_buckets


def read_pairs(folder) -> np.ndarray:
    """(n, 4) int64: every (task, index, task, index) pair the bucket stage wrote in `folder`."""
    from pathlib import Path

    parts = [np.fromfile(p, dtype="<u4").reshape(-1, 4) for p in sorted(Path(folder).glob("*.dups"))]
    return np.concatenate(parts + [np.zeros((0, 4), "<u4")]).astype(np.int64)


def near_duplicates(edges: np.ndarray, n: int) -> np.ndarray:
    """(n,) int64: for each of `n` documents (stream positions), the first position of its
    connected component under `edges` ((m, 2) position pairs); itself when it has no pair.
    Minimum-label propagation with pointer jumping (every label stays a member of the component
    at or before the document)."""
    labels = np.arange(n, dtype=np.int64)
    if len(edges) == 0:
        return labels
    a, b = edges[:, 0], edges[:, 1]
    while True:
        low = np.minimum(labels[a], labels[b])
        new = labels.copy()
        np.minimum.at(new, a, low)
        np.minimum.at(new, b, low)
        new = new[new]
        if np.array_equal(new, labels):
            return labels
        labels = new


__all__ = ["DEDUP", "DocFilters", "EXAMPLES", "FILTERS", "FILTER_NAMES", "FilterTally", "Quality", "bucket_tasks",
           "buckets_step", "minhash_config", "near_duplicates", "read_pairs", "signature_step"]
