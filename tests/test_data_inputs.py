"""Corpora in the shapes the field ships them (issue 33): a folder or a glob of record shards,
compressed JSONL, Parquet shards, a `datasets` save_to_disk folder, a text field of the user's
choosing — each prepared into the same bytes as the same documents in one JSONL file.

D1 the same documents as one JSONL, a .jsonl.gz, a .jsonl.zst (one frame, or several with a skippable
   one between), a .jsonl.bz2, a .jsonl.xz (two streams each), a glob of Parquet shards, a
   folder of JSONL shards and a save_to_disk folder give byte-identical train/val .bin/.idx
   (records are split by content, so the split is the same too); a text folder and a glob of its
   files give the same shards (text files are split by their path from the source).
D3 a bad record in the third shard of a glob is named by file and line, and prepare leaves
   nothing behind.
D4 a missing data.text_field exits 2 naming the fields the record has.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "robustness"))
from test_bad_inputs import tree_hash  # noqa: E402

from lmforge.data.prepare import prepare
from lmforge.data.sources import iter_documents
from lmforge.errors import DataError

SHARD_FILES = ("train.bin", "train.idx", "val.bin", "val.idx")


def texts_of(corpus: Path) -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted(corpus.glob("*.py"))]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def shards(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in SHARD_FILES}


def prepared(source: str | Path, tok, out: Path, val_fraction: float = 0.2, text_field: str = "text") -> dict:
    prepare(str(source), tok, out, val_fraction, progress=False, text_field=text_field)
    return shards(out)


def test_every_record_format_gives_the_same_shards(tiny_corpus, tiny_tokenizer, tmp_path):
    """D1."""
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = texts_of(tiny_corpus)
    base = prepared(write_jsonl(tmp_path / "all.jsonl", texts), tiny_tokenizer, tmp_path / "out-jsonl")
    assert len(base["val.idx"]) > 8 and len(base["train.idx"]) > 8  # both splits hold documents
    sources: dict[str, Path | str] = {}
    with gzip.open(tmp_path / "all.jsonl.gz", "wb") as f:
        f.write((tmp_path / "all.jsonl").read_bytes())
    sources["jsonl.gz"] = tmp_path / "all.jsonl.gz"
    zstd = pytest.importorskip("zstandard")
    (tmp_path / "all.jsonl.zst").write_bytes(zstd.ZstdCompressor(level=3).compress((tmp_path / "all.jsonl").read_bytes()))
    sources["jsonl.zst"] = tmp_path / "all.jsonl.zst"
    import bz2
    import lzma
    import struct

    body = (tmp_path / "all.jsonl").read_bytes()
    half = body.index(b"\n", len(body) // 2) + 1
    (tmp_path / "all.jsonl.bz2").write_bytes(bz2.compress(body[:half]) + bz2.compress(body[half:]))  # two streams
    (tmp_path / "all.jsonl.xz").write_bytes(lzma.compress(body[:half]) + lzma.compress(body[half:]))
    skippable = struct.pack("<II", 0x184D2A50, 4) + b"skip"  # a frame readers pass over
    (tmp_path / "frames.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(body[:half]) + skippable
                                                + zstd.ZstdCompressor().compress(body[half:]))
    sources.update({"jsonl.bz2": tmp_path / "all.jsonl.bz2", "jsonl.xz": tmp_path / "all.jsonl.xz",
                    "zst frames": tmp_path / "frames.jsonl.zst"})
    parts = [texts[:13], texts[13:27], texts[27:]]
    (tmp_path / "pq").mkdir()
    for i, part in enumerate(parts):  # shard names sort in document order
        pq.write_table(pa.table({"text": part, "n": list(range(len(part)))}), tmp_path / "pq" / f"part-{i:05d}.parquet")
    sources["glob of parquet"] = str(tmp_path / "pq" / "*.parquet")
    (tmp_path / "shards").mkdir()
    for i, part in enumerate(parts):
        write_jsonl(tmp_path / "shards" / f"{i:03d}.jsonl", part)
    sources["folder of jsonl shards"] = tmp_path / "shards"
    sources["content field"] = write_jsonl(tmp_path / "content.jsonl", texts, field="content")
    for name, source in sources.items():
        field = "content" if name == "content field" else "text"
        assert prepared(source, tiny_tokenizer, tmp_path / f"out-{len(name)}-{name[:5]}", text_field=field) == base, name


def test_a_save_to_disk_folder_gives_the_same_shards(tiny_corpus, tiny_tokenizer, tmp_path):
    """D1, the folder `datasets` itself writes (several Arrow files, read in state.json's order)."""
    datasets = pytest.importorskip("datasets")
    texts = texts_of(tiny_corpus)
    base = prepared(write_jsonl(tmp_path / "all.jsonl", texts), tiny_tokenizer, tmp_path / "out-jsonl")
    ds = datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    assert len(list((tmp_path / "saved").glob("*.arrow"))) == 3
    assert prepared(tmp_path / "saved", tiny_tokenizer, tmp_path / "out-saved") == base


def test_a_text_folder_and_a_glob_of_its_files_give_the_same_shards(tiny_corpus, tiny_tokenizer, tmp_path):
    """D1 for text files: they are split by their path from the source (an edit never moves a
    file between splits; records are split by content), so a glob names them as the folder does."""
    a = prepared(tiny_corpus, tiny_tokenizer, tmp_path / "out-folder")
    b = prepared(str(tiny_corpus / "*.py"), tiny_tokenizer, tmp_path / "out-glob")
    assert a == b and len(a["val.idx"]) > 8


def test_a_bad_record_in_the_third_shard_is_named_and_nothing_is_left_behind(tiny_corpus, tiny_tokenizer, tmp_path):
    """D3."""
    texts = texts_of(tiny_corpus)
    (tmp_path / "c").mkdir()
    for i, part in enumerate([texts[:10], texts[10:20], texts[20:30]]):
        write_jsonl(tmp_path / "c" / f"shard-{i}.jsonl", part)
    third = tmp_path / "c" / "shard-2.jsonl"
    lines = third.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[3] = '{"id": 3, "text": "unterminated\n'
    third.write_text("".join(lines), encoding="utf-8")
    before = tree_hash(tmp_path / "c")
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"shard-2\.jsonl:4: not valid JSON"):
        prepare(str(tmp_path / "c" / "shard-*.jsonl"), tiny_tokenizer, out, 0.2, progress=False)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["c"]  # no half-written shard
    assert tree_hash(tmp_path / "c") == before


def test_a_damaged_compressed_file_is_named_with_the_last_good_line(tiny_corpus, tmp_path):
    raw = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts_of(tiny_corpus)).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz: damaged or cut short after line \d+"):
        list(iter_documents(str(tmp_path / "cut.jsonl.gz")))


@pytest.mark.parametrize("kind", [".jsonl.gz", ".jsonl.zst", ".jsonl.bz2", ".jsonl.xz"])
def test_a_compressed_file_cut_anywhere_is_an_error_never_fewer_documents(tmp_path, kind):
    """Cut at any byte (a frame or stream boundary of a multi-frame file included), a compressed
    JSONL file gives every document or a DataError naming it: never a silent part of it."""
    import bz2
    import lzma

    zstandard = pytest.importorskip("zstandard") if kind == ".jsonl.zst" else None
    compress = {".jsonl.gz": gzip.compress, ".jsonl.bz2": bz2.compress, ".jsonl.xz": lzma.compress,
                ".jsonl.zst": lambda b: zstandard.ZstdCompressor().compress(b)}[kind]
    bodies = [("".join(json.dumps({"text": f"part {p} document {i} " * 5}) + "\n" for i in range(150))).encode()
              for p in range(2)]
    first, second = compress(bodies[0]), compress(bodies[1])
    whole = first + second
    path = tmp_path / f"c{kind}"
    for keep in sorted({1, 8, len(first) // 2, len(first) - 1, len(first) + 1, len(first) + 10,
                        len(whole) - len(second) // 2, len(whole) - 1}):
        path.write_bytes(whole[:keep])
        with pytest.raises(DataError, match=rf"c{kind.replace('.', '[.]')}: damaged or cut short after line \d+"):
            list(iter_documents(str(path)))
    path.write_bytes(whole)
    assert len(list(iter_documents(str(path)))) == 300


@pytest.mark.parametrize("kind", [".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet"])
def test_progress_counts_the_input_files_bytes_on_disk_to_their_total(tmp_path, kind):
    """The ETA's measure: `SourceStats.input_read()` counts bytes of the files on disk (compressed
    as they are), never goes back, moves inside a file (a single file is most of a corpus), and
    ends at the listed total."""
    from lmforge.data.sources import SourceStats

    import random

    rng = random.Random(0)  # text that compresses little: a compressed shard larger than the readers' buffers
    texts = [rng.randbytes(600).hex() for _ in range(4500)]  # 1.8 MB a shard: past the 1 MiB read buffer
    (tmp_path / "c").mkdir()
    for i in range(3):
        part = texts[i::3]
        body = "".join(json.dumps({"text": t}) + "\n" for t in part).encode()
        path = tmp_path / "c" / f"shard-{i}{kind}"
        if kind == ".jsonl.gz":
            path.write_bytes(gzip.compress(body))
        elif kind == ".jsonl.zst":
            zstandard = pytest.importorskip("zstandard")
            path.write_bytes(zstandard.ZstdCompressor().compress(body))
        elif kind == ".parquet":
            pa = pytest.importorskip("pyarrow")
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": part}), path, row_group_size=50)
        else:
            path.write_bytes(body)
    total = sum(p.stat().st_size for p in (tmp_path / "c").iterdir())
    stats = SourceStats()
    seen = [stats.input_read() for _ in iter_documents(str(tmp_path / "c"), stats=stats)]
    assert stats.input_bytes == total
    assert seen == sorted(seen) and stats.input_read() == total
    first = (tmp_path / "c" / f"shard-0{kind}").stat().st_size
    assert any(0 < x < first for x in seen), seen[:5]  # within the first file, before its end


def test_a_shard_that_changes_or_goes_between_listing_and_reading_is_an_error(tiny_corpus, tmp_path):
    texts = texts_of(tiny_corpus)
    (tmp_path / "c").mkdir()
    for i in range(3):
        write_jsonl(tmp_path / "c" / f"shard-{i}.jsonl", texts[i * 5: i * 5 + 5])
    docs = iter_documents(str(tmp_path / "c"))
    next(docs)  # listed, and shard-0 opened
    with open(tmp_path / "c" / "shard-1.jsonl", "a", encoding="utf-8") as f:  # grows after the listing
        f.write(json.dumps({"text": "one more"}) + "\n")
    with pytest.raises(DataError, match=r"shard-1\.jsonl: changed while the corpus was read \(\d[\d,]* bytes when "
                                        r"listed, [\d,]+ now"):
        list(docs)
    docs = iter_documents(str(tmp_path / "c"))
    next(docs)
    (tmp_path / "c" / "shard-2.jsonl").unlink()
    with pytest.raises(DataError, match=r"shard-2\.jsonl does not exist \(it was listed: did it move\?\)"):
        list(docs)


def test_a_glob_that_matches_nothing_says_so(tmp_path):
    with pytest.raises(DataError, match=r"matches no .* file or record shard"):
        list(iter_documents(str(tmp_path / "none-*.parquet")))


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_missing_text_field_exits_2_naming_the_fields_present(tiny_run, tmp_path, kind):
    """D4: `lmforge prepare` with data.text_field = "body" on records that hold "content" and "id"."""
    cfg, _ = tiny_run
    texts = ["def f():\n    return 1\n", "x = 2\n"]
    if kind == "jsonl":
        source = write_jsonl(tmp_path / "c.jsonl", texts, field="content")
        expected = r"c\.jsonl:1: the record has no \"body\" field \(its fields: \['content', 'id'\]\)"
    else:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        source = tmp_path / "c.parquet"
        pq.write_table(pa.table({"content": texts, "id": [0, 1]}), source)
        expected = r"c\.parquet: no 'body' column \(columns: \['content', 'id'\]\)\. Set data\.text_field"
    cfg.save(tmp_path / "cfg.toml")
    res = subprocess.run([sys.executable, "-m", "lmforge", "prepare", "--config", str(tmp_path / "cfg.toml"),
                          "--set", f"data.source={source}", "--set", "data.text_field=body", "--out",
                          str(tmp_path / "out"), "--no-progress"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    import re

    assert re.search(expected, res.stderr), res.stderr[-2000:]
    assert "Set data.text_field" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()


def test_one_encoding_thread_and_several_give_the_same_shards(tiny_corpus, tiny_tokenizer, tmp_path, monkeypatch):
    """D2: prepare encodes with every core (tiktoken's threads, `data.fast_encode`); one thread
    gives the same bytes."""
    from lmforge.data import prepare as preparing

    texts = texts_of(tiny_corpus) * 3  # more documents than one encoding batch's worth of threads
    for i in range(len(texts)):
        texts[i] = f"# {i}\n" + texts[i]  # distinct: exact duplicates would be dropped
    source = write_jsonl(tmp_path / "c.jsonl", texts)
    real = preparing.batch_encoder
    outs = []
    for threads in (1, 3):
        monkeypatch.setattr(preparing, "batch_encoder", lambda tok, threads=threads: real(tok, threads=threads))
        outs.append(prepared(source, tiny_tokenizer, tmp_path / f"out-{threads}"))
    assert outs[0] == outs[1] and len(outs[0]["train.idx"]) > 8 * 100


def test_an_interrupted_prepare_is_said_and_starts_over(tiny_corpus, tiny_tokenizer, tmp_path, capsys):
    """A prepare killed before it could clean up (SIGKILL) leaves its unfinished temporary
    folder beside data.dir; the next prepare says so, removes it, and starts over. A temporary of
    a live process and a folder that only looks alike are left alone."""
    import os

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "data"
    stale = tmp_path / f".data.tmp-{dead.pid}-k1ll3d"
    (stale / "sub").mkdir(parents=True)
    (stale / "train.bin").write_bytes(b"\0" * 4096)
    live = tmp_path / f".data.tmp-{os.getppid()}-alive1"
    live.mkdir()
    other = tmp_path / ".data.tmp-mine"
    other.mkdir()
    prepare(str(tiny_corpus), tiny_tokenizer, out, 0.2, progress=False)
    err = capsys.readouterr().err
    assert f"{stale.name} (0.0 MiB) is removed, never read, and this one starts over" in err
    assert f"process {dead.pid} is gone" in err
    assert not stale.exists() and live.is_dir() and other.is_dir()
    assert (out / "train.bin").is_file() and not list(tmp_path.glob(f".data.tmp-{os.getpid()}-*"))


def _hub_cache(root: Path, repo: str, files: dict[str, bytes], revision: str = "c" * 40) -> Path:
    """`repo` in a Hugging Face hub cache at `root`, laid out as huggingface_hub writes it:
    blobs/SHA, snapshots/REVISION/PATH links to them, refs/main naming the revision."""
    import hashlib
    import os

    folder = root / f"datasets--{repo.replace('/', '--')}"
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = folder / "snapshots" / revision / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(revision)
    return folder


def test_a_dataset_in_the_hugging_face_cache_is_read_by_name_never_downloaded(tiny_corpus, tiny_tokenizer, tmp_path,
                                                                              monkeypatch):
    """data.source = "hf:OWNER/NAME[:PATTERN]" reads the cached snapshot (huggingface_hub's own lookup,
    local files only): the same shards as the same records in one JSONL; a pattern picks files inside
    it; a dataset not in the cache is a DataError that names the download command, and nothing is
    fetched (the network is not touched: HF_HUB_OFFLINE is not needed)."""
    pytest.importorskip("huggingface_hub")
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = texts_of(tiny_corpus)
    base = prepared(write_jsonl(tmp_path / "all.jsonl", texts), tiny_tokenizer, tmp_path / "out-jsonl")
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": texts[20:]}), buf)
    files = {"data/train-00000-of-00002.jsonl": "".join(json.dumps({"text": t}) + "\n" for t in texts[:20]).encode(),
             "data/train-00001-of-00002.parquet": buf.getvalue().to_pybytes(),
             "README.md": b"---\nlicense: mit\n---\n# not a document of the pattern\n"}
    cache = tmp_path / "hub"
    _hub_cache(cache, "me/notes", files)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert prepared("hf:me/notes:data/*", tiny_tokenizer, tmp_path / "out-hf") == base
    assert prepared("hf:me/notes:data", tiny_tokenizer, tmp_path / "out-hf-folder") == base
    with pytest.raises(DataError, match=r"not in the local Hugging Face cache .*hf download me/absent --repo-type "
                                        r"dataset"):
        prepare("hf:me/absent", tiny_tokenizer, tmp_path / "never", 0.2, progress=False)
    with pytest.raises(DataError, match=r"revision 0123abc.*hf download me/notes --repo-type dataset --revision "
                                        r"0123abc"):
        prepare("hf:me/notes@0123abc", tiny_tokenizer, tmp_path / "never", 0.2, progress=False)
    with pytest.raises(DataError, match="expected hf:OWNER/NAME"):
        prepare("hf:a/b/c", tiny_tokenizer, tmp_path / "never", 0.2, progress=False)
    assert not (tmp_path / "never").exists()


def test_seen_hashes_find_every_repeat_across_merges():
    """Exact deduplication in 8 bytes a document (`SeenHashes`): a hash seen before is found
    whether it is still in the recent set or merged into the sorted array, for values on both
    sides of 2**63 (where numpy's scalar conversion once made each lookup convert the array)."""
    import random

    from lmforge.data.prepare import SeenHashes, hash64

    rng = random.Random(3)
    values = [0, 1, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 1] + [rng.getrandbits(64) for _ in range(500)]
    seen = SeenHashes(buffer=7)  # merged every 7 new hashes
    assert [seen.add(v) for v in values] == [True] * len(values)
    assert len(seen.sorted) > len(values) - 7 and seen.sorted.dtype.name == "uint64"
    assert [seen.add(v) for v in reversed(values)] == [False] * len(values)
    fresh = [v for v in (rng.getrandbits(64) for _ in range(200)) if v not in set(values)]
    assert [seen.add(v) for v in fresh] == [True] * len(fresh)
    assert hash64(b"abc") == int("ba7816bf8f01cfea", 16)  # sha256("abc")'s first 8 bytes, big-endian
