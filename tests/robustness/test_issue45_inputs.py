"""Hardening, round five (issue 45): each class with several members, through the robustness
table's runner (exit 2, one `error:` line naming the field or file, no traceback, every file
byte-identical) or, where the input must work, a run that checks what it made:

- corpora that cannot lose a shard: every compressed reader (gzip, Zstandard, bzip2, xz) stops at
  a stream or frame cut short, naming the file and the last good line, in a folder or alone, for
  a corpus, a tokenizer's corpus and a fine-tuning file; every frame of a multi-frame Zstandard
  file is read; an Arrow stream cut at a batch boundary is refused; a folder names every file it
  does not read (another type, a compressed text file, a link to a folder, a hidden folder);
- outputs that never equal inputs: `--out` the same file as `--tasks` (the path, another spelling,
  a symbolic link, a hard link), a folder output inside the corpus or the Hugging Face folder
  it reads, with or without `--force`;
- tracebacks and wrong blame: an evaluation JSON whose numbers are text, NaN or infinite (the
  model card), `train.eval_tasks` naming a bad file (named as the config key, no run folder
  left), a task row of both forms, `LMFORGE_CONFIG_OVERLAY` naming a FIFO, a device, a folder or a
  bad value (never a hang, always named), prepare's progress bar and its error on one line, a
  read-only TensorBoard folder on --resume (a thread's traceback).
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import test_bad_inputs as table
from test_bad_inputs import C, PREPARE, PRETRAIN, SFT_SETS, TOKENIZE, Row, project, write  # noqa: F401

from lmforge.cli import main

ROWS: list[Row] = []


def add(id: str, argv, match: str, damage=None) -> None:
    ROWS.append(Row(id, tuple(argv), match, damage))


def _body(n: int = 400, tag: str = "shard") -> bytes:
    """`n` JSONL records whose texts differ from the project's corpus (no duplicate is dropped)."""
    return "".join(json.dumps({"text": f"def {tag}_{i}(value):\n    return value * {i} + {i % 7}\n"}) + "\n"
                   for i in range(n)).encode()


def _zstd(data: bytes) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor(level=3).compress(data)


COMPRESS = {".jsonl.gz": gzip.compress, ".jsonl.bz2": bz2.compress, ".jsonl.xz": lzma.compress,
            ".jsonl.zst": _zstd}


def cut(rel: str, kind: str, keep: float = 0.6, body: bytes | None = None):
    """A compressed JSONL file at `rel`, cut to `keep` of its compressed bytes."""
    def f(p: Path) -> None:
        data = COMPRESS[kind](body if body is not None else _body())
        (p / rel).parent.mkdir(parents=True, exist_ok=True)
        (p / rel).write_bytes(data[: int(len(data) * keep)])
    return f


def zst_frames(rel: str, cut_last: bool):
    """Two Zstandard frames back to back (as `zstd -T`, pzstd or `cat a.zst b.zst` write), the
    second one cut short when `cut_last`."""
    def f(p: Path) -> None:
        first, second = _zstd(_body(200, "first")), _zstd(_body(200, "second"))
        (p / rel).write_bytes(first + (second[: len(second) // 2] if cut_last else second))
    return f


# -- 1. corpora that cannot lose a shard ---------------------------------------------------------------
CUT = r"damaged or cut short after line \d+"
for kind in COMPRESS:
    name = "extra" + kind
    add(f"cut{kind.replace('.', '-')}-in-folder", PREPARE, rf"corpus/{re.escape(name)}: {CUT}",
        cut(f"corpus/{name}", kind))
    add(f"cut{kind.replace('.', '-')}-alone", (*PREPARE[:-3], "--set", f"data.source=shard{kind}", "--out",
                                              "newdata", "--no-progress"),
        rf"shard{re.escape(kind)}: {CUT}", cut(f"shard{kind}", kind))
add("cut-zst-tokenizer-corpus", TOKENIZE, rf"corpus/extra\.jsonl\.zst: {CUT}", cut("corpus/extra.jsonl.zst", ".jsonl.zst"))
add("cut-zst-second-frame", PREPARE, rf"corpus/two\.jsonl\.zst: {CUT}", zst_frames("corpus/two.jsonl.zst", True))
add("cut-zst-a-few-bytes", PREPARE, r"corpus/tiny\.jsonl\.zst: damaged or cut short after line 0",
    cut("corpus/tiny.jsonl.zst", ".jsonl.zst", keep=0.05))
add("zst-garbage-after-magic", PREPARE, r"corpus/bad\.jsonl\.zst: damaged or cut short",
    write("corpus/bad.jsonl.zst", b"\x28\xb5\x2f\xfd" + b"not zstandard at all" * 20))
SFT_ZST = ("sft", *C, *SFT_SETS, "--set", "sft.data=chat.jsonl.zst", "--out", "newsft", "--no-progress")


def _chat_zst(p: Path) -> None:
    data = _zstd((p / "chat.jsonl").read_bytes() * 3)
    (p / "chat.jsonl.zst").write_bytes(data[: len(data) * 2 // 3])


add("cut-zst-sft-data", SFT_ZST, rf"chat\.jsonl\.zst: {CUT}", _chat_zst)


def _arrow_cut_at_a_batch(p: Path) -> None:
    """An Arrow IPC stream of three batches cut right after the second (no end-of-stream marker)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.ipc as ipc

    texts = [f"def arrow_{i}(x):\n    return x + {i}\n" for i in range(300)]
    table_ = pa.table({"text": texts})
    sink = pa.BufferOutputStream()
    writer = ipc.new_stream(sink, table_.schema)
    batches = table_.to_batches(max_chunksize=100)
    writer.write_batch(batches[0])
    writer.write_batch(batches[1])
    data = sink.getvalue().to_pybytes()  # two batches written, the third and the end marker never
    (p / "corpus" / "part.arrow").write_bytes(data)


add("arrow-stream-cut-at-a-batch", PREPARE, r"corpus/part\.arrow: .*cut short after row 200", _arrow_cut_at_a_batch)


def test_every_frame_of_a_multi_frame_zstandard_file_is_read(project, tmp_path, monkeypatch):
    """`zstd -T0`, pzstd and `cat a.zst b.zst` write several frames: each one's documents are kept."""
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    zst_frames("two.jsonl.zst", cut_last=False)(work)
    monkeypatch.chdir(work)
    assert main([*PREPARE[:-3], "--set", "data.source=two.jsonl.zst", "--set", "data.val_fraction=0.1",
                 "--out", "newdata", "--no-progress"]) == 0
    meta = json.loads((work / "newdata" / "meta.json").read_text())
    assert sum(s["documents"] for s in meta["splits"].values()) == 400


def test_a_folder_names_every_file_it_does_not_read(project, tmp_path, monkeypatch, capsys):
    """A file of another type, a compressed text file, a link to a folder, a hidden folder: each is
    counted and named (meta.json and the summary line), none is dropped without a word."""
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    corpus = work / "corpus"
    (corpus / "notes.csv").write_text("a,b\n1,2\n")
    (corpus / "more.txt.gz").write_bytes(gzip.compress(b"some text\n"))
    (corpus / "rows.jsonl.lz4").write_bytes(b"\x04\x22\x4d\x18 not read")
    (corpus / "linked").symlink_to(work / "mine", target_is_directory=True)
    (corpus / ".cache").mkdir()
    (corpus / ".cache" / "a.txt").write_text("hidden text\n")
    monkeypatch.chdir(work)
    capsys.readouterr()
    assert main(list(PREPARE)) == 0
    err = capsys.readouterr().err
    meta = json.loads((work / "newdata" / "meta.json").read_text())
    assert meta["skipped_other"] == 5, meta
    expected = ["corpus/.cache", "corpus/linked", "corpus/more.txt.gz", "corpus/notes.csv", "corpus/rows.jsonl.lz4"]
    assert sorted(meta["skipped_names"]) == expected, meta["skipped_names"]
    assert sum(s["documents"] for s in meta["splits"].values()) == 30
    line = next(x for x in err.splitlines() if "skipped" in x)
    assert "skipped_other" in line and "corpus/.cache" in line, err


# -- 2. outputs that never equal inputs ----------------------------------------------------------------
TASKS = "".join(json.dumps({"query": f"def f{i}(x): return", "choices": [" x", " None"], "gold": 0}) + "\n"
                for i in range(3))
EVAL_TASKS = ("eval", "--checkpoint", "run", "--tasks", "t.jsonl")


def _link(kind: str, target: str, at: str):
    def f(p: Path) -> None:
        write("t.jsonl", TASKS)(p)
        if kind == "symlink":
            (p / at).symlink_to(target)
        else:
            os.link(p / target, p / at)
    return f


INPUT = r"--tasks"
for force in ((), ("--force",)):
    sfx = "-force" if force else ""
    add(f"eval-out-is-tasks{sfx}", (*EVAL_TASKS, "--out", "t.jsonl", *force), rf"--out t\.jsonl .*{INPUT}",
        write("t.jsonl", TASKS))
    add(f"eval-out-is-tasks-other-spelling{sfx}", (*EVAL_TASKS, "--out", "mine/../t.jsonl", *force),
        rf"--out mine/\.\./t\.jsonl .*{INPUT}", write("t.jsonl", TASKS))
    add(f"eval-out-symlink-to-tasks{sfx}", (*EVAL_TASKS, "--out", "o.jsonl", *force), rf"--out o\.jsonl .*{INPUT}",
        _link("symlink", "t.jsonl", "o.jsonl"))
    add(f"eval-out-hardlink-to-tasks{sfx}", (*EVAL_TASKS, "--out", "o.jsonl", *force), rf"--out o\.jsonl .*{INPUT}",
        _link("hardlink", "t.jsonl", "o.jsonl"))
add("prepare-out-inside-corpus", (*PREPARE[:-3], "--out", "corpus/data", "--no-progress"),
    r"--out corpus/data .*inside.*data\.source")
add("prepare-out-is-glob-base", (*PREPARE[:-3], "--set", "data.source=corpus/*.py", "--out", "corpus/sub",
                                 "--no-progress"), r"--out corpus/sub .*data\.source")
def _user_hf(p: Path) -> None:
    """userhf/: the Hugging Face folder as another tool writes it (no lmforge marker)."""
    shutil.copytree(p / "hf", p / "userhf")
    (p / "userhf" / ".lmforge-output").unlink()


add("import-hf-out-inside-hf", ("import-hf", "userhf", "--out", "userhf/imp"),
    r"--out userhf/imp is inside userhf \(the Hugging Face folder\)", _user_hf)


# -- 3. tracebacks and wrong blame --------------------------------------------------------------------
def _evaluation(**task_changes):
    def f(p: Path) -> None:
        task = {"kind": "choice", "n": 5, "accuracy": 0.4, "baseline": 0.5, "centred": -0.2, "interval": [0.1, 0.8]}
        task.update(task_changes.get("task", {}))
        res = {"checkpoint": "run", "seed": 0, "limit": 5, "suite": -0.2, "tasks": {"t": task}}
        res.update({k: v for k, v in task_changes.items() if k != "task"})
        (p / "e.json").write_text(json.dumps(res))
    return f


EXPORT_EVAL = ("export", "--checkpoint", "run", "--out", "newhf", "--evaluation", "e.json")
for id, changes, match in [
    ("accuracy-text", {"task": {"accuracy": "x"}}, r"e\.json: tasks\.t\.accuracy = 'x'"),
    ("accuracy-nan", {"task": {"accuracy": float("nan")}}, r"e\.json: tasks\.t\.accuracy = nan"),
    ("baseline-inf", {"task": {"baseline": float("inf")}}, r"e\.json: tasks\.t\.baseline = inf"),
    ("centred-none", {"task": {"centred": None}}, r"e\.json: tasks\.t\.centred = None"),
    ("interval-short", {"task": {"interval": [0.1]}}, r"e\.json: tasks\.t\.interval = \[0\.1\]"),
    ("n-text", {"task": {"n": "5"}}, r"e\.json: tasks\.t\.n = '5'"),
    ("suite-nan", {"suite": float("nan")}, r"e\.json: suite = nan"),
    ("task-not-object", {"tasks": {"t": [1]}}, r"e\.json: tasks\.t = \[1\]"),
    ("pass-at-k-text", {"task": {"pass@k": {"1": "x"}, "samples": 2, "temperature": 0.8}},
     r"e\.json: tasks\.t\.pass@k\.1 = 'x'"),
]:
    add(f"card-{id}", EXPORT_EVAL, match, _evaluation(**changes))

BAD_TASK = write("bad.jsonl", json.dumps({"query": "q", "choices": ["a"], "gold": 0}) + "\n")
add("train-eval-tasks-bad-file", (*PRETRAIN[:-3], "--set", 'train.eval_tasks=["bad.jsonl"]', "--out", "newrun",
                                  "--no-progress"), r"train\.eval_tasks.*bad\.jsonl:1", BAD_TASK)
add("train-eval-tasks-missing-file", (*PRETRAIN[:-3], "--set", 'train.eval_tasks=["gone.jsonl"]', "--out", "newrun",
                                      "--no-progress"), r"train\.eval_tasks = 'gone\.jsonl' does not exist")
add("train-eval-tasks-bad-file-dry-run", (*PRETRAIN[:-3], "--set", 'train.eval_tasks=["bad.jsonl"]', "--dry-run"),
    r"train\.eval_tasks.*bad\.jsonl:1", BAD_TASK)

def test_a_dry_run_with_a_good_eval_task_file_passes(project, tmp_path, monkeypatch, capsys):
    """train.eval_tasks with a good file: the dry run checks it with the run's tokenizer and passes
    (its measuring trainer used to look for a tokenizer in the current folder and blame it)."""
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    write("good.jsonl", TASKS)(work)
    monkeypatch.chdir(work)
    before = table.tree_hash(work)
    capsys.readouterr()
    assert main([*PRETRAIN[:-3], "--set", 'train.eval_tasks=["good.jsonl"]', "--dry-run"]) == 0, \
        capsys.readouterr().err[-2000:]
    assert table.tree_hash(work) == before


BOTH = [
    ("choices-and-continuation", {"query": "q", "choices": [" a", " b"], "gold": 0, "continuation": " a"}),
    ("context-and-choices", {"context": "c", "continuation": " a", "choices": [" a", " b"]}),
    ("context-and-gold", {"context": "c", "continuation": " a", "query": "q", "gold": 1}),
]
for id, record in BOTH:
    add(f"task-row-{id}", EVAL_TASKS, r"t\.jsonl:2: .*both.*multiple choice.*continuation",
        write("t.jsonl", TASKS.splitlines(keepends=True)[0] + json.dumps(record) + "\n"))


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_refused_cleanly(row: Row, project, tmp_path, monkeypatch, capsys):
    table.test_bad_input_is_refused_cleanly(row, project, tmp_path, monkeypatch, capsys)


def test_the_rows_fail_where_they_should():
    assert len({r.id for r in ROWS}) == len(ROWS) >= 40


# -- the overlay --------------------------------------------------------------------------------------
def _lmforge(args, cwd: Path, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    """The console command with its address space capped (a read of /dev/zero must not take the
    machine's memory) and a time limit (a FIFO must not block it)."""
    cap = 2 << 30
    return subprocess.run([sys.executable, "-m", "lmforge", *args], cwd=cwd, capture_output=True, timeout=timeout,
                          env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))


def _overlay_fifo(p: Path) -> str:
    os.mkfifo(p / "overlay.toml")
    return "overlay.toml"


def _overlay_text(text: str):
    def f(p: Path) -> str:
        (p / "overlay.toml").write_text(text)
        return "overlay.toml"
    return f


OVERLAYS = [
    ("fifo", _overlay_fifo, r"overlay\.toml.*FIFO"),
    ("dev-zero", lambda p: "/dev/zero", r"/dev/zero.*device"),
    ("folder", lambda p: "mine", r"mine.*folder"),
    ("missing", lambda p: "gone.toml", r"gone\.toml.*does not exist"),
    ("too-large", _overlay_text("# padding\n" * 200_000), r"overlay\.toml.*bytes"),
    ("bad-value", _overlay_text("[train]\nlr = -1.0\n"), r"overlay\.toml.*train\.lr = -1\.0"),
    ("wrong-type", _overlay_text("[train]\nsteps = 'many'\n"), r"overlay\.toml.*train\.steps = 'many'"),
    ("not-a-section", _overlay_text("lr = 1\n"), r"overlay\.toml.*\[lr\]"),
    ("not-toml", _overlay_text("[train\n"), r"overlay\.toml.*not valid TOML"),
]


@pytest.mark.parametrize("make,match", [o[1:] for o in OVERLAYS], ids=[o[0] for o in OVERLAYS])
def test_a_bad_overlay_is_refused_naming_it(make, match, project, tmp_path):
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    path = make(work)
    before = _tree(tmp_path)
    try:
        r = _lmforge([*PREPARE], work, {"LMFORGE_CONFIG_OVERLAY": path}, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"LMFORGE_CONFIG_OVERLAY={path}: still reading after 20 s")
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, err[-3000:]
    assert err.count("error:") == 1 and "Traceback" not in err, err[-3000:]
    line = err[err.index("error:"):]
    assert f"LMFORGE_CONFIG_OVERLAY={path}" in line and re.search(match, line, re.S), line
    assert _tree(tmp_path) == before


def _tree(root: Path) -> dict[str, str]:
    """`tree_hash`, a FIFO named rather than read (its read would block)."""
    import hashlib
    import stat

    out = {}
    for p in sorted(root.rglob("*")):
        mode = p.lstat().st_mode
        out[str(p.relative_to(root))] = ("link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode) else
                                         hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(mode)
                                         else "special")
    return out


# -- prepare's progress bar and its error ---------------------------------------------------------------
def test_the_error_line_starts_a_line_after_the_progress_bar(project, tmp_path, monkeypatch, capsys):
    """stderr is not a terminal here: the bar's last state is closed with a newline, so `error:`
    starts its own line (never glued to "prepare: 40%|...")."""
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    body = _body(3000, "bar")
    (work / "corpus" / "zz.jsonl").write_bytes(body + b"{not json\n")
    monkeypatch.chdir(work)
    capsys.readouterr()
    assert main(["prepare", *C, "--out", "newdata"]) == 2
    err = capsys.readouterr().err
    assert "prepare" in err and "Traceback" not in err, err  # the bar was drawn
    assert re.search(r"(^|\n)error: .*zz\.jsonl:3001", err), repr(err[-500:])


# -- a read-only TensorBoard folder --------------------------------------------------------------------
def test_a_read_only_tensorboard_folder_on_resume_is_one_clean_error(project, tmp_path):
    pytest.importorskip("tensorboard")
    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and setpriv is None:
        pytest.skip("running as root without setpriv: mode bits cannot be made to bind")
    work = tmp_path / "p"
    shutil.copytree(project, work, symlinks=True)
    board = work / "run" / "tensorboard"
    board.mkdir()
    board.chmod(0o555)
    drop = [setpriv, "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", "--"] \
        if os.geteuid() == 0 else []
    probe = subprocess.run([*drop, sys.executable, "-c", f"open({str(board / 'x')!r}, 'w')"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("mode bits do not bind here (the capabilities could not be dropped)")
    try:
        r = subprocess.run([*drop, sys.executable, "-m", "lmforge", "pretrain", *C, "--set", "train.tensorboard=true",
                            "--resume", "--out", "run", "--no-progress"],
                           cwd=work, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    finally:
        board.chmod(0o755)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, err[-3000:]
    assert "Traceback" not in err and "Exception in thread" not in err and err.count("error:") == 1, err[-3000:]
    assert re.search(r"error: .*run/tensorboard.*Permission denied", err), err[-1000:]
