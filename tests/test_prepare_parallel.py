"""`lmforge prepare` on several tasks (data.workers; lmforge.data.parallel on datatrove's local
executor): the data folder is the one a single process writes, to the byte, for N = 1, 2, 3, on
the embedded corpus and on a folder of every format with duplicates across tasks; checked against
a per-document recomputation; a stopped prepare resumes with the tasks it had not finished; bad
input is an LmforgeError naming the file and line, and nothing of the user's is touched."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "robustness"))
from test_bad_inputs import tree_hash  # noqa: E402

from lmforge.data import parallel, stream_tasks  # noqa: E402
from lmforge.data.data_report import SHINGLE, DataReport  # noqa: E402
from lmforge.data.prepare import TASKS_SUFFIX, prepare  # noqa: E402
from lmforge.data.sources import iter_documents, split_of  # noqa: E402
from lmforge.errors import DataError  # noqa: E402
from lmforge.fileio import OutputError  # noqa: E402


def folder_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file of a data folder; meta.json without its "seconds" (wall time)."""
    out = {}
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        if f.name == "meta.json":
            meta = json.loads(data)
            meta.pop("seconds")
            data = json.dumps(meta, sort_keys=True).encode()
        out[f.name] = hashlib.sha256(data).hexdigest()
    return out


@pytest.fixture
def small_tasks(monkeypatch):
    """Tasks for any input size, and chunks of 3 records, so that a small corpus is dealt to
    several tasks in many turns (the forked tasks inherit the patched modules)."""
    monkeypatch.setattr(parallel, "MIN_TASK_BYTES", 1)
    monkeypatch.setattr(stream_tasks, "CHUNK_RECORDS", 3)


def mixed_corpus(root: Path, texts: list[str]) -> Path:
    """A folder of every format lmforge reads, with exact duplicates in other files (other tasks),
    empty records, blank lines and a file that is not UTF-8."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    import zstandard

    folder = root / "mixed"
    folder.mkdir()
    for i, t in enumerate(texts[:6]):
        (folder / f"a{i}.py").write_text(t, encoding="utf-8")
    (folder / "b_dup.txt").write_text(texts[0], encoding="utf-8")  # a duplicate of a0.py
    (folder / "b_latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    lines = [json.dumps({"text": t}) for t in texts[6:20]] + ["", json.dumps({"text": ""}),
                                                              json.dumps({"text": texts[3]})]
    (folder / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with gzip.open(folder / "d.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[20:28] + [texts[8]])
    (folder / "e.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": t}) + "\n" for t in texts[28:34]).encode()))
    (folder / "f.jsonl.bz2").write_bytes(bz2.compress(
        "".join(json.dumps({"text": t}) + "\n" for t in texts[34:38] + texts[20:22]).encode()))
    rows = [f"{t}# row {i}\n" for i, t in enumerate(texts[:20])]  # one batch of many chunks: rows in order
    pq.write_table(pa.table({"text": texts[38:] + [None, texts[30]] + rows + [rows[5]]}), folder / "g.parquet")
    return folder


def reference(source: str, tok, val_fraction: float) -> dict[str, list[np.ndarray]]:
    """Per document, recomputed: the first copy of each text, encoded on its own, in order."""
    seen, out = set(), {"train": [], "val": []}
    c = tok.contract
    for doc in iter_documents(source, None, val_fraction):
        if doc.text in seen:
            continue
        seen.add(doc.text)
        ids = tok.hf.encode(doc.text, add_special_tokens=False).ids
        out[split_of(doc.key, val_fraction)].append(np.array([*c.document_start, *ids, c.eos_id]))
    return out


def read_split(folder: Path, split: str, dtype) -> list[np.ndarray]:
    tokens = np.fromfile(folder / f"{split}.bin", dtype=dtype)
    idx = np.fromfile(folder / f"{split}.idx", dtype=np.int64)
    return [tokens[a:b] for a, b in zip(idx[:-1], idx[1:])]


@pytest.mark.slow
def test_the_embedded_corpus_gives_the_same_folder_at_any_number_of_tasks(tiny_tokenizer, tmp_path, monkeypatch):
    """The standard library (the speedrun's corpus), 1, 2 and 3 tasks: every file the same."""
    monkeypatch.setattr(parallel, "MIN_TASK_BYTES", 1)
    digests = {}
    for n in (1, 2, 3):
        meta = prepare("stdlib", tiny_tokenizer, tmp_path / f"n{n}", val_fraction=0.05, progress=False, workers=n)
        digests[n] = folder_digest(tmp_path / f"n{n}")
        assert not (tmp_path / f"n{n}{TASKS_SUFFIX}").exists()  # the tasks' files are gone once it is written
    assert meta["splits"]["train"]["documents"] > 500
    assert digests[2] == digests[1] and digests[3] == digests[1]


@pytest.mark.slow
def test_every_format_with_duplicates_across_tasks_gives_the_one_process_folder(tiny_tokenizer, tiny_corpus, tmp_path,
                                                                                small_tasks):
    texts = [p.read_text(encoding="utf-8") for p in sorted(tiny_corpus.glob("*.py"))]
    source = str(mixed_corpus(tmp_path, texts))
    metas, digests = {}, {}
    for n in (1, 2, 3):
        metas[n] = prepare(source, tiny_tokenizer, tmp_path / f"n{n}", val_fraction=0.2, progress=False, workers=n)
        digests[n] = folder_digest(tmp_path / f"n{n}")
    assert digests[2] == digests[1] and digests[3] == digests[1]
    meta = metas[3]
    assert meta["skipped_duplicates"] == 7 and meta["skipped_bad_utf8"] == 1 and meta["skipped_empty"] == 1
    assert meta["report"]["exact_duplicates_dropped"]["count"] == 7
    assert meta["report"]["exact_duplicates_dropped"]["examples"][0] == ["a0.py", "b_dup.txt"]
    want = reference(source, tiny_tokenizer, 0.2)
    for split in ("train", "val"):
        got = read_split(tmp_path / "n3", split, tiny_tokenizer.contract.dtype)
        assert len(got) == len(want[split]) > 0
        assert all(np.array_equal(a, b) for a, b in zip(got, want[split]))


def test_a_stopped_prepare_resumes_with_the_tasks_it_had_not_finished(tiny_tokenizer, tiny_corpus, tmp_path,
                                                                      small_tasks, monkeypatch):
    texts = [p.read_text(encoding="utf-8") for p in sorted(tiny_corpus.glob("*.py"))]
    source = str(mixed_corpus(tmp_path, texts))
    out, work = tmp_path / "data", tmp_path / f"data{TASKS_SUFFIX}"
    ran = tmp_path / "ran"
    ran.mkdir()
    run = stream_tasks.TokenizeTask.run

    def stopped(self, rank, folder):  # task 1 dies once task 0 is recorded complete
        (ran / f"{rank}-{len(list(ran.iterdir()))}").touch()
        if rank == 1 and not (tmp_path / "stopped").exists():
            (tmp_path / "stopped").touch()
            import time

            marker = work / "logs" / "tokenize" / "completions" / "00000"
            for _ in range(600):
                if marker.exists():
                    break
                time.sleep(0.05)
            raise RuntimeError("task 1 killed")
        return run(self, rank, folder)

    monkeypatch.setattr(stream_tasks.TokenizeTask, "run", stopped)
    with pytest.raises(RuntimeError, match="task 1 killed"):
        prepare(source, tiny_tokenizer, out, val_fraction=0.2, progress=False, workers=2)
    assert not out.exists() and (work / "tokenize" / "00000").is_dir() and not (work / "tokenize" / "00001").exists()
    for f in ran.iterdir():
        f.unlink()
    prepare(source, tiny_tokenizer, out, val_fraction=0.2, progress=False, workers=2)
    assert sorted(f.name.split("-")[0] for f in ran.iterdir()) == ["1"]  # task 0 was not run again
    assert not work.exists()
    fresh = prepare(source, tiny_tokenizer, tmp_path / "one", val_fraction=0.2, progress=False, workers=1)
    assert folder_digest(out) == folder_digest(tmp_path / "one") and fresh["splits"]["val"]["documents"] > 0


def test_a_bad_record_in_a_task_names_its_file_and_line_and_keeps_the_previous_folder(tiny_tokenizer, tiny_corpus,
                                                                                      tmp_path, small_tasks):
    texts = [p.read_text(encoding="utf-8") for p in sorted(tiny_corpus.glob("*.py"))]
    corpus = mixed_corpus(tmp_path, texts)
    out = tmp_path / "data"
    prepare(str(corpus), tiny_tokenizer, out, val_fraction=0.2, progress=False, workers=2)
    before = tree_hash(out)
    with open(corpus / "c.jsonl", "a", encoding="utf-8") as f:
        f.write('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"c\.jsonl:19: not valid JSON"):
        prepare(str(corpus), tiny_tokenizer, out, val_fraction=0.2, progress=False, workers=3)
    assert tree_hash(out) == before
    assert not (tmp_path / f"data{TASKS_SUFFIX}").exists()  # bad input: nothing to resume, the tasks' files removed


def test_a_tasks_folder_lmforge_did_not_write_is_refused_untouched(tiny_tokenizer, tiny_corpus, tmp_path, small_tasks):
    work = tmp_path / f"data{TASKS_SUFFIX}"
    work.mkdir()
    (work / "mine.txt").write_text("the user's")
    before = tree_hash(work)
    with pytest.raises(OutputError, match="not the tasks' folder"):
        prepare(str(tiny_corpus), tiny_tokenizer, tmp_path / "data", val_fraction=0.2, progress=False, workers=2)
    assert tree_hash(work) == before and not (tmp_path / "data").exists()


def test_batched_signatures_equal_one_document_at_a_time():
    """`signatures_of` (every document of a batch at once) against the per-document MinHash of
    the module docstring, recomputed here: short documents, repeats, long ones."""
    r = DataReport()
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50_000, size=n) for n in (1, 2, 4, 5, 6, 9, 100, 3000)] + [rng.integers(0, 3, size=50)]

    def one(ids):
        ids = np.asarray(ids, dtype=np.uint64)
        if len(ids) < SHINGLE:
            ids = np.concatenate([ids, np.zeros(SHINGLE - len(ids), dtype=np.uint64)])
        grams = np.lib.stride_tricks.sliding_window_view(ids, SHINGLE)
        with np.errstate(over="ignore"):
            h = (grams * r.mul).sum(axis=1, dtype=np.uint64) * r.a[0] + r.b[0]
            h ^= h >> np.uint64(31)
            h *= r.a[1]
        out = []
        for bucket in range(64):
            inside = h[(h >> np.uint64(58)) == bucket]
            out.append(int(inside.min()) & ((1 << 57) - 1) if len(inside) else None)
        sig = []
        for b in range(64):
            d = next(d for d in range(64) if out[(b + d) % 64] is not None)
            sig.append(((out[(b + d) % 64] + d * (1 << 57)) % (1 << 64)) >> 31)
        return np.array(sig, dtype=np.uint32)

    batch = r.signatures_of(docs)
    assert batch.shape == (len(docs), 64) and batch.dtype == np.uint32
    for d, s in zip(docs, batch):
        assert np.array_equal(s, one(d))


KILLED_TASK = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from lmforge.data import parallel, stream_tasks
from lmforge.data.prepare import prepare
from lmforge.tokenizer import Tokenizer
parallel.MIN_TASK_BYTES, stream_tasks.CHUNK_RECORDS = 1, 3
run = stream_tasks.TokenizeTask.run
def killed(self, rank, folder):  # task 1's process killed as the kernel kills one out of memory
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return run(self, rank, folder)
stream_tasks.TokenizeTask.run = killed
prepare({source!r}, Tokenizer.load({tok!r}), {out!r}, val_fraction=0.2, progress=False, workers=2)
"""


def test_a_task_killed_by_the_kernel_stops_the_prepare_instead_of_hanging_it(tiny_tokenizer, tiny_corpus, tmp_path,
                                                                             small_tasks):
    """datatrove's pool waits for ever for a task whose process was killed (SIGKILL: the kernel's
    out-of-memory killer); lmforge's executor watches its processes and stops the stage with an
    error that says what happened; the same command again resumes and writes the one-process folder."""
    import subprocess

    texts = [p.read_text(encoding="utf-8") for p in sorted(tiny_corpus.glob("*.py"))]
    source = str(mixed_corpus(tmp_path, texts))
    out, work = tmp_path / "data", tmp_path / f"data{TASKS_SUFFIX}"
    code = KILLED_TASK.format(tests=str(Path(__file__).parent), source=source, tok=str(tiny_tokenizer.folder),
                              out=str(out))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "stage ended before it finished (signal SIGKILL" in done.stderr, done.stderr[-2000:]
    assert "run the same command again to resume" in done.stderr
    assert not out.exists() and (work / "hash" / "00001").is_dir()  # the finished stage is kept
    prepare(source, tiny_tokenizer, out, val_fraction=0.2, progress=False, workers=2)
    prepare(source, tiny_tokenizer, tmp_path / "one", val_fraction=0.2, progress=False, workers=1)
    assert folder_digest(out) == folder_digest(tmp_path / "one") and not work.exists()
