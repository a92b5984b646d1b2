"""The tasks of a parallel `lmforge prepare` (`lmforge.data.parallel` runs them): which records
of the one stream a task owns (`Owner`), what every task is given (`Job`), and the stages' tasks
(`HashTask`, `PlanTask`, `TokenizeTask`, and datatrove's MinHash bucket step for data.dedup =
"minhash"; `lmforge.data.parallel`'s docstring tells what each does). Each is a datatrove pipeline
step: a callable `(data, rank, world_size)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge import errors
from lmforge.data.data_report import EXAMPLES, DataReport
from lmforge.data.fast_encode import batch_encoder
from lmforge.data.inputs import SKIPPED_NAMES, SourceStats, list_inputs
from lmforge.data.quality import (EXAMPLES as QUALITY_EXAMPLES, DocFilters, bucket_tasks, buckets_step,
                                  near_duplicates, read_pairs, signature_step)
from lmforge.data.shard_writer import BATCH_DOCS, NAMED_DOCUMENTS, TASKS_MARKER, ShardWriter, hash64
from lmforge.data.sources import SPLITS, iter_documents, split_of
from lmforge.errors import DataError

#: Records a chunk: the unit of the stream a task owns (a few hundred kB of text for typical records).
CHUNK_RECORDS = 64
#: The file that marks a work folder as lmforge's, with what its tasks were run for.
OWN_FILE = TASKS_MARKER
STAGES = ("hash", "plan", "tokenize")
#: data.dedup = "minhash": datatrove's bucket stage between the hash and plan stages.
MINHASH_STAGES = ("hash", "buckets", "plan", "tokenize")
#: The hash stage's copy of a task's documents (name and text of each, zstd level 1) that its
#: tokenize stage reads instead of the source: one decompression and JSON decoding of the source a
#: prepare, not two. About a third of the source's text in size, until the data folder is written.
SPILL = "documents.zst"
#: How the near-duplicates removed were found (report.json's near_duplicates_removed.method).
NEAR_METHOD = ("datatrove MinHash: word 5-grams of the simplified text, 14 bands of 8 SHA-1 hashes; pairs "
               "joined into connected components, each kept as its first document in the stream")


class Owner:
    """`take()` for `iter_documents`: True for the records of task `rank` of `tasks` (chunks of
    CHUNK_RECORDS records dealt in turn); `chunk` is the chunk of the record last asked about."""

    def __init__(self, rank: int, tasks: int):
        self.rank, self.tasks, self.record = rank, tasks, -1

    def __call__(self) -> bool:
        self.record += 1
        return (self.record // CHUNK_RECORDS) % self.tasks == self.rank

    def peek(self, n: int) -> list[bool]:
        """What the next `n` calls will answer, none of them made."""
        return [((self.record + i) // CHUNK_RECORDS) % self.tasks == self.rank for i in range(1, n + 1)]

    @property
    def chunk(self) -> int:
        return self.record // CHUNK_RECORDS


class TaskStats(SourceStats):
    """SourceStats that also keep, for each name skipped, the record it was skipped at (-1: by the
    listing, the same in every task), so the names of all tasks come out in stream order."""

    owner: Owner | None = None
    skipped_at: list | None = None

    def skip(self, name: str) -> None:
        if self.skipped_at is None:
            self.skipped_at = []
        if len(self.skipped_at) < SKIPPED_NAMES:
            self.skipped_at.append((self.owner.record if self.owner is not None else -1, name))
        super().skip(name)


@dataclass
class Job:
    """What every task of one prepare needs (it travels to the executor's processes)."""

    work: str
    source: str
    tokenizer_dir: str
    val_fraction: float
    include_tests: bool
    on_bad_utf8: str
    text_field: str
    tasks: int
    listing: str
    dtype: str
    """The shards' token dtype (the tokenizer's contract)."""
    threads: int = 1
    filters: tuple = ()
    """data.filters (`lmforge.data.quality.FILTERS` names), applied in the hash stage."""
    dedup: str = "exact"
    """data.dedup: "minhash" adds the MinHash signatures (hash stage) and bucket stage."""

    def folder(self, stage: str, rank: int) -> Path:
        return Path(self.work) / stage / f"{rank:05d}"

    def minhash(self, what: str) -> str:
        """The folder of the MinHash stage's files: "signatures" or "pairs"."""
        return str(Path(self.work) / "minhash" / what)

    @property
    def stages(self) -> tuple[str, ...]:
        return MINHASH_STAGES if self.dedup == "minhash" else STAGES

    def stage_tasks(self, stage: str) -> int:
        """The tasks of `stage`: one plan, one per MinHash band, else one per share of the stream."""
        return {"plan": 1, "buckets": bucket_tasks()}.get(stage, self.tasks)

    def documents(self, rank: int, stats: TaskStats, stage: str):
        """(document, chunk) of the records task `rank` owns, in stream order; its progress (bytes
        of the input read) in the work folder about once a second, for the bar of `run_stage`.
        Raises DataError when the source lists other files than when the prepare began."""
        import time

        if listing_digest(self.source, self.include_tests) != self.listing:
            raise DataError(f"data.source = {self.source!r}: its files changed while it was prepared (files added, "
                            f"removed or rewritten). Nothing is written from a corpus that changes; run again once "
                            f"it stays put.")
        owner = stats.owner = self.owner = Owner(rank, self.tasks)  # self.owner: where an error stopped the task
        progress = Path(self.work) / "progress" / f"{stage}-{rank:05d}"
        progress.parent.mkdir(exist_ok=True)
        shown = 0.0
        for doc in iter_documents(self.source, None, self.val_fraction, self.include_tests, self.on_bad_utf8, stats,
                                  self.text_field, owner):
            yield doc, owner.chunk
            if time.monotonic() - shown > 1.0:
                shown = time.monotonic()
                progress.write_text(str(stats.input_read()))
        progress.write_text(str(stats.input_bytes))


def listing_digest(source: str, include_tests: bool, files: list | None = None) -> str:
    """sha256 of the files `source` lists (paths, sizes, modification times), in order (`files`:
    that listing, when made already)."""
    files = files if files is not None else list_inputs(source, include_tests, SourceStats())
    text = "\n".join(f"{f.rel}\t{f.kind}\t{f.size}\t{f.mtime_ns}" for f in files)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


class StageTask:
    """A stage's task: `run(rank)` into a fresh folder, renamed into place when done; an
    LmforgeError is kept in the work folder for the parent to raise in its own words."""

    stage = ""

    def __init__(self, job: Job):
        self.job = job

    def __call__(self, data, rank: int = 0, world_size: int = 1):
        final = self.job.folder(self.stage, rank)
        tmp = final.with_name(final.name + ".partial")
        for old in (tmp, final):  # a task stopped before its completion marker: its files are redone
            shutil.rmtree(old, ignore_errors=True)
        tmp.mkdir(parents=True)
        error = Path(self.job.work) / "errors" / f"{self.stage}-{rank:05d}.json"
        error.unlink(missing_ok=True)  # an earlier run's
        try:
            self.run(rank, tmp)
        except errors.LmforgeError as exc:
            error.parent.mkdir(exist_ok=True)
            owner = getattr(self.job, "owner", None)
            error.write_text(json.dumps({"type": type(exc).__name__, "message": str(exc),
                                         "record": owner.record if owner is not None else -1}))
            raise
        os.replace(tmp, final)

    def run(self, rank: int, out: Path) -> None:
        raise NotImplementedError


class HashTask(StageTask):
    stage = "hash"

    def run(self, rank: int, out: Path) -> None:
        """Each document's hash64, chunk, UTF-8 bytes and filter verdict (`DocFilters`); with
        MinHash, datatrove's signatures of the documents the filters keep (a removed one is given
        as empty text: no signature, its index kept)."""
        from datatrove.data import Document

        import zstandard

        job, stats = self.job, TaskStats()
        filters = DocFilters(job.filters) if job.filters else None
        hashes, chunks, sizes, verdicts, name_sizes, splits = [], [], [], [], [], []
        spill = zstandard.ZstdCompressor(level=1).stream_writer(open(out / SPILL, "wb"))
        pending = bytearray()
        minhash = job.dedup == "minhash"  # its signature step reads datatrove Documents; else nothing is read

        def documents():
            for doc, chunk in job.documents(rank, stats, self.stage):
                data = doc.text.encode("utf-8")
                name = doc.name.encode("utf-8", "surrogateescape")
                verdict = filters.verdict(doc.text) if filters is not None else 0
                hashes.append(hash64(data))
                chunks.append(chunk)
                sizes.append(len(data))
                verdicts.append(verdict)
                name_sizes.append(len(name))
                splits.append(SPLITS.index(split_of(doc.key, job.val_fraction)))
                pending.extend(name)
                pending.extend(data)
                if len(pending) >= 1 << 22:
                    spill.write(pending)
                    pending.clear()
                yield Document(text="" if verdict else doc.text, id=str(len(hashes) - 1)) if minhash else None

        with spill:
            if minhash:
                signature_step(job.minhash("signatures")).run(documents(), rank, job.tasks)
            else:
                for _ in documents():
                    pass
            spill.write(pending)
        counts = {k: getattr(stats, k) for k in ("documents", "bad_utf8", "empty", "not_regular", "other")}
        (out / "stats.json").write_text(json.dumps({"stats": counts, "skipped_at": stats.skipped_at or [],
                                                    "input_bytes": stats.input_bytes}))
        np.save(out / "names.npy", np.array(name_sizes, dtype=np.int64))
        np.save(out / "splits.npy", np.array(splits, dtype=np.int64))
        np.save(out / "hashes.npy", np.array(hashes, dtype=np.uint64))
        np.save(out / "chunks.npy", np.array(chunks, dtype=np.int64))
        np.save(out / "sizes.npy", np.array(sizes, dtype=np.int64))
        np.save(out / "verdicts.npy", np.array(verdicts, dtype=np.int64))


class PlanTask(StageTask):
    """One task: which documents are kept, and their places in the stream (module docstring):
    a document a filter removed is dropped (its copies with it), then each exact duplicate, then,
    with MinHash, each document of a near-duplicate component but its first."""

    stage = "plan"

    def run(self, rank: int, out: Path) -> None:
        job, n = self.job, self.job.tasks
        load = lambda r, name: np.load(job.folder("hash", r) / f"{name}.npy")  # noqa: E731
        parts = [(load(r, "hashes"), load(r, "chunks")) for r in range(n)]
        task = np.concatenate([np.full(len(h), r, dtype=np.int64) for r, (h, _) in enumerate(parts)])
        local = np.concatenate([np.arange(len(h), dtype=np.int64) for h, _ in parts])
        order = np.argsort(np.concatenate([c for _, c in parts]), kind="stable")  # stream order
        stream = np.concatenate([h for h, _ in parts])[order]
        verdict = np.concatenate([load(r, "verdicts") for r in range(n)])[order]
        sizes = np.concatenate([load(r, "sizes") for r in range(n)])[order]
        _, first, inverse = np.unique(stream, return_index=True, return_inverse=True)
        keep = np.zeros(len(stream), dtype=bool)
        keep[first] = True
        exact = ~keep & (verdict == 0)  # a filtered text's copies are filtered too: not duplicates
        keep &= verdict == 0
        names: list[list[int]] = [[] for _ in range(n)]

        def ref(p: int) -> list[int]:  # (task, index) of stream position p, its name asked for
            r = [int(task[order[p]]), int(local[order[p]])]
            names[r[0]].append(r[1])
            return r

        info: dict = {}
        if job.filters:
            info["filtered"] = [{"name": f, "documents": int((verdict == i + 1).sum()),
                                 "bytes": int(sizes[verdict == i + 1].sum()),
                                 "examples": [ref(p) for p in np.flatnonzero(verdict == i + 1)[:QUALITY_EXAMPLES]]}
                                for i, f in enumerate(job.filters)]
        named = np.cumsum(keep) - 1  # the documents one process names (before MinHash: it has no MinHash)
        if job.dedup == "minhash":
            position = np.empty(len(stream), dtype=np.int64)
            position[order] = np.arange(len(stream))
            starts = np.concatenate([[0], np.cumsum([len(h) for h, _ in parts])])
            pairs = read_pairs(job.minhash("pairs"))
            edges = np.stack([position[starts[pairs[:, 0]] + pairs[:, 1]], position[starts[pairs[:, 2]] + pairs[:, 3]]], 1)
            label = near_duplicates(edges, len(stream))
            near = keep & (label != np.arange(len(stream)))
            keep &= ~near
            info["near"] = {"documents": int(near.sum()), "bytes": int(sizes[near].sum()),
                            "examples": [[ref(int(label[p])), ref(p)] for p in np.flatnonzero(near)[:QUALITY_EXAMPLES]],
                            "method": NEAR_METHOD}
        kept_index = np.cumsum(keep) - 1
        kept_index[~keep] = -1
        place = np.empty(len(stream), dtype=np.int64)
        place[order] = kept_index
        examples = []
        for p in np.flatnonzero(exact)[:EXAMPLES].tolist():  # (kept, dropped) as one process names them
            orig = int(first[inverse[p]])
            examples.append([ref(orig) if named[orig] < NAMED_DOCUMENTS else None, ref(p)])
        start = 0
        for r, (h, _) in enumerate(parts):
            np.save(out / f"{r:05d}.npy", place[start: start + len(h)])
            start += len(h)
        (out / "plan.json").write_text(json.dumps({"duplicates": int(exact.sum()), "examples": examples,
                                                   "names": names, **info}))


class TokenizeTask(StageTask):
    """A task's documents the plan keeps, read back from its hash stage's SPILL (not the source),
    written as shards with their chunks and their part of the data report."""

    stage = "tokenize"

    def run(self, rank: int, out: Path) -> None:
        import time

        import zstandard

        from lmforge.tokenizer import Tokenizer

        job, hashed = self.job, self.job.folder("hash", rank)
        place = np.load(job.folder("plan", 0) / f"{rank:05d}.npy")
        hashes, chunks, sizes, name_sizes, splits = (np.load(hashed / f"{k}.npy").tolist()
                                                     for k in ("hashes", "chunks", "sizes", "names", "splits"))
        wanted = set(json.loads((job.folder("plan", 0) / "plan.json").read_text())["names"][rank])
        read = json.loads((hashed / "stats.json").read_text())
        tok = Tokenizer.load(job.tokenizer_dir)
        report = DataReport()
        writer = ShardWriter(out, tok.contract, report, batch_encoder(tok, threads=job.threads))
        names: dict[int, str] = {}
        batch: list = []
        progress, shown = Path(job.work) / "progress" / f"{self.stage}-{rank:05d}", 0.0
        progress.parent.mkdir(exist_ok=True)
        with open(hashed / SPILL, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as spill:
            buf, at = b"", 0
            try:
                for i, keep in enumerate(place.tolist()):
                    need = name_sizes[i] + sizes[i]
                    if len(buf) - at < need:  # the next 4 MB (or the document) of the spill
                        buf, at = buf[at:] + spill.read(max(1 << 22, need)), 0
                    name, data = buf[at: at + name_sizes[i]], buf[at + name_sizes[i]: at + need]
                    at += need
                    if i in wanted:
                        names[i] = name.decode("utf-8", "surrogateescape")
                    if keep >= 0:
                        doc = Spilled(name.decode("utf-8", "surrogateescape"), data.decode("utf-8"))
                        batch.append((doc, SPLITS[splits[i]], hashes[i], sizes[i], chunks[i], keep))
                    if len(batch) >= BATCH_DOCS:
                        writer.write(batch)
                        batch = []
                        if time.monotonic() - shown > 1.0:
                            shown = time.monotonic()
                            progress.write_text(str(read["input_bytes"] * (i + 1) // len(place)))
                if batch:
                    writer.write(batch)
            finally:
                writer.close()
        progress.write_text(str(read["input_bytes"]))
        for split in SPLITS:
            np.save(out / f"{split}.chunks.npy", np.array(writer.chunks[split], dtype=np.int64))
        with open(out / "report.pkl", "wb") as f:
            pickle.dump(report.part(), f)
        (out / "task.json").write_text(json.dumps({"splits": writer.split_meta, "stats": read["stats"],
                                                   "skipped_at": read["skipped_at"],
                                                   "names": {str(k): v for k, v in names.items()}}))


@dataclass
class Spilled:
    """A document read back from a SPILL: what `ShardWriter.write` reads of one."""

    name: str
    text: str


TASKS = {"hash": HashTask, "plan": PlanTask, "tokenize": TokenizeTask,
         "buckets": lambda job: buckets_step(job.minhash("signatures"), job.minhash("pairs"))}

__all__ = ["CHUNK_RECORDS", "HashTask", "Job", "MINHASH_STAGES", "NEAR_METHOD", "OWN_FILE", "Owner", "PlanTask", "STAGES", "StageTask", "TASKS",
           "SPILL", "Spilled", "TaskStats", "TokenizeTask", "listing_digest"]
