"""Corpus sources, the train/val split, bad input, and the prepared shard format."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from lmforge.contract import Contract
from lmforge.data.shards import META_FILE, Shard, preflight
from lmforge.data.prepare import prepare
from lmforge.data.sources import (
    SourceStats,
    iter_documents,
    module_name,
    split_of,
)
from lmforge.data.inputs import stdlib_root
from lmforge.errors import ContractError, DataError
from lmforge.stages import prepare_stage
from lmforge.tokenizer import Tokenizer

from conftest import make_corpus, tiny_config


# -- the standard library ---------------------------------------------------------------
@pytest.fixture(scope="module")
def stdlib_docs():
    stats = SourceStats()
    docs = list(iter_documents("stdlib", stats=stats))
    return docs, stats


def test_stdlib_excludes_site_packages_and_tests(stdlib_docs):
    docs, stats = stdlib_docs
    assert len(docs) > 300 and stats.documents == len(docs)
    root = stdlib_root()
    for d in docs:
        parts = Path(d.name).parts
        assert d.name.endswith(".py")
        assert "site-packages" not in parts and "dist-packages" not in parts, d.name
        assert "test" not in parts and "tests" not in parts, d.name
        assert "__pycache__" not in parts
        assert not Path(d.name).is_absolute() and (root / d.name).is_file()
    names = {d.name for d in docs}
    assert "json/__init__.py" in names and "os.py" in names


def test_stdlib_include_tests_adds_only_test_folders(stdlib_docs):
    docs, _ = stdlib_docs
    if not (stdlib_root() / "test").is_dir():
        pytest.skip("this interpreter ships without its test package")
    with_tests = {d.name for d in iter_documents("stdlib", include_tests=True)}
    base = {d.name for d in docs}
    extra = with_tests - base
    assert base <= with_tests and extra
    assert all({"test", "tests"} & set(Path(n).parts) for n in extra)
    assert not any("site-packages" in Path(n).parts for n in with_tests)


def test_stdlib_documents_are_keyed_by_module(stdlib_docs):
    docs, _ = stdlib_docs
    by_name = {d.name: d for d in docs}
    assert by_name["json/__init__.py"].key == "json"
    assert by_name["os.py"].key == "os"
    assert by_name["email/mime/text.py"].key == "email.mime.text"
    assert module_name(Path("a/b/__init__.py")) == "a.b"
    # the key is the module name, never the interpreter's absolute path: the split is the
    # same on every machine
    for d in docs:
        assert d.key == module_name(Path(d.name))
        assert str(stdlib_root()) not in d.key


def test_stdlib_split_is_deterministic_and_about_two_percent(stdlib_docs):
    docs, _ = stdlib_docs
    train = [d.name for d in iter_documents("stdlib", "train", val_fraction=0.02)]
    val = [d.name for d in iter_documents("stdlib", "val", val_fraction=0.02)]
    val2 = [d.name for d in iter_documents("stdlib", "val", val_fraction=0.02)]
    assert val == val2
    assert set(train).isdisjoint(val)
    assert sorted(train + val) == sorted(d.name for d in docs)
    frac = len(val) / len(docs)
    assert 0.005 < frac < 0.05, frac
    # each document's side is a function of its module name alone
    for d in docs:
        assert (d.name in val) == (split_of(d.key, 0.02) == "val")


def test_split_of_matches_a_sha256_reference():
    """split_of is pinned: sha256 of the key, first 8 bytes big-endian, mod 1e6 (no Python hash)."""
    for key in ["json", "email.mime.text", "os", "a/b.txt", "x" * 100, "ünïcode"]:
        h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 1_000_000
        for frac in (0.0, 0.02, 0.5, 0.999):
            assert split_of(key, frac) == ("val" if h < frac * 1_000_000 else "train")
    keys = [f"module_{i}" for i in range(20000)]
    frac = sum(split_of(k, 0.02) == "val" for k in keys) / len(keys)
    assert abs(frac - 0.02) < 0.005
    # growing val_fraction only moves documents from train to val
    small = {k for k in keys if split_of(k, 0.02) == "val"}
    large = {k for k in keys if split_of(k, 0.1) == "val"}
    assert small <= large


def test_split_is_the_same_under_another_hash_seed(tmp_path):
    import subprocess
    import sys

    code = ("from lmforge.data.sources import iter_documents;"
            "print(','.join(d.key for d in iter_documents('stdlib', 'val')))")
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout)
    assert len(outs) == 1 and next(iter(outs)).strip()


def test_bad_split_name():
    with pytest.raises(DataError, match="split 'test'"):
        list(iter_documents("stdlib", "test"))


# -- a folder of text files ---------------------------------------------------------------
def test_folder_source(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha\n", encoding="utf-8")
    (root / "sub" / "b.md").write_text("# beta\n", encoding="utf-8")
    (root / "sub" / "c.py").write_text("gamma = 1\n", encoding="utf-8")
    (root / "skip.csv").write_text("not,text\n", encoding="utf-8")
    (root / "empty.txt").write_text("", encoding="utf-8")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "h.txt").write_text("hidden\n", encoding="utf-8")
    stats = SourceStats()
    docs = list(iter_documents(str(root), stats=stats))
    assert [(d.name, d.text) for d in docs] == [
        ("a.txt", "alpha\n"), ("sub/b.md", "# beta\n"), ("sub/c.py", "gamma = 1\n")]
    assert [d.key for d in docs] == ["a.txt", "sub/b.md", "sub/c.py"]  # relative: movable folder
    assert stats.empty == 1 and stats.documents == 3
    # moving the folder keeps the split
    moved = tmp_path / "elsewhere"
    root.rename(moved)
    assert [d.key for d in iter_documents(str(moved))] == ["a.txt", "sub/b.md", "sub/c.py"]


def test_jsonl_source(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"text": "first doc"}, {"text": "second ☃ doc", "meta": 1}, {"text": ""}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    stats = SourceStats()
    docs = list(iter_documents(str(path), stats=stats))
    assert [d.text for d in docs] == ["first doc", "second ☃ doc"]
    assert [d.name for d in docs] == ["data.jsonl:1", "data.jsonl:2"]
    assert docs[0].key == hashlib.sha256(b"first doc").hexdigest()
    assert stats.empty == 1


@pytest.mark.parametrize(
    "line, needle",
    [("{not json", "data.jsonl:2: not valid JSON"),
     ('{"txt": "x"}', 'data.jsonl:2: the record has no "text" field (its fields: [\'txt\']). Set data.text_field'),
     ('["a"]', "data.jsonl:2: expected an object"),
     ('{"text": 3}', "data.jsonl:2")],
)
def test_jsonl_bad_line(tmp_path, line, needle):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "ok"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataError) as exc:
        list(iter_documents(str(path)))
    assert needle in str(exc.value)


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "corpus.csv"
    path.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"unsupported file type '\.csv'"):
        list(iter_documents(str(path)))


# -- bad input ------------------------------------------------------------------------
def bad_utf8_corpus(tmp_path) -> Path:
    root = make_corpus(tmp_path / "corpus", n_docs=30)
    (root / "doc_015.py").write_bytes(b"caf\xe9 = 1\n")  # Latin-1, not UTF-8
    return root


def test_non_utf8_skipped_with_a_count(tmp_path):
    root = bad_utf8_corpus(tmp_path)
    stats = SourceStats()
    docs = list(iter_documents(str(root), on_bad_utf8="skip", stats=stats))
    assert len(docs) == 29 and stats.bad_utf8 == 1
    assert stats.skipped_names == [str(root / "doc_015.py")]
    assert "doc_015.py" not in {d.name for d in docs}


def test_non_utf8_error_names_the_file(tmp_path):
    root = bad_utf8_corpus(tmp_path)
    with pytest.raises(DataError) as exc:
        list(iter_documents(str(root), on_bad_utf8="error"))
    msg = str(exc.value)
    assert str(root / "doc_015.py") in msg and "not UTF-8" in msg and "byte 3" in msg
    assert 'on_bad_utf8="skip"' in msg


def test_missing_path(tmp_path):
    with pytest.raises(DataError) as exc:
        list(iter_documents(str(tmp_path / "nowhere")))
    assert str(tmp_path / "nowhere") in str(exc.value) and "does not exist" in str(exc.value)


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.csv").write_text("x", encoding="utf-8")
    with pytest.raises(DataError) as exc:
        list(iter_documents(str(tmp_path / "empty")))
    assert "holds no .txt/.md/.py files" in str(exc.value)


def assert_nothing_written(out: Path):
    assert not out.exists(), f"{out} left behind"
    assert not out.with_name(out.name + ".tmp").exists(), "temporary folder left behind"


@pytest.mark.parametrize("case", ["missing", "empty", "bad_utf8_error", "all_empty_files", "no_val_docs"])
def test_prepare_fails_cleanly(tmp_path, tiny_tokenizer, case):
    out = tmp_path / "data"
    val_fraction, on_bad = 0.2, "skip"
    if case == "missing":
        source = tmp_path / "nowhere"
    elif case == "empty":
        source = tmp_path / "empty"
        source.mkdir()
    elif case == "bad_utf8_error":  # fails after some documents were already written
        source = bad_utf8_corpus(tmp_path)
        on_bad = "error"
    elif case == "all_empty_files":
        source = tmp_path / "blank"
        source.mkdir()
        (source / "a.txt").write_text("", encoding="utf-8")
    else:
        source = make_corpus(tmp_path / "few", n_docs=3)
        val_fraction = 0.0
    with pytest.raises(DataError):
        prepare(str(source), tiny_tokenizer, out, val_fraction, on_bad_utf8=on_bad, progress=False)
    assert_nothing_written(out)


def test_failed_prepare_keeps_the_previous_output(tmp_path, tiny_corpus, tiny_tokenizer):
    out = tmp_path / "data"
    prepare(str(tiny_corpus), tiny_tokenizer, out, 0.2, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(DataError):
        prepare(str(tmp_path / "nowhere"), tiny_tokenizer, out, 0.2, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not (tmp_path / "data.tmp").exists()


def test_prepare_stage_counts_skipped_non_utf8(tmp_path, tiny_tokenizer, capsys):
    root = bad_utf8_corpus(tmp_path)
    cfg = tiny_config(tmp_path, root, **{"tokenizer.dir": str(tiny_tokenizer.folder)})
    meta = prepare_stage(cfg, progress=False)
    assert meta["skipped_bad_utf8"] == 1
    assert sum(m["documents"] for m in meta["splits"].values()) == 29
    assert "skipped_bad_utf8': 1" in capsys.readouterr().err
    on_disk = json.loads((Path(cfg.data.dir) / META_FILE).read_text())
    assert on_disk["skipped_bad_utf8"] == 1
    # the resolved config is written beside the shards
    from lmforge.config import load_config

    assert load_config(Path(cfg.data.dir) / "config.toml") == cfg


# -- shard format -------------------------------------------------------------------------
def test_shard_format(tiny_run):
    cfg, tok = tiny_run
    folder = Path(cfg.data.dir)
    meta = json.loads((folder / META_FILE).read_text())
    assert Contract.load(folder) == tok.contract
    assert tok.contract.token_dtype == "uint16"
    total_docs = 0
    for split in ("train", "val"):
        texts = [d.text for d in iter_documents(cfg.data.source, split, cfg.data.val_fraction)]
        raw = np.fromfile(folder / f"{split}.bin", dtype=np.uint16)
        idx = np.fromfile(folder / f"{split}.idx", dtype=np.int64)
        assert (folder / f"{split}.idx").stat().st_size == 8 * len(idx)
        assert (folder / f"{split}.bin").stat().st_size == 2 * len(raw)
        assert len(idx) == len(texts) + 1
        assert idx[0] == 0 and idx[-1] == len(raw)
        assert np.all(np.diff(idx) >= 2)
        for i, text in enumerate(texts):
            doc = raw[idx[i]: idx[i + 1]].tolist()
            assert doc == [tok.bos_id, *tok.encode(text), tok.eos_id]
            assert tok.decode(doc[1:-1]) == text
        shard = Shard.open(folder, split, tok.contract)
        assert shard.tokens.dtype == np.uint16
        assert shard.n_documents == len(texts) and shard.n_tokens == len(raw)
        np.testing.assert_array_equal(shard.document(0), raw[idx[0]: idx[1]])
        m = meta["splits"][split]
        assert m["documents"] == len(texts)
        assert m["tokens"] == len(raw)
        assert m["bytes"] == sum(len(t.encode("utf-8")) for t in texts) == shard.n_bytes
        assert m["max_id"] == int(raw.max()) < tok.vocab_size
        total_docs += len(texts)
    assert total_docs == 40
    assert meta["skipped_bad_utf8"] == 0 and meta["val_fraction"] == cfg.data.val_fraction
    report = preflight(folder, tok.contract)
    assert report["train"]["documents"] == meta["splits"]["train"]["documents"]


def test_prepare_is_deterministic(tmp_path, tiny_corpus, tiny_tokenizer):
    a = prepare(str(tiny_corpus), tiny_tokenizer, tmp_path / "a", 0.2, progress=False)
    b = prepare(str(tiny_corpus), tiny_tokenizer, tmp_path / "b", 0.2, progress=False)
    assert a["splits"] == b["splits"]
    for name in ("train.bin", "train.idx", "val.bin", "val.idx"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_prepare_drops_exact_duplicates(tmp_path, tiny_tokenizer):
    root = make_corpus(tmp_path / "corpus", n_docs=20)
    (root / "copy.py").write_bytes((root / "doc_003.py").read_bytes())
    meta = prepare(str(root), tiny_tokenizer, tmp_path / "data", 0.2, progress=False)
    assert meta["skipped_duplicates"] == 1
    assert sum(m["documents"] for m in meta["splits"].values()) == 20


def copy_data(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_shard_open_rejects_a_damaged_index(tmp_path, tiny_run):
    cfg, tok = tiny_run
    folder = copy_data(Path(cfg.data.dir), tmp_path / "data")
    idx = np.fromfile(folder / "val.idx", dtype=np.int64)
    idx[-1] += 1
    idx.tofile(folder / "val.idx")
    with pytest.raises(DataError, match="val.idx: offsets must"):
        Shard.open(folder, "val", tok.contract)


def test_shard_open_missing_files_and_contract(tmp_path, tiny_run):
    cfg, tok = tiny_run
    with pytest.raises(DataError, match="Run `lmforge prepare"):
        Shard.open(tmp_path, "train", tok.contract)
    folder = copy_data(Path(cfg.data.dir), tmp_path / "data")
    (folder / "contract.json").unlink()
    with pytest.raises(ContractError, match="has no contract.json"):
        Shard.open(folder, "train", tok.contract)


def test_preflight_catches_an_id_past_the_vocab(tmp_path, tiny_run):
    cfg, tok = tiny_run
    folder = copy_data(Path(cfg.data.dir), tmp_path / "data")
    raw = np.fromfile(folder / "train.bin", dtype=np.uint16)
    raw[5] = tok.vocab_size + 3
    raw.tofile(folder / "train.bin")
    with pytest.raises(DataError) as exc:
        preflight(folder, tok.contract)
    msg = str(exc.value)
    assert f"token id {tok.vocab_size + 3} at offset 5" in msg and str(tok.vocab_size) in msg


def test_preflight_catches_a_missing_eos(tmp_path, tiny_run):
    cfg, tok = tiny_run
    folder = copy_data(Path(cfg.data.dir), tmp_path / "data")
    raw = np.fromfile(folder / "val.bin", dtype=np.uint16)
    idx = np.fromfile(folder / "val.idx", dtype=np.int64)
    raw[idx[1] - 1] = tok.bos_id
    raw.tofile(folder / "val.bin")
    with pytest.raises(DataError, match="document 0 .* not eos_id"):
        preflight(folder, tok.contract)


def test_data_from_another_tokenizer_is_refused(tmp_path, tiny_run, tiny_corpus):
    from lmforge.tokenizer import train_tokenizer

    cfg, tok = tiny_run
    texts = [p.read_text() for p in sorted(tiny_corpus.glob("*.py"))][:20]
    other = train_tokenizer(texts, 320, tmp_path / "other", show_progress=False)
    with pytest.raises(ContractError) as exc:
        preflight(cfg.data.dir, other.contract, tmp_path / "other" / "contract.json")
    assert "contract mismatch" in str(exc.value) and str(tmp_path / "other") in str(exc.value)
    assert isinstance(Tokenizer.load(tmp_path / "other"), Tokenizer)
