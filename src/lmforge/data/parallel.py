"""`lmforge prepare` on N tasks at once (`data.workers`), run by datatrove's executors, writing the
same data folder as one process, to the byte.

The one stream. A source's records (a text file, a JSONL line, a Parquet or Arrow row), in the
order one process reads them, are cut into chunks of CHUNK_RECORDS; task r of N reads chunks
r, r + N, r + 2N, ... (`Owner`). Every task skims the other records without decoding them (a
compressed file is decompressed by each task: cheap beside tokenizing), so one large file is
shared as well as many small ones. Which documents there are, their order, their split (by each
document's key) and their tokens do not depend on N.

Three stages (four with MinHash), each a datatrove pipeline run `workers` tasks at a time; a
finished task is recorded by datatrove's completion markers in the work folder and not run again
by a resumed prepare:
1. "hash": each task's documents' content hashes (`hash64`), chunks, bytes and data.filters'
   verdicts (`lmforge.data.quality`), and a copy of its documents (`stream_tasks.SPILL`: name and
   text, zstd) for its tokenize stage; with data.dedup = "minhash", datatrove's MinHash signatures.
   "buckets" (MinHash only, one task a band): datatrove's bucket stage, the near-duplicate pairs.
2. "plan" (one task): the hashes in stream order; a filtered document is dropped, the first copy
   of each other is kept (exact deduplication across tasks, as one process keeps it), then with
   MinHash the first of each near-duplicate component; each task is given its documents' places
   among those kept (-1: dropped) and the names the report's examples need.
3. "tokenize": each task writes the documents it keeps as shards (`ShardWriter`), with each
   document's chunk, and its part of the data report, reading them from its copy (the source is
   decompressed and decoded once, by the hash stage).
Then `join` concatenates the tasks' shards in stream order into the data folder, merges the
reports (`DataReport.merged`) and sums the counts. A task writes into a folder of its own,
renamed into place when complete: a stopped task leaves nothing that a resumed one reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import sys
import threading
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmforge import errors
from lmforge.data.data_report import DataReport
from lmforge.data.fast_encode import cores
from lmforge.data.inputs import SKIPPED_NAMES, SourceStats, list_inputs
from lmforge.data.quality import Quality
from lmforge.data.shard_writer import HASHES_SUFFIX
from lmforge.data.sources import SPLITS
from lmforge.data import stream_tasks
from lmforge.data.stream_tasks import OWN_FILE, TASKS, Job, listing_digest
from lmforge.errors import DataError
from lmforge.fileio import OutputError, shown_path


class TaskKilled(Exception):
    """A task's process ended without finishing (a signal: the kernel's out-of-memory killer
    sends SIGKILL); `code` its exit code (-N: signal N)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _executor_class():
    """datatrove's LocalPipelineExecutor, its log lines kept in the work folder (a task's
    LmforgeError reaches the user as lmforge's one error line, not a logged traceback), and a
    task whose process dies (killed: out of memory) raising TaskKilled: datatrove's pool would
    wait for its result for ever."""
    from datatrove.executor.local import LocalPipelineExecutor

    class QuietLocalExecutor(LocalPipelineExecutor):
        def run(self):
            """datatrove's run on `workers` > 1 processes, its pool's processes watched: one that
            exits while tasks remain raises TaskKilled (the pool is then terminated)."""
            if self.workers == 1 or all(map(self.is_rank_completed, range(self.tasks))):
                return super().run()
            import functools

            import multiprocess

            self._launched = True
            self.save_executor_as_json()
            manager = multiprocess.Manager()
            try:
                ranks = manager.Queue()
                for i in range(self.workers):
                    ranks.put(i)
                todo = self.get_incomplete_ranks(range(self.tasks))
                with multiprocess.get_context(self.start_method).Pool(self.workers) as pool:
                    seen = list(pool._pool)  # the pool's processes (it replaces one that exits)
                    result = pool.map_async(functools.partial(self._launch_run_for_rank, ranks_q=ranks), todo,
                                            chunksize=1)
                    while not result.ready():
                        result.wait(0.2)
                        dead = [p.exitcode for p in seen if p.exitcode not in (None, 0)]
                        if dead:
                            raise TaskKilled(dead[0])
                        seen += [p for p in pool._pool if p not in seen]
                    result.get()  # a task's exception, raised here
            finally:
                manager.shutdown()

        def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1):
            import contextlib

            from datatrove.utils.logging import logger

            with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
                try:
                    return super()._run_for_rank(rank, local_rank, node_rank)
                finally:
                    logger.remove()  # its sinks: the task's log file, and the null stream

    return QuietLocalExecutor


_RUNNING = threading.Event()


def _child_signals() -> None:
    """In a process the executor forks (a task, its Manager): SIGTERM ends it at once (the pool
    ends its workers with SIGTERM; lmforge's command handler would unwind each with a
    traceback) and SIGINT is left to the parent, which stops the stage (Ctrl-C reaches the
    whole process group)."""
    if _RUNNING.is_set():
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # forked from a thread: no handlers to set there
            pass


os.register_at_fork(after_in_child=_child_signals)

#: How the local executor starts its processes: fork where there is one (Linux: a task starts in a
#: tenth of a second with lmforge already imported; forkserver takes seconds a stage), else spawn.
START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"


def run_stage(job: Job, stage: str, workers: int, progress: bool, input_bytes: int, executor: str = "local") -> None:
    """Run `stage`'s tasks not yet complete, `workers` at a time (datatrove's local executor, or its
    Ray executor on the cluster `ray.init` joined; completion markers and logs under the work
    folder), with one bar of the input read.

    Raises:
        the LmforgeError a task raised (the lowest rank's), as lmforge raises it.
    """
    from datatrove.utils.logging import logger

    tasks = job.stage_tasks(stage)
    counted = stage in ("hash", "tokenize")  # the stages that read the input: a bar of its bytes
    logger.remove()  # datatrove's console lines: in the work folder's logs
    common = {"pipeline": [TASKS[stage](job)], "tasks": tasks, "workers": min(workers, tasks),
              "logging_dir": str(Path(job.work) / "logs" / stage), "skip_completed": True}
    if executor == "ray":
        from datatrove.executor.ray import RayPipelineExecutor

        executor = RayPipelineExecutor(**common, cpus_per_task=job.threads, mem_per_cpu_gb=1)
    else:
        executor = _executor_class()(**common, start_method=START_METHOD)
    progress_dir = Path(job.work) / "progress"
    progress_dir.mkdir(exist_ok=True)
    bar = tqdm(desc=f"prepare ({stage}, {tasks} task{'s' if tasks > 1 else ''})", unit="B", unit_scale=True,
               total=input_bytes if counted else None, disable=not progress or not counted, mininterval=1.0)
    stop = threading.Event()

    def show() -> None:
        while not stop.wait(1.0):
            read = 0
            for r in range(tasks):
                try:
                    read += min(int((progress_dir / f"{stage}-{r:05d}").read_text() or 0), input_bytes)
                except (OSError, ValueError):
                    pass
            bar.update(max(0, read // tasks - bar.n))

    watcher = threading.Thread(target=show, daemon=True)
    watcher.start()
    _RUNNING.set()
    done = False
    try:
        executor.run()
        done = all(executor.is_rank_completed(r) for r in range(tasks))
    except TaskKilled as exc:
        raise _killed(job, stage, exc.code) from None
    except Exception:
        _raise_task_error(job, stage)
        raise
    finally:
        _RUNNING.clear()
        stop.set()
        watcher.join()
        if done and bar.total:
            bar.update(bar.total - bar.n)  # the bar ends full: the last progress files may not have been read
        bar.close()
    if not done:
        _raise_task_error(job, stage)
        raise DataError(f"prepare: the {stage} stage did not finish every task (logs in "
                        f"{shown_path(Path(job.work) / 'logs' / stage)}). Run the same command again to resume.")


def _killed(job: Job, stage: str, code: int) -> DataError:
    """The error of a task of `stage` whose process ended with exit code `code` (-N: signal N)."""
    names = {int(sig): sig.name for sig in signal.Signals}
    how = f"signal {names.get(-code, -code)}" if code < 0 else f"exit code {code}"
    return DataError(f"prepare: a task of the {stage} stage ended before it finished ({how}: on Linux the kernel's "
                     f"out-of-memory killer sends SIGKILL when memory runs out; `dmesg` tells). The finished tasks "
                     f"are kept in {shown_path(Path(job.work))}: run the same command again to resume, with fewer "
                     f"data.workers if memory was short.")


def _raise_task_error(job: Job, stage: str) -> None:
    """Raise the LmforgeError a task of `stage` recorded (the one earliest in the stream, as one
    process would have met it first among those met), if any, the work folder removed first: bad
    input, so a run with it fixed has other inputs and nothing to resume."""
    found = [json.loads(p.read_text()) for p in sorted((Path(job.work) / "errors").glob(f"{stage}-*.json"))]
    if found:
        error = min(found, key=lambda e: e.get("record", -1))
        shutil.rmtree(job.work, ignore_errors=True)
        kind = getattr(errors, error["type"], DataError)
        raise (kind if isinstance(kind, type) and issubclass(kind, errors.LmforgeError) else DataError)(
            error["message"])


#: Bytes of input (on disk) a task is given at least: a smaller source runs in fewer tasks (one
#: process below twice this), as the tasks' start and the hash pass cost about a second.
MIN_TASK_BYTES = 8 << 20


def task_count(source: str, include_tests: bool, most: int = 0) -> int:
    """The tasks of data.workers = 0 (`most` = 0: the cores): at most one per MIN_TASK_BYTES of the
    source's files (the data folder is the same for any count)."""
    size = sum(f.size for f in list_inputs(source, include_tests, SourceStats()))
    return max(1, min(most or cores(), size // MIN_TASK_BYTES))


def open_work(work: Path, fingerprint: dict) -> bool:
    """Make `work` the tasks' folder for `fingerprint`: kept when it holds tasks of the same
    prepare (True: a resumed run), else made anew (an earlier prepare's, of other inputs or
    settings, removed: lmforge wrote it).

    Raises:
        OutputError: `work` exists and lmforge did not write it.
    """
    own = work / OWN_FILE
    if work.exists() or work.is_symlink():
        if not own.is_file() or work.is_symlink():
            raise OutputError(f"{shown_path(work)} exists and is not the tasks' folder `lmforge prepare` writes (no "
                              f"{OWN_FILE}). Move it away or choose another --out; lmforge never deletes what it did "
                              f"not write.")
        try:
            if json.loads(own.read_text(encoding="utf-8")) == fingerprint:
                return True
        except (OSError, ValueError):
            pass
        shutil.rmtree(work)
    work.mkdir(parents=True)
    own.write_text(json.dumps(fingerprint, indent=2) + "\n", encoding="utf-8")
    return False


def make_job(work: Path, source: str, tokenizer, val_fraction: float, include_tests: bool, on_bad_utf8: str,
             text_field: str, tasks: int, threads: int, quality: Quality = Quality()) -> tuple[Job, int]:
    """The `Job` of a prepare of `source` in `tasks` tasks (`quality`: its filters and
    deduplication), its work folder opened (`open_work`: kept when it holds the same prepare's
    tasks); and the bytes of its input files."""
    files = list_inputs(source, include_tests, SourceStats())
    digest = listing_digest(source, include_tests, files)
    tok = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "contract.json"):  # the ids and the specials
        path = Path(tokenizer.folder) / name
        tok.update(name.encode() + (path.read_bytes() if path.is_file() else b"-"))
    fingerprint = {"version": 2, "source": source, "listing": digest, "tokenizer": tok.hexdigest(),
                   "val_fraction": val_fraction, "include_tests": include_tests, "on_bad_utf8": on_bad_utf8,
                   "text_field": text_field, "tasks": tasks, "chunk_records": stream_tasks.CHUNK_RECORDS,
                   **quality.settings()}
    open_work(work, fingerprint)
    job = Job(str(work), source, str(tokenizer.folder), val_fraction, include_tests, on_bad_utf8, text_field, tasks,
              digest, str(tokenizer.contract.dtype), threads=threads, filters=quality.filters, dedup=quality.dedup)
    return job, sum(f.size for f in files)


def prepare_tasks(tmp: Path, work: Path, source: str, tokenizer, val_fraction: float, include_tests: bool,
                  on_bad_utf8: str, text_field: str, workers: int, progress: bool, executor: str = "local",
                  address: str = "", quality: Quality = Quality()) -> tuple:
    """`prepare`'s shards written into `tmp` by `workers` tasks (module docstring), their files in
    `work` (removed here when inside `tmp`; `prepare` removes it once the data folder is in place); `executor` "ray": the tasks on a Ray cluster (`address`,
    or a local one `ray.init` starts; `work` must be on a file system its nodes share). Returns
    (split_meta, stats, duplicates, report) as `lmforge.data.prepare.prepare_into` uses them."""
    threads = max(1, cores() // workers)
    if executor == "ray":
        ray = errors.require_package("ray", "ray", "lmforge prepare --executor ray", errors.ConfigError)
        if not ray.is_initialized():
            ray.init(address=address or None, include_dashboard=False, log_to_driver=False)
        threads = 1
    job, input_bytes = make_job(work, source, tokenizer, val_fraction, include_tests, on_bad_utf8, text_field, workers,
                                threads, quality)
    for stage in job.stages:
        run_stage(job, stage, workers, progress, input_bytes, executor)
    split_meta, stats, duplicates, report = join(job, tmp)
    if tmp in work.parents:  # else `prepare` removes it once the data folder is in place
        shutil.rmtree(work)
    return split_meta, stats, duplicates, report


def join(job: Job, tmp: Path) -> tuple:
    """The tasks' shards concatenated in stream order into `tmp` ({split}.bin/.idx/.hashes), their
    counts summed and reports merged: (split_meta, stats, duplicates, report)."""
    n = job.tasks
    folders = [job.folder("tokenize", r) for r in range(n)]
    infos = [json.loads((f / "task.json").read_text()) for f in folders]
    plan = json.loads((job.folder("plan", 0) / "plan.json").read_text())
    split_meta = {}
    for split in SPLITS:
        chunks = [np.load(f / f"{split}.chunks.npy") for f in folders]
        order = np.argsort(np.concatenate(chunks), kind="stable")
        task = np.concatenate([np.full(len(c), r, dtype=np.int64) for r, c in enumerate(chunks)])[order]
        local = np.concatenate([np.arange(len(c), dtype=np.int64) for c in chunks])[order]
        offsets = [np.fromfile(f / f"{split}.idx", dtype=np.int64) for f in folders]
        lengths = np.concatenate([np.diff(o) for o in offsets])[order]
        with open(tmp / f"{split}.bin", "wb") as out:
            breaks = np.flatnonzero((task[1:] != task[:-1]) | (local[1:] != local[:-1] + 1)) + 1
            starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(task)]])
            sources = [open(f / f"{split}.bin", "rb") for f in folders]
            size = np.dtype(job.dtype).itemsize
            try:
                for s, e in zip(starts.tolist(), ends.tolist()):
                    if s == e:
                        continue
                    r, a, b = int(task[s]), int(local[s]), int(local[e - 1]) + 1
                    src = sources[r]
                    src.seek(int(offsets[r][a]) * size)
                    out.write(src.read(int(offsets[r][b] - offsets[r][a]) * size))
            finally:
                for src in sources:
                    src.close()
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64).tofile(tmp / f"{split}.idx")
        hashes = np.concatenate([np.fromfile(f / f"{split}{HASHES_SUFFIX}", dtype="<u8") for f in folders])
        hashes[order].astype("<u8").tofile(tmp / f"{split}{HASHES_SUFFIX}")
        metas = [i["splits"][split] for i in infos]
        split_meta[split] = {"documents": sum(m["documents"] for m in metas), "tokens": sum(m["tokens"] for m in metas),
                             "bytes": sum(m["bytes"] for m in metas), "max_id": max(m["max_id"] for m in metas)}
    stats = SourceStats()
    for key in ("documents", "bad_utf8", "empty"):
        setattr(stats, key, sum(i["stats"][key] for i in infos))
    stats.not_regular, stats.other = infos[0]["stats"]["not_regular"], infos[0]["stats"]["other"]
    listed = [name for at, name in infos[0]["skipped_at"] if at < 0]
    read = sorted((at, name) for i in infos for at, name in i["skipped_at"] if at >= 0)
    stats.skipped_names = (listed + [name for _, name in read])[:SKIPPED_NAMES]
    name_of = {(r, int(k)): v for r, i in enumerate(infos) for k, v in i["names"].items()}
    examples = [(name_of[tuple(kept)] if kept else "an earlier document", name_of[tuple(dropped)])
                for kept, dropped in plan["examples"]]
    parts = []
    for f in folders:
        with open(f / "report.pkl", "rb") as fh:
            parts.append(pickle.load(fh))
    report = DataReport.merged(parts, plan["duplicates"], examples)
    if "filtered" in plan:
        report.filtered = [{**f, "examples": [name_of[tuple(x)] for x in f["examples"]]} for f in plan["filtered"]]
    if "near" in plan:
        report.near_removed = {**plan["near"], "examples": [[name_of[tuple(k)], name_of[tuple(d)]]
                                                            for k, d in plan["near"]["examples"]]}
    return split_meta, stats, plan["duplicates"], report


__all__ = ["MIN_TASK_BYTES", "START_METHOD", "join", "make_job", "open_work", "prepare_tasks", "run_stage", "task_count"]
