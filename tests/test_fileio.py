"""The one writer (`lmforge.fileio`): what it refuses, and that a failure injected mid-write
leaves the previous output intact, for every writer that goes through it."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

import pytest

from lmforge import fileio
from lmforge.fileio import MARKER_FILE, OutputError, atomic_dir, atomic_file, check_output, output_lock


def tree_hash(folder: Path) -> dict[str, str]:
    """{relative path: sha256 or 'dir'} of everything under `folder` (and beside it, hidden
    temporary siblings included when `folder` is a parent)."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


class Boom(RuntimeError):
    pass


# -- the guard ------------------------------------------------------------------------------
def test_check_output_accepts_absent_empty_and_own(tmp_path):
    check_output(tmp_path / "new", "prepare")
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", "prepare")
    with atomic_dir(tmp_path / "mine", "prepare") as tmp:
        (tmp / "a").write_text("1")
    check_output(tmp_path / "mine", "prepare")


@pytest.mark.parametrize("kind", ["file", "foreign", "other-command", "cwd", "parent"])
def test_check_output_refuses_what_it_did_not_write(tmp_path, monkeypatch, kind):
    target = tmp_path / "out"
    if kind == "file":
        target.write_text("a user's file")
        match = "an existing file"
    elif kind == "foreign":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
        match = "lmforge did not write .*notes.txt"
    elif kind == "other-command":
        with atomic_dir(target, "pretrain") as tmp:
            (tmp / "x").write_text("1")
        match = "a pretraining run folder"
    else:
        (tmp_path / "sub").mkdir()
        monkeypatch.chdir(tmp_path / "sub")
        target = Path(".") if kind == "cwd" else Path("..")
        match = "current folder or one of its parents"
    before = tree_hash(tmp_path)
    with pytest.raises(OutputError, match=match):
        check_output(target, "prepare")
    with pytest.raises(OutputError, match=match):
        with atomic_dir(target, "prepare") as tmp:
            (tmp / "new").write_text("2")
    assert tree_hash(tmp_path) == before


def test_a_failure_mid_write_keeps_the_previous_output_and_leaves_no_temporary(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out, "prepare") as tmp:
        (tmp / "data.bin").write_bytes(b"old")
    before = tree_hash(tmp_path)
    with pytest.raises(Boom):
        with atomic_dir(out, "prepare") as tmp:
            (tmp / "data.bin").write_bytes(b"new, half")
            raise Boom()
    assert tree_hash(tmp_path) == before  # no .out.tmp-*, no lock, the old folder as it was
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(out, "prepare") as tmp:
            raise KeyboardInterrupt
    assert tree_hash(tmp_path) == before


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_replacing_swaps_in_the_complete_new_folder(tmp_path, monkeypatch, exchange):
    if not exchange:  # a kernel or file system without RENAME_EXCHANGE
        monkeypatch.setattr(fileio.durable, "exchange_paths", lambda a, b: False)
    out = tmp_path / "out"
    for content in (b"one", b"two"):
        with atomic_dir(out, "prepare") as tmp:
            (tmp / "data.bin").write_bytes(content)
    assert (out / "data.bin").read_bytes() == b"two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert fileio.read_marker(out) == {"command": "prepare", "files": ["data.bin"]}  # what it wrote


def test_a_user_folder_with_the_old_temporary_names_is_never_touched(tmp_path):
    """`OUT.tmp` and `.tmp-OUT` were fixed temporary names once; now every temporary is unique."""
    for name in ("out.tmp", ".tmp-out", ".out.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "precious").write_text("keep")
    before = tree_hash(tmp_path)
    with atomic_dir(tmp_path / "out", "prepare") as tmp:
        (tmp / "x").write_text("1")
    after = tree_hash(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("out/") and k != "out"} == before


def test_a_second_writer_is_refused_while_the_first_runs(tmp_path):
    out = tmp_path / "out"
    with output_lock(out):
        with pytest.raises(OutputError, match="being written by another lmforge process"):
            with output_lock(out):
                pass
    with output_lock(out):  # released
        pass


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    out = tmp_path / "out"
    (tmp_path / ".out.lock").write_text("999999999\n")  # no such process
    with atomic_dir(out, "prepare") as tmp:
        (tmp / "x").write_text("1")
    assert not (tmp_path / ".out.lock").exists()


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "r.json"
    fileio.write_text(path, "old")
    with pytest.raises(Boom):
        with atomic_file(path) as tmp:
            tmp.write_text("new, half")
            raise Boom()
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    with pytest.raises(OutputError, match="--force"):
        with atomic_file(path, replace=False):
            pass
    with pytest.raises(OutputError, match="is a folder"):
        with atomic_file(tmp_path):
            pass


# -- every writer goes through it: a failure injected mid-write keeps the previous output -----
def _fail_on_marker(monkeypatch):
    """Make the writer fail at its last step (writing the marker, just before the rename)."""

    def boom(folder, command, **extra):
        raise Boom(f"injected while finishing {command}")

    monkeypatch.setattr(fileio.writers, "write_marker", boom)


def test_tokenizer_writer_keeps_the_previous_tokenizer(tmp_path, monkeypatch, tiny_corpus):
    from lmforge.tokenizer import train_tokenizer

    texts = [p.read_text() for p in sorted(tiny_corpus.glob("*.py"))]
    out = tmp_path / "tok"
    train_tokenizer(texts, 300, out, show_progress=False)
    before = tree_hash(tmp_path)
    _fail_on_marker(monkeypatch)
    with pytest.raises(Boom):
        train_tokenizer(texts, 320, out, show_progress=False)
    assert tree_hash(tmp_path) == before


def test_prepare_keeps_the_previous_data_and_refuses_a_run_folder(tmp_path, monkeypatch, tiny_run):
    from lmforge.stages import prepare_stage

    cfg, _ = tiny_run
    out = tmp_path / "data"
    prepare_stage(cfg, out, progress=False)
    before = tree_hash(tmp_path)
    with monkeypatch.context() as m:
        _fail_on_marker(m)
        with pytest.raises(Boom):
            prepare_stage(cfg, out, progress=False)
    assert tree_hash(tmp_path) == before
    # the tokenizer folder it reads, and a folder of the user's, are refused whole
    tok_dir = Path(cfg.tokenizer.dir)
    tok_before = tree_hash(tok_dir)
    with pytest.raises(OutputError, match="a tokenizer folder"):
        prepare_stage(cfg, tok_dir, progress=False)
    assert tree_hash(tok_dir) == tok_before


def test_checkpoint_writer_keeps_the_previous_checkpoint(tmp_path, monkeypatch, tiny_run):
    from lmforge.model import Transformer, resolve_model_config
    from lmforge.model import io as mio
    from lmforge.train.checkpoint import save_checkpoint

    cfg, tok = tiny_run
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    run = tmp_path / "run"
    save_checkpoint(run, 3, model, cfg, tok.folder, state={"tokens": 0, "data": {}})
    before = tree_hash(tmp_path)

    def boom(*a, **k):
        raise Boom("disk full")

    monkeypatch.setattr(mio, "save_safetensors", boom)
    with pytest.raises(Boom):
        save_checkpoint(run, 3, model, cfg, tok.folder, state={"tokens": 0, "data": {}})  # the same step again
    with pytest.raises(Boom):
        save_checkpoint(run, 4, model, cfg, tok.folder, state={"tokens": 0, "data": {}})
    assert tree_hash(tmp_path) == before
    assert mio.latest_checkpoint(run) == run / "step_000003"


def test_export_and_import_keep_the_previous_output(tmp_path, monkeypatch, tiny_run):
    pytest.importorskip("transformers")
    from lmforge.export import export_hf, import_hf
    from lmforge.stages import pretrain_stage

    cfg, _ = tiny_run
    pretrain_stage(replace(cfg, train=replace(cfg.train, steps=1)), tmp_path / "run", progress=False)
    hf = export_hf(tmp_path / "run", tmp_path / "hf")
    back = import_hf(hf, tmp_path / "back")
    before = tree_hash(tmp_path)
    _fail_on_marker(monkeypatch)
    with pytest.raises(Boom):
        export_hf(tmp_path / "run", hf)
    with pytest.raises(Boom):
        import_hf(hf, back)
    assert tree_hash(tmp_path) == before
    assert not any(p.name.startswith(".") and ".tmp-" in p.name for p in tmp_path.iterdir())


def test_no_writer_of_its_own_is_left_in_the_source_tree():
    """Every `.rename(` / `os.replace(` / `shutil.rmtree(` in src/ is in the one writer, or
    in the training folder's own housekeeping (pruning, removing a killed write's leftovers), or removes
    the sandbox's own temporary folder (lmforge.sandbox), or is a parallel prepare's housekeeping of its
    tasks' folder (`DATA_DIR.prepare-tasks`, marked as lmforge's: a task's folder renamed into place,
    a stopped task's redone, the folder removed once joined or after bad input)."""
    src = Path(__file__).resolve().parents[1] / "src" / "lmforge"
    allowed = {"fileio/durable.py": {"rename", "rmtree"}, "fileio/writers.py": {"replace", "rmtree"},
               "sandbox/isolate.py": {"rmtree"}, "sandbox/runner.py": {"rmtree"},
               "train/checkpoint.py": {"rmtree"},
               "export/hf_in.py": {"rmtree"},
               "data/stream_tasks.py": {"replace", "rmtree"}, "data/parallel.py": {"rmtree"}, "data/prepare.py": {"rmtree"}}
    found = {}
    for p in src.rglob("*.py"):
        text = p.read_text(encoding="utf-8")
        kinds = {k for k, pat in (("rename", ".rename("), ("replace", "os.replace("), ("rmtree", "rmtree("))
                 if pat in text}
        rel = str(p.relative_to(src))
        if kinds - allowed.get(rel, set()):
            found[rel] = sorted(kinds - allowed.get(rel, set()))
    assert not found, found
    assert MARKER_FILE.startswith(".") and os.sep not in MARKER_FILE


# -- readers that must not hang or go quadratic --------------------------------------------------
def test_a_fifo_in_a_corpus_folder_is_skipped_not_read(tmp_path):
    from lmforge.data.sources import iter_documents

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("hello world\n")
    os.mkfifo(tmp_path / "c" / "pipe.txt")  # reading it would block forever
    docs = list(iter_documents(str(tmp_path / "c"), None, 0.0))
    assert [d.name for d in docs] == ["a.txt"]


def test_tokenizer_training_is_linear_on_one_long_line_without_whitespace(tmp_path):
    """One 400 kB line without a space: before the cut, the BPE trainer took ~60 s at 500 kB
    (quadratic); now the pieces it sees are bounded and the cost is linear."""
    import random
    import time

    from lmforge.tokenizer import MAX_TRAINING_WORD, bounded_words, train_tokenizer

    rng = random.Random(0)
    text = "".join(rng.choice("abcdefghij") for _ in range(400_000))
    pieces = list(bounded_words(text + " tail"))
    assert "".join(pieces) == text + " tail" and max(len(p.split()[0]) for p in pieces if p.split()) <= MAX_TRAINING_WORD
    t0 = time.perf_counter()
    tok = train_tokenizer([text, "def f(x):\n    return x\n"], 400, tmp_path / "tok", show_progress=False)
    assert time.perf_counter() - t0 < 20  # ~0.4 s here; quadratic would be ~40 s
    assert tok.decode(tok.encode(text[:5000])) == text[:5000]
