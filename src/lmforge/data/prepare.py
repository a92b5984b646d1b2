"""Preparing a data folder (`lmforge prepare`): every document of a data.source tokenized into the
`{split}.bin` / `{split}.idx` shards that `shards.py` describes and reads, with `{split}.hashes`
(each document's content hash), meta.json, report.json and contract.json (`prepare`, or
`prepare_into` a folder being written). Exact duplicates are kept once (`hash64`, `SeenHashes`), so
no validation text is trained on. The folder is written through `lmforge.fileio.atomic_dir`: a
failed prepare leaves nothing half-written and the previous data folder intact.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from tqdm import tqdm

from lmforge.data.fast_encode import batch_encoder
from lmforge.data.inputs import SourceStats, source_path
from lmforge.data.data_report import DataReport
from lmforge.data.quality import DocFilters, Quality
from lmforge.data.shard_writer import (BATCH_DOCS, HASHES_SUFFIX, NAMED_DOCUMENTS, TASKS_MARKER, TASKS_SUFFIX,
                                       SeenHashes, ShardWriter, hash64)
from lmforge.data.sources import SPLITS, iter_documents
from lmforge.errors import DataError
from lmforge.fileio import atomic_dir
from lmforge.tokenizer import Tokenizer

META_FILE = "meta.json"
REPORT_FILE = "report.json"
PREPARE_OUTPUT = "prepare"


def prepare(
    source: str,
    tokenizer: Tokenizer,
    out_dir: str | Path,
    val_fraction: float = 0.02,
    include_tests: bool = False,
    on_bad_utf8: str = "skip",
    progress: bool = True,
    extra_files: dict[str, str] | None = None,
    seq_len: int = 0,
    text_field: str = "text",
    workers: int = 1,
    executor: str = "local",
    address: str = "",
    quality: Quality = Quality(),
) -> dict:
    """Tokenize every document of `source` (`text_field`: the records' text) into
    `out_dir`/{train,val}.{bin,idx}.

    Returns the meta dict written to meta.json: per split `documents`, `tokens`,
    `bytes` (UTF-8 bytes of the documents' text), `max_id`; and `skipped_bad_utf8`.
    `extra_files` ({name: text}) go into the folder too (the stage's config.toml). The data
    report (`lmforge.data.reports.DataReport`, measured against `seq_len`) goes into the folder as
    report.json and is returned under "report" (not in meta.json).
    Written through `lmforge.fileio.atomic_dir`: `out_dir` must be absent, empty or an
    earlier prepare's folder, and is replaced only once the new one is complete. `workers` > 1:
    that many tasks at once (`lmforge.data.parallel`), the same folder to the byte; their files
    are kept in `out_dir`.prepare-tasks until it is written, so a stopped run resumes with the
    tasks it had not finished; `executor` "ray" runs them on a Ray cluster (`address`, else one
    started on this machine). `quality`: data.filters and data.dedup (`lmforge.data.quality`);
    "minhash" always runs as tasks (one at `workers` = 1), the same folder at any number.
    Raises:
        DataError: missing/empty source, or a split left with no documents.
        OutputError: `out_dir` holds something else (a run, a tokenizer, a file...).
    """
    out = Path(out_dir)
    with atomic_dir(out, PREPARE_OUTPUT, what="`lmforge prepare`", inputs=[("data.source", source_path(source))]) as tmp:
        meta = prepare_into(tmp, source, tokenizer, val_fraction, include_tests, on_bad_utf8, progress, seq_len,
                            text_field, workers=workers, work=out.parent / f"{out.name}{TASKS_SUFFIX}",
                            executor=executor, address=address, quality=quality)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
    work = out.parent / f"{out.name}{TASKS_SUFFIX}"
    if (workers != 1 or quality.dedup == "minhash") and (work / TASKS_MARKER).is_file():  # the tasks' files, joined into `out`
        shutil.rmtree(work)
    return meta


def prepare_into(tmp: Path, source: str, tokenizer: Tokenizer, val_fraction: float, include_tests: bool,
                  on_bad_utf8: str, progress: bool, seq_len: int = 0, text_field: str = "text",
                  input: dict | None = None, workers: int = 1, work: Path | None = None,
                  executor: str = "local", address: str = "", quality: Quality = Quality()) -> dict:
    """`prepare`'s work in `tmp`, a folder its caller writes (`prepare`, a mixture's sources): shards,
    `{split}.hashes`, meta.json (with `input`, what a mixture compares to reuse it, when given),
    report.json, contract.json. Returns the meta dict with the data report under "report".
    `workers` > 1: that many tasks (`lmforge.data.parallel`, their files in `work`, kept for a
    resumed run until the folder is written), the same files as one process writes; 0: as many as
    the cores, fewer for a small input (`lmforge.data.parallel.task_count`). `quality`: the
    filters and near-duplicate removal asked for (`lmforge.data.quality`; MinHash runs as tasks).
    Raises:
        DataError: missing/empty source, or a split left with no documents.
        ConfigError: `quality` asks for filters or MinHash and spaCy is not installed.
    """
    contract = tokenizer.contract
    meta: dict = {"source": source, "val_fraction": val_fraction, "splits": {}}
    if input is not None:
        meta["input"] = input
    t0 = time.perf_counter()
    quality.require()
    if workers == 0:  # as many as the cores, one per MIN_TASK_BYTES of input at most
        from lmforge.data.parallel import task_count

        workers = task_count(source, include_tests)
    if workers > 1 or quality.dedup == "minhash":
        from lmforge.data.parallel import prepare_tasks

        split_meta, stats, duplicates, report = prepare_tasks(
            tmp, work if work is not None else tmp / ".tasks", source, tokenizer, val_fraction, include_tests,
            on_bad_utf8, text_field, max(1, workers), progress, executor, address, quality)
    else:
        stats, report = SourceStats(), DataReport()
        bar = tqdm(desc="prepare", unit="B", unit_scale=True, disable=not progress, mininterval=1.0)
        writer = ShardWriter(tmp, contract, report, batch_encoder(tokenizer), lambda: _show_progress(bar, stats, report, writer.split_meta))
        filters = DocFilters(quality.filters) if quality.filters else None
        try:
            duplicates = _write_unique(source, val_fraction, include_tests, on_bad_utf8, stats, text_field, report,
                                       writer.write, filters)
        finally:
            bar.close()  # the bar's last state ends with a newline before any error line
            writer.close()
        split_meta = writer.split_meta
        if filters is not None:
            report.filtered = filters.tally.report()
    check_splits(source, split_meta, stats, val_fraction)
    meta["splits"] = split_meta
    meta.update(skipped(stats, duplicates, report))
    meta["seconds"] = round(time.perf_counter() - t0, 2)
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    data_report = report.finish(seq_len)
    (tmp / REPORT_FILE).write_text(json.dumps(data_report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    contract.save(tmp)
    return {**meta, "report": data_report}


def _show_progress(bar, stats: SourceStats, report: DataReport, split_meta: dict) -> None:
    """Move the prepare bar to the input bytes read so far (its total once the source is listed)."""
    if bar.total is None and stats.input_bytes:
        bar.total = stats.input_bytes
    bar.update(max(0, min(stats.input_read(), stats.input_bytes) - bar.n))
    text = sum(m["bytes"] for m in split_meta.values())
    bar.set_postfix_str(f"{report.documents:,} documents, {text / 1e6:,.1f} MB of text", refresh=False)


def _write_unique(source: str, val_fraction: float, include_tests: bool, on_bad_utf8: str, stats: SourceStats,
                  text_field: str, report: DataReport, write, filters: DocFilters | None = None) -> int:
    """Pass the first copy of each document of `source` to `write`, in batches of BATCH_DOCS
    (document, split, hash64, UTF-8 bytes) tuples; report the exact duplicates dropped and return
    their count. `filters`: a document one of them removes is counted in its tally, not written
    (nor counted a duplicate)."""
    from lmforge.data.sources import split_of

    batch: list = []
    seen = SeenHashes()
    names: dict[int, str] = {}
    duplicates = 0
    for doc in iter_documents(source, None, val_fraction, include_tests, on_bad_utf8, stats, text_field):
        data = doc.text.encode("utf-8")
        verdict = filters.verdict(doc.text) if filters is not None else 0
        if verdict:
            filters.tally.add(verdict, doc.name, len(data))
            continue
        h = hash64(data)
        if not seen.add(h):  # exact duplicates are kept once, so no val text is trained on
            duplicates += 1
            report.duplicate(names.get(h, "an earlier document"), doc.name)
            continue
        if len(names) < NAMED_DOCUMENTS:
            names[h] = doc.name
        batch.append((doc, split_of(doc.key, val_fraction), h, len(data)))
        if len(batch) >= BATCH_DOCS:
            write(batch)
            batch = []
    if batch:
        write(batch)
    return duplicates


def check_splits(source: str, split_meta: dict, stats: SourceStats, val_fraction: float) -> None:
    """DataError when the source gave no document at all, or a split none."""
    total = sum(m["documents"] for m in split_meta.values())
    if total == 0:
        raise DataError(
            f"data.source = {source!r} yielded no documents (all empty or skipped: "
            f"{stats.bad_utf8} not UTF-8, {stats.empty} empty, {stats.not_regular} not regular files, "
            f"{stats.other} files of other types" + (f": {', '.join(stats.skipped_names[:3])}"
                                                      if stats.skipped_names else "")
            + "). Point data.source at real text."
        )
    for s in SPLITS:
        if split_meta[s]["documents"] == 0:
            raise DataError(
                f"data.source = {source!r}: the {s!r} split has no documents ({total} in all, "
                f"data.val_fraction = {val_fraction}). Add documents or change data.val_fraction"
                + (f" (about 3 of {total} documents: --set data.val_fraction={min(0.5, 3 / total):.2g})."
                   if s == "val" and total >= 6 else ".")
            )


def skipped(stats: SourceStats, duplicates: int, report: DataReport | None = None) -> dict:
    """meta.json's counts of what was not kept (and the first 20 names skipped), in its order;
    with `report`'s filters and near-duplicates removed, when asked for."""
    extra = {}
    if report is not None and report.filtered is not None:
        extra["skipped_filtered"] = {f["name"]: f["documents"] for f in report.filtered}
    if report is not None and report.near_removed is not None:
        extra["skipped_near_duplicates"] = report.near_removed["documents"]
    return {"skipped_bad_utf8": stats.bad_utf8, "skipped_empty": stats.empty,
            "skipped_not_regular": stats.not_regular, "skipped_other": stats.other,
            "skipped_names": stats.skipped_names[:20], "skipped_duplicates": duplicates, **extra}


__all__ = ["BATCH_DOCS", "TASKS_MARKER", "TASKS_SUFFIX", "ShardWriter", "check_splits", "skipped", "HASHES_SUFFIX", "META_FILE", "PREPARE_OUTPUT", "REPORT_FILE", "SeenHashes", "hash64", "prepare",
           "prepare_into"]
