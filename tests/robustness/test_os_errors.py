"""The operating system says no: the real refusals, through the real command line.

Each row runs `python -m lmforge` in a fresh copy of the small project of
test_bad_inputs.py, made to meet one refusal of the operating system, and asserts: exit 2,
exactly one `error:` line that names the path and the system's reason, no traceback, and
every file of the copy (and beside it) byte-identical before and after, with no temporary
or lock left behind.

Classes: permission denied on inputs (config, corpus file and folder, tokenizer, shards,
weights, SFT data, Hugging Face folder, an output's marker) and on outputs (a read-only
folder for a new output, a run, an earlier output, an --out file); a read-only file system
(EROFS, a tmpfs mounted read-only); a full one (ENOSPC, a 64 KiB tmpfs); the file-size limit
(`ulimit -f`: EFBIG, SIGXFSZ ignored) for every native writer; symbolic link loops as input
and output; FIFOs, sockets and devices as output, with and without --force; --force on a
link; paths with bytes that are not UTF-8 or characters no file name can hold; a second
Ctrl-C; a refused resume that leaves the run's side files untouched (bytes and times).

Mode bits do not bind root: as root, the commands run under `setpriv` without
CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (skipped, with the reason, where that is not
possible). Mounting needs root (skipped otherwise).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bad_inputs import C, EVAL, EXPORT, IMPORT_HF, PREPARE, PRETRAIN, SFT, project  # noqa: E402, F401

from lmforge.cli import main  # noqa: E402

SETPRIV = shutil.which("setpriv")
DROP = [SETPRIV or "setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", "--"]


def signature(root: Path, times: bool = False) -> dict[str, str]:
    """{path: sha256 | 'dir' | 'link -> target' | 'special MODE'} under `root` (never opens a FIFO;
    reads unreadable files by mode change-free root access), with mtimes when `times`."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        mode = st.st_mode
        if stat.S_ISLNK(mode):
            v = f"link -> {os.readlink(p)}"
        elif stat.S_ISDIR(mode):
            v = f"dir {stat.S_IMODE(mode):o}"
        elif stat.S_ISREG(mode):
            v = hashlib.sha256(p.read_bytes()).hexdigest() + f" {stat.S_IMODE(mode):o}"
        else:
            v = f"special {stat.S_IFMT(mode):o}"
        out[str(p.relative_to(root))] = v + (f" @{st.st_mtime_ns}" if times and not stat.S_ISDIR(mode) else "")
    return out


def lmforge(args, cwd: Path, unprivileged: bool = False, fsize: int | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lmforge", *args]
    if unprivileged and os.geteuid() == 0:
        cmd = DROP + cmd
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    preexec = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))) if fsize else None
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, timeout=timeout, preexec_fn=preexec,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def mode_bits_bind(tmp_path_factory) -> None:
    """Skip unless a command can run where permission bits bind (not root, or root without
    the capabilities that bypass them)."""
    if os.geteuid() != 0:
        return
    if SETPRIV is None:
        pytest.skip("running as root and setpriv (util-linux) is missing: mode bits cannot be made to bind")
    probe = tmp_path_factory.mktemp("caps") / "secret"
    probe.write_text("x")
    probe.chmod(0)
    r = subprocess.run(DROP + ["cat", str(probe)], capture_output=True)
    if r.returncode == 0:
        pytest.skip("running as root and setpriv could not drop CAP_DAC_OVERRIDE here: mode bits do not bind")


#: One row per class runs in `make test`; the rest (a subprocess each, ~5 s) are marked slow.
QUICK = {"input-config", "input-newest-step-no-fallback", "output-new-in-read-only-folder", "export-hf-ENOSPC",
         "export-hf-EROFS", "export-hf", "config", "out-folder", "eval-fifo", "optimizer-unreadable",
         "read-only-run"}


def rows(items, ids) -> list:
    """pytest params with ids; those outside QUICK marked slow."""
    return [pytest.param(*(item if isinstance(item, tuple) else (item,)), id=i,
                         marks=() if i in QUICK else pytest.mark.slow) for item, i in zip(items, ids)]


def _leftovers(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if ".tmp-" in p.name or p.name.endswith(".lock")]


def _check_refused(r: subprocess.CompletedProcess, match: str) -> str:
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, f"exit {r.returncode}\n{err[-3000:]}"
    assert err.count("error:") == 1 and "Traceback" not in err, err[-3000:]
    line = err[err.index("error:"):]
    assert re.search(match, line, re.S), f"{match!r} not in {line!r}"
    return line


@pytest.fixture
def work(project, tmp_path) -> Path:
    w = tmp_path / "p"
    shutil.copytree(project, w, symlinks=True)
    yield w
    for p in [w, *w.rglob("*")]:  # give back every mode a row took away, so the folder can be removed
        with contextlib.suppress(OSError):
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o755)
            elif p.is_file() and not p.is_symlink():
                p.chmod(0o644)


# -- permission denied: inputs and outputs ---------------------------------------------------------
@dataclass(frozen=True)
class Row:
    id: str
    damage: Callable[[Path], None]
    argv: tuple[str, ...]
    match: str


def chmod(rel: str, mode: int) -> Callable[[Path], None]:
    return lambda p: (p / rel).chmod(mode)


RESUME = ("pretrain", *C, "--resume", "--out", "run", "--no-progress")  # the same schedule: accepted
DENIED = r"Permission denied, EACCES\); permission denied: give your user access"
PERMISSION_ROWS = [
    Row("input-config", chmod("cfg.toml", 0), PRETRAIN, r"config file cfg\.toml: cannot be read \(Permission denied"),
    Row("input-corpus-file", chmod("corpus/doc_003.py", 0), PREPARE, r"corpus/doc_003\.py: cannot be read "
                                                                       r"\(Permission denied"),
    Row("input-corpus-folder", chmod("corpus", 0), PREPARE, r"corpus: cannot list it \(" + DENIED),
    Row("input-tokenizer", chmod("tok/tokenizer.json", 0), PREPARE, r"tok/tokenizer\.json: cannot access it \(" + DENIED),
    Row("input-tokenizer-folder", chmod("tok", 0), PREPARE, r"tok.*Permission denied"),
    Row("input-tokenizer-config", chmod("tok/tokenizer_config.json", 0), PREPARE,
        r"tok/tokenizer_config\.json: cannot read it \(" + DENIED),
    Row("input-data-meta", chmod("data/meta.json", 0), PRETRAIN, r"data/meta\.json: cannot read it \(" + DENIED),
    Row("input-shard", chmod("data/train.bin", 0), PRETRAIN, r"data/train\.bin: cannot access it \(" + DENIED),
    Row("input-weights", chmod("run/step_000002/model.safetensors", 0), EVAL,
        r"run/step_000002/model\.safetensors: cannot read it \(" + DENIED),
    Row("input-newest-step-no-fallback", chmod("run/step_000002", 0),
        ("generate", *C, "--checkpoint", "run", "--prompt", "x", "--max-new-tokens", "2"),
        r"run/step_000002.*\(" + DENIED),  # never silently the older step_000001
    Row("input-sft-init-newest-step", chmod("run/step_000002", 0), SFT, r"run/step_000002.*\(" + DENIED),
    Row("input-hf-weights", chmod("hf/model.safetensors", 0), IMPORT_HF,
        r"hf/model\.safetensors: cannot read it \(" + DENIED),
    Row("input-sft-data", chmod("chat.jsonl", 0), SFT, r"chat\.jsonl: cannot be read \(Permission denied"),
    Row("input-hf-config", chmod("hf/config.json", 0), IMPORT_HF, r"hf/config\.json: cannot access it \(" + DENIED),
    Row("input-optimizer", chmod("run/step_000002/optimizer.pt", 0), RESUME, r"run/step_000002/optimizer\.pt"),
    Row("input-marker", chmod("data/.lmforge-output", 0), ("prepare", *C, "--out", "data", "--no-progress"),
        r"data/\.lmforge-output: cannot read it \(" + DENIED + r".*whose output"),
    Row("output-new-in-read-only-folder", chmod(".", 0o555), PREPARE,
        r"--out newdata: cannot create the lock \.newdata\.lock beside it \(Permission denied\); permission denied"),
    Row("output-run-in-read-only-folder", chmod(".", 0o555), PRETRAIN, r"newrun.*Permission denied"),
    Row("output-resume-read-only-run", chmod("run", 0o555), RESUME,
        r"run/metrics\.jsonl: cannot write it \(" + DENIED),
    Row("output-replace-read-only-export", chmod("hf", 0o555), EXPORT[:-1] + ("hf",),
        r"hf: cannot replace a folder in it \(" + DENIED + r".*Nothing was written"),
    Row("output-eval-file-read-only-folder", chmod("mine", 0o555), (*EVAL, "--out", "mine/eval.json"),
        r"mine/eval\.json.*\(Permission denied\); permission denied: give your user access"),
    Row("output-gguf-read-only-folder", chmod("mine", 0o555),
        ("export", "--checkpoint", "run", "--format", "gguf", "--out", "mine/m.gguf"),
        r"mine/m\.gguf.*\(Permission denied\); permission denied: give your user access"),
    Row("output-import-hf-read-only-folder", chmod(".", 0o555), IMPORT_HF, r"newimp.*Permission denied"),
]


@pytest.mark.parametrize("row", rows(PERMISSION_ROWS, [r.id for r in PERMISSION_ROWS]))
def test_permission_denied_is_refused_cleanly(row: Row, work, tmp_path, mode_bits_bind):
    row.damage(work)
    before = signature(tmp_path)
    r = lmforge(row.argv, work, unprivileged=True)
    _check_refused(r, row.match)
    assert signature(tmp_path) == before, "files changed, appeared or vanished"
    assert not _leftovers(tmp_path)


# -- read-only and full file systems (tmpfs mounts: root only) -------------------------------------
@contextlib.contextmanager
def tmpfs(where: Path, size: str, read_only: bool = False):
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip() or 'not root'}): a real full or "
                    f"read-only file system is needed")
    try:
        if read_only:
            (where / "keep.txt").write_text("a file of the read-only disk\n")
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


GGUF = ("export", "--checkpoint", "run", "--format", "gguf")
DISK_ROWS = {
    "prepare": ("prepare", *C, "--no-progress", "--out"),
    "export-hf": ("export", "--checkpoint", "run", "--out"),
    "export-gguf": (*GGUF, "--out"),
    "import-hf": ("import-hf", "hf", "--out"),
    "eval-file": (*EVAL, "--out"),
    "tokenizer": ("train-tokenizer", *C, "--no-progress", "--out"),
}
NAMES = {"export-gguf": "m.gguf", "eval-file": "e.json"}


@pytest.mark.parametrize(("command", "kind"), rows([(c, k) for c in DISK_ROWS for k in ("EROFS", "ENOSPC")],
                                                  [f"{c}-{k}" for c in DISK_ROWS for k in ("EROFS", "ENOSPC")]))
def test_read_only_and_full_file_systems(command, kind, work, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if kind == "ENOSPC" and command in ("eval-file", "tokenizer", "prepare"):
        pytest.skip("its output fits in 64 KiB; the full-disk rows are the large writers")
    size = "64k"
    with tmpfs(work / "disk", size, read_only=kind == "EROFS") as disk:
        if kind == "ENOSPC":
            (disk / "filler.bin").write_bytes(b"\x00" * 16384)
        out = disk / NAMES.get(command, "out")
        before = signature(tmp_path)
        r = lmforge((*DISK_ROWS[command], str(out.relative_to(work))), work)
        words = (r"\(Read-only file system(, EROFS)?\); the file system is read-only" if kind == "EROFS"
                 else r"No space left on device, ENOSPC\); the disk is full")
        _check_refused(r, rf"disk/{out.name}.*{words}")
        assert signature(tmp_path) == before
        assert not _leftovers(tmp_path)


# -- the file-size limit: EFBIG instead of SIGXFSZ killing the process ----------------------------
EFBIG_ROWS = {  # every native writer: safetensors, torch (checkpoint), numpy (shards), gguf, tokenizers
    "export-hf": ("export", "--checkpoint", "run", "--out", "newhf"),
    "export-gguf": (*GGUF, "--out", "m.gguf"),
    "import-hf": ("import-hf", "hf", "--out", "newimp"),
    "prepare": ("prepare", *C, "--set", "data.val_fraction=0.5", "--out", "newdata", "--no-progress"),
    "tokenizer": ("train-tokenizer", *C, "--out", "newtok", "--no-progress"),
}


@pytest.mark.parametrize("command", rows(list(EFBIG_ROWS), list(EFBIG_ROWS)))
def test_file_size_limit_is_reported_not_a_crash(command, work, tmp_path):
    limit = {"prepare": 2048, "tokenizer": 8192}.get(command, 20000)
    before = signature(tmp_path)
    r = lmforge(EFBIG_ROWS[command], work, fsize=limit)
    assert r.returncode != -signal.SIGXFSZ, "killed by SIGXFSZ"
    out = EFBIG_ROWS[command][EFBIG_ROWS[command].index("--out") + 1]
    _check_refused(r, rf"{re.escape(out)}.*File too large, EFBIG\); .*ulimit -f")
    assert signature(tmp_path) == before
    assert not _leftovers(tmp_path)


@pytest.mark.slow
def test_file_size_limit_during_training_stops_cleanly(work, tmp_path):
    """A checkpoint (safetensors, torch.save) past `ulimit -f`: exit 2 naming it, no temporary
    folder, no checkpoint, whole metrics rows, nothing else changed."""
    before = signature(tmp_path)
    r = lmforge(("pretrain", *C, "--set", "train.checkpoint_every=1", "--out", "newrun", "--no-progress"), work,
                fsize=50000)
    _check_refused(r, r"newrun/step_000001.*File too large, EFBIG\); .*ulimit -f")
    after = signature(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("p/newrun")} == before
    assert not _leftovers(tmp_path) and not list((work / "newrun").glob("step_*"))
    rows = (work / "newrun" / "metrics.jsonl").read_text().splitlines()
    assert rows and all(line.endswith("}") for line in rows)  # whole lines only


# -- links, special files, names ----------------------------------------------------------------------
LOOP_ROWS = [
    ("config", ("pretrain", "--config", "loop", "--out", "newrun"), r"config file loop is a link to nothing or a "
                                                                      r"symbolic link loop"),
    ("checkpoint", ("eval", "--checkpoint", "loop"), r"loop is not a checkpoint"),
    ("corpus", ("prepare", *C, "--set", "data.source=loop", "--out", "newdata"), r"loop"),
    ("sft-data", ("sft", *C, "--set", "sft.init=run", "--set", "sft.data=loop", "--out", "newsft"), r"loop"),
    ("hf-folder", ("import-hf", "loop", "--out", "newimp"), r"loop"),
    ("out-folder", ("prepare", *C, "--out", "loop", "--no-progress"), r"--out loop is a symbolic link loop, not a "
                                                                        r"folder"),
    ("out-run", ("pretrain", *C, "--out", "loop", "--no-progress"), r"--out loop is a symbolic link loop"),
    ("out-file", (*EVAL, "--out", "loop", "--force"), r"--out loop is a symbolic link loop"),
    ("out-gguf", (*GGUF, "--out", "loop", "--force"), r"--out loop is a symbolic link loop"),
]


@pytest.mark.parametrize(("rid", "argv", "match"), rows(LOOP_ROWS, [r[0] for r in LOOP_ROWS]))
def test_symlink_loop_as_input_and_output(rid, argv, match, work, tmp_path):
    (work / "loop").symlink_to("loop")
    before = signature(tmp_path)
    _check_refused(lmforge(argv, work), match)
    assert signature(tmp_path) == before and not _leftovers(tmp_path)


def _special(kind: str, path: Path):
    if kind == "fifo":
        os.mkfifo(path)
        return None
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    return s


SPECIAL_ROWS = [
    ("eval-fifo", "fifo", (*EVAL, "--out", "x"), r"--out x is a FIFO \(named pipe\), not a regular file"),
    ("eval-socket", "socket", (*EVAL, "--out", "x"), r"--out x is a socket, not a regular file"),
    ("gguf-fifo", "fifo", (*GGUF, "--out", "x"), r"--out x is a FIFO"),
    ("prepare-fifo", "fifo", ("prepare", *C, "--out", "x"), r"--out x is a FIFO \(named pipe\), not a folder"),
    ("export-socket", "socket", ("export", "--checkpoint", "run", "--out", "x"), r"--out x is a socket, not a folder"),
    ("run-metrics-fifo", "fifo", RESUME, r"metrics\.jsonl is not a regular file|metrics\.jsonl is a FIFO"),
]


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize(("rid", "kind", "argv", "match"), rows(SPECIAL_ROWS, [r[0] for r in SPECIAL_ROWS]))
def test_special_file_outputs_are_refused_even_with_force(rid, kind, argv, match, force, work, tmp_path):
    if force and not (argv[0] == "eval" or "gguf" in argv):
        pytest.skip("--force is a flag of the single-file outputs only")
    target = work / ("run/metrics.jsonl" if rid == "run-metrics-fifo" else "x")
    if rid == "run-metrics-fifo":
        target.unlink()
    keep = _special(kind, target)
    try:
        before = signature(tmp_path)
        _check_refused(lmforge((*argv, "--force") if force else argv, work, timeout=120), match)
        assert signature(tmp_path) == before and not _leftovers(tmp_path)
    finally:
        if keep is not None:
            keep.close()


def test_a_device_is_never_replaced_by_force(work, tmp_path):
    before = os.stat("/dev/null")
    for argv in ((*EVAL, "--out", "/dev/null", "--force"), (*GGUF, "--out", "/dev/null", "--force")):
        _check_refused(lmforge(argv, work), r"--out /dev/null is a device, not a regular file")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert not _leftovers(tmp_path)


def test_force_replaces_a_link_never_its_target(work):
    (work / "mine" / "results.json").write_text("a user's results\n")
    (work / "e.json").symlink_to("mine/results.json")
    target_before = signature(work / "mine")
    r = lmforge((*EVAL, "--out", "e.json"), work)
    _check_refused(r, r"e\.json already exists.*--force")
    r = lmforge((*EVAL, "--out", "e.json", "--force"), work)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert not (work / "e.json").is_symlink() and '"loss"' in (work / "e.json").read_text()
    assert signature(work / "mine") == target_before


@pytest.mark.slow
def test_paths_with_bytes_that_are_not_utf8_work(work):
    """A file name with a non-UTF-8 byte is a real Linux name: as --config it is read."""
    name = os.fsencode("cfg") + b"\xff.toml"
    shutil.copy(work / "cfg.toml", os.path.join(os.fsencode(work), name))
    cmd = [sys.executable, "-m", "lmforge", "generate", "--config", name, "--checkpoint", b"run", b"--prompt", b"x",
           b"--max-new-tokens", b"2", b"--greedy", b"--set", b"model.max_seq_len=128"]
    r = subprocess.run([os.fsencode(c) if isinstance(c, str) else c for c in cmd], cwd=work, capture_output=True,
                       env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"), timeout=300)
    assert r.returncode == 0, r.stderr.decode("utf-8", "replace")[-2000:]


@pytest.mark.parametrize(("argv", "match"), [
    (("eval", "--checkpoint", "r\ud800un"), r"--checkpoint = 'r\\ud800un': the character '\\ud800' at position 1 "
                                             r"cannot be encoded as a file name"),
    (("prepare", "--config", "c\ud800fg.toml", "--out", "newdata"), r"--config = 'c\\ud800fg\.toml'"),
    (("import-hf", "h\ud800f", "--out", "newimp"), r"DIR = 'h\\ud800f'"),
    (("prepare", *C, "--set", "data.source=cor\x00pus", "--out", "newdata"), r"data\.source = 'cor\\x00pus' holds a "
                                                                              r"NUL character at position 3"),
])
def test_paths_no_file_system_can_take_are_refused(argv, match, work, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(work)
    before = signature(tmp_path)
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert re.search(match, err), err
    assert signature(tmp_path) == before


def test_nul_in_a_config_file_path_is_refused(work, tmp_path, monkeypatch, capsys):
    (work / "nul.toml").write_text('[sft]\ninit = "run"\ndata = "chat\\u0000.jsonl"\n')
    monkeypatch.chdir(work)
    before = signature(tmp_path)
    assert main(["sft", "--config", "nul.toml", "--set", "sft.init=run", "--out", "newsft"]) == 2
    err = capsys.readouterr().err
    assert "sft.data = 'chat\\x00.jsonl' holds a NUL character" in err and "Traceback" not in err
    assert signature(tmp_path) == before


# -- a refused resume touches nothing: bytes and times ---------------------------------------------------
RESUME_REFUSALS = [
    ("optimizer-unreadable", RESUME, chmod("run/step_000002/optimizer.pt", 0), r"optimizer\.pt", True),
    ("other-model", (*RESUME, "--set", "model.dim=64"), None, r"different \[model\] section", False),
    ("other-seq-len", (*RESUME, "--set", "data.seq_len=32"), None, r"data\.seq_len = 32", False),
    ("read-only-run", RESUME, chmod("run", 0o555), r"run/metrics\.jsonl: cannot write it", True),
    ("sft-other-init", ("sft", *C, "--set", "sft.init=run/step_000001", "--set", "sft.data=chat.jsonl",
                        "--set", "sft.val_examples=0", "--set", "data.val_fraction=0.25", "--set", "sft.steps=2",
                        "--set", "sft.micro_batch_size=2", "--resume", "--out", "sft", "--no-progress"), None,
     r"sft\.init", False),
]


@pytest.mark.parametrize(("rid", "argv", "damage", "match", "unprivileged"),
                         rows(RESUME_REFUSALS, [r[0] for r in RESUME_REFUSALS]))
def test_refused_resume_leaves_the_run_folder_untouched(rid, argv, damage, match, unprivileged, work, tmp_path,
                                                        request):
    if unprivileged:
        request.getfixturevalue("mode_bits_bind")
    if damage is not None:
        damage(work)
    before = signature(tmp_path, times=True)  # config.toml, contract.json, metrics.jsonl...: not even re-written
    _check_refused(lmforge(argv, work, unprivileged=unprivileged), match)
    assert signature(tmp_path, times=True) == before
    assert not _leftovers(tmp_path)


def test_accepted_resume_with_nothing_new_rewrites_no_side_file(work):
    """The side files (config.toml, contract and tokenizer copies) are written only when they
    change: a resume of a finished run with the same config leaves them as they were."""
    names = ("config.toml", "contract.json", "tokenizer.json", "tokenizer_config.json")
    before = {n: (work / "run" / n).stat().st_mtime_ns for n in names}
    r = lmforge(("pretrain", *C, "--resume", "--out", "run", "--no-progress"), work)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert {n: (work / "run" / n).stat().st_mtime_ns for n in names} == before


# -- a second Ctrl-C ----------------------------------------------------------------------------------------
def _sigint_pending(pid: int) -> bool:
    """SIGINT sent to process `pid` and not yet delivered to it (/proc/PID/status, SigPnd/ShdPnd)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone
        return False
    bit = 1 << (signal.SIGINT - 1)
    return any(int(v, 16) & bit for v in re.findall(r"^(?:SigPnd|ShdPnd):\s*([0-9a-f]+)$", status, re.M))


@pytest.mark.slow
def test_second_ctrl_c_during_training_shutdown_ends_quietly_with_130(work, tmp_path):
    """A Ctrl-C stops the run after the step, with a checkpoint; a second one during that shutdown
    stops it at once: exit 130, one `interrupted` line, no traceback, no temporary left. The
    shutdown is made long (a model of 8 layers of width 256: its step and checkpoint take tenths of
    a second), the second press is sent only once the kernel has delivered the first (two SIGINTs
    pending together are one to the process), and again every 50 ms until the process ends, so
    one lands inside the shutdown however loaded the machine is."""
    argv = ("pretrain", *C, "--set", "train.steps=100000", "--set", "train.checkpoint_every=0",
            "--set", "model.dim=256", "--set", "model.n_layers=8", "--set", "model.n_heads=4",
            "--set", "model.n_kv_heads=2", "--out", "longrun", "--no-progress")
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", *argv], cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        metrics = work / "longrun" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.stat().st_size > 0):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # the first: stop after this step, with a checkpoint
        while _sigint_pending(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.002)
        while proc.poll() is None and time.monotonic() < deadline:  # the second, until one lands
            time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode("utf-8", "replace")
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert err.count("interrupted") == 1, err[-3000:]
    assert not _leftovers(tmp_path)
