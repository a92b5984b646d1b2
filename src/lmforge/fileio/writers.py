"""The writers: every folder and file lmforge writes, atomically; a run's metrics appended
line by line; a training run's folder made or re-opened.

- A folder is built in a temporary sibling with a unique name (`.NAME.tmp-XXXXXX`, made by
  this process and removed only by it) and moved into place when complete; the previous
  output is replaced only then (an atomic exchange where the kernel has one, else two
  renames with the old kept until the new is in place).
- Files are written to a unique temporary sibling and `os.replace`d; `fsync=True` makes
  the bytes durable before the rename (checkpoints).
- Only a regular file or a link is ever replaced (the link itself, never its target); a
  FIFO, a device or a socket at an output path is refused, `--force` or not.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lmforge.errors import FileSystemError, os_advice, os_error
from lmforge.fileio.durable import check_removable, fsync_path, fsync_tree, replace_dir
from lmforge.fileio.failures import failure_or_none
from lmforge.fileio.locking import make_parent, output_lock
from lmforge.fileio.ownership import (MARKER_FILE, OutputError, listed_files, check_not_input, check_not_inside_output,
                                      check_output, describe, read_marker, special_kind)


# -- the writers ---------------------------------------------------------------------------------
def write_marker(folder: Path, command: str, **extra) -> None:
    """Write the marker of `folder` (atomically: a failed write leaves no half marker)."""
    write_text(Path(folder) / MARKER_FILE, json.dumps({"command": command, **extra}) + "\n")


@contextlib.contextmanager
def atomic_dir(out: str | Path, command: str, fsync: bool = False, what: str | None = None,
               check: bool = True, inputs=()) -> Iterator[Path]:
    """Build the folder `out` in a unique temporary sibling, yielded to the caller; on
    success it is marked as `command`'s output and moved into place, on any error (or
    Ctrl-C) it is removed and `out` is left as it was.

    `check=False` is for a folder inside one the caller already owns and holds locked (a
    checkpoint inside its run folder): no output check and no lock of its own. `inputs`: the
    command's inputs ((name, path) pairs), none of which `out` may be, hold or lie inside.

    Raises:
        OutputError: `out` may not be written by `command` (see `check_output`), or another
        process is writing it.
    """
    out = Path(out)
    if check:
        check_output(out, command, what, replace_whole=True, inputs=inputs)
        if out.is_dir():
            try:
                check_removable(out)  # a read-only earlier output: refused before any work
            except OSError as exc:
                raise os_error(exc, doing="replace a folder in", what=f"Nothing was written: {out} is as it "
                                                                      f"was.") from None
    make_parent(out)
    with output_lock(out) if check else contextlib.nullcontext():
        if check:
            _sweep_interrupted(out, what or f"`lmforge {command}`")
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
        except OSError as exc:
            raise OutputError(f"--out {out}: cannot create a temporary folder beside it ({exc.strerror}); "
                              f"{'choose a shorter name' if exc.errno == 36 else os_advice(exc)}. Nothing was "
                              f"written.") from None
        try:
            yield tmp
            write_marker(tmp, command, files=listed_files(tmp))
            if fsync:
                fsync_tree(tmp)
            replace_dir(tmp, out)
        except BaseException as exc:
            failure = failure_or_none(exc, tmp, out)
            shutil.rmtree(tmp, ignore_errors=True)
            if failure is not None:
                raise failure from None
            raise


def _sweep_interrupted(out: Path, what: str) -> None:
    """Remove the temporary folders of an earlier write of `out` whose process was killed before
    it could clean up (SIGKILL, a power cut): `.NAME.tmp-PID-XXXXXX` beside it, PID no longer
    running. Called with `out`'s lock held, so no live process is writing any of them. Says
    what it removed (the new write starts over)."""
    import re

    from lmforge.fileio.locking import pid_alive

    pattern = re.compile(re.escape(f".{out.name}.tmp-") + r"(\d+)-[A-Za-z0-9_]+")
    try:
        siblings = list(out.parent.iterdir())
    except OSError:
        return
    for path in siblings:
        m = pattern.fullmatch(path.name)
        if not m or not path.is_dir() or path.is_symlink() or pid_alive(int(m.group(1))):
            continue
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(path, ignore_errors=True)
        print(f"note: an earlier {what} of {out} was interrupted before it finished (process {m.group(1)} is "
              f"gone); its unfinished {path.name} ({size / 2**20:,.1f} MiB) is removed, never read, and this one "
              f"starts over.", file=sys.stderr)


@contextlib.contextmanager
def atomic_file(path: str | Path, fsync: bool = False, replace: bool = True) -> Iterator[Path]:
    """Yield a unique temporary path beside `path`; on success it replaces `path` (with
    `replace=False`, an existing file is refused first), on error it is removed.

    Raises:
        OutputError: `path` is a folder, or exists and `replace` is False.
    """
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{path} is a folder; a file is written there. Choose a file path.")
    special = special_kind(path)
    if special:
        raise OutputError(f"{path} is {special}, not a regular file; lmforge replaces only a regular file or a link "
                          f"(never what it points to). It is left untouched: choose another path.")
    if (path.exists() or path.is_symlink()) and not replace:
        raise OutputError(f"{path} already exists; it is left untouched. Pass --force to replace it, "
                          f"or choose another path.")
    make_parent(path)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    except OSError as exc:
        raise os_error(OSError(exc.errno, exc.strerror, str(path)), doing="write",
                       what="(lmforge writes a temporary file beside it first.) Nothing was written.") from None
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if fsync:
            fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        failure = failure_or_none(exc, tmp, path)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if failure is not None:
            raise failure from None
        raise


@contextlib.contextmanager
def user_file(path: str | Path, force: bool = False, inputs=()) -> Iterator[Path]:
    """`atomic_file` for a command's `--out FILE` (eval results, a GGUF file): refused inside
    a folder lmforge replaces whole, an existing file or link only replaced with `force`,
    never one of the command's `inputs` ((name, path) pairs), and one writer at a time.

    Raises:
        OutputError: see `atomic_file`, `check_not_inside_output`, `check_not_input`, `output_lock`.
    """
    path = Path(path)
    check_user_file(path, force, inputs)
    with output_lock(path), atomic_file(path, replace=force) as tmp:
        yield tmp


def check_user_file(path: str | Path, force: bool = False, inputs=()) -> None:
    """What `user_file` refuses, checked before any work (nothing is written).

    Raises:
        OutputError: an empty path, a folder, a file inside an lmforge output, one of the
        command's `inputs` (`check_not_input`: the same file, a link to it, with `force` or
        not), an existing file or link without `force`, or a file that belongs to an lmforge output.
    """
    path = Path(path)
    if not str(path):
        raise OutputError("--out is empty; give a file path.")
    try:
        is_dir = path.is_dir()
        exists = path.exists() or path.is_symlink()
    except OSError as exc:  # a name too long for the file system, a parent that is a file
        raise OutputError(f"--out {str(path)[:80]}: cannot be written ({exc.strerror}). Choose another path.") from None
    if is_dir:
        raise OutputError(f"--out {path} is a folder; one file is written there. Give a file path.")
    special = special_kind(path)
    if special:
        raise OutputError(f"--out {path} is {special}, not a regular file; lmforge replaces only a regular file or "
                          f"a link (never what it points to), --force or not. It is left untouched: give another "
                          f"file path.")
    check_not_inside_output(path)
    check_not_input(path, inputs)
    if exists and read_marker(path.parent) is not None:
        raise OutputError(f"{path} belongs to {describe(path.parent)}; it is never replaced by another command's "
                          f"output. Choose another file name.")
    if exists and not force:
        raise OutputError(f"{path} already exists; it is left untouched. Pass --force to replace it, "
                          f"or choose another path.")


def write_text(path: str | Path, text: str, fsync: bool = False, skip_same: bool = False) -> Path:
    """Write `text` (UTF-8) to `path` atomically; with `skip_same`, a regular file that already
    holds exactly these bytes is left as it is (not even its time stamps change).

    Raises:
        FileSystemError / OutputError: see `atomic_file`.
    """
    data = text.encode("utf-8")
    if skip_same and _holds(Path(path), data):
        return Path(path)
    with atomic_file(path, fsync=fsync) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def copy_file(src: str | Path, dst: str | Path) -> Path:
    """Copy `src` to `dst` atomically (a temporary beside `dst`, then renamed); a `dst` that
    already holds the same bytes is left as it is.

    Raises:
        FileSystemError: reading `src` or writing `dst` was refused (naming the path).
    """
    src, dst = Path(src), Path(dst)
    try:
        data = src.read_bytes()
    except OSError as exc:
        raise os_error(exc, src, "read") from None
    if _holds(dst, data):
        return dst
    with atomic_file(dst) as tmp:
        tmp.write_bytes(data)
    return dst


def _holds(path: Path, data: bytes) -> bool:
    try:
        return path.is_file() and not path.is_symlink() and path.stat().st_size == len(data) \
            and path.read_bytes() == data
    except OSError:
        return False


def write_json(path: str | Path, obj, fsync: bool = False) -> Path:
    """`obj` as indented JSON; text that UTF-8 cannot hold (a file name's bytes that are not
    UTF-8, kept by Python as surrogate escapes) is written as JSON's \\u escapes instead."""
    text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(obj, indent=2) + "\n"
    return write_text(path, text, fsync=fsync)


class AppendFile:
    """A run's metrics.jsonl opened for appending whole lines (`open_append`): `write(text)`,
    `flush()`, `close()`. A write the operating system refuses (a full disk, `ulimit -f`) is
    undone to the end of the previous write, so the file never ends in half a line, and is
    raised as a FileSystemError naming the file."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def write(self, text: str) -> None:
        view = memoryview(text.encode("utf-8"))
        size = os.fstat(self.fd).st_size
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, size)  # no half line stays behind
            raise os_error(exc, self.path, "append to", "The rows written before are kept.") from None

    def flush(self) -> None:  # every write goes straight to the file
        pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_append(path: str | Path) -> AppendFile:
    """Open `path` for appending lines (created if absent). Only a regular file is appended to:
    never a FIFO, a device, or through a link.

    Raises:
        OutputError: `path` is not a regular file. FileSystemError: the system refused (naming
        the path and what to do).
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # O_NOFOLLOW on a link; a FIFO without a reader
            raise OutputError(f"{path} is {special_kind(path) or 'a link'}, not a regular file lmforge wrote; it "
                              f"is left untouched. Move it away, or use another --out.") from None
        raise os_error(exc, path, "append to") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OutputError(f"{path} is {special_kind(path) or 'not a regular file'}; lmforge appends only to a "
                              f"regular file. Move it away, or use another --out.")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return AppendFile(path, fd)


def open_run_dir(out: str | Path, command: str, resume: bool, has_progress, create: bool = True) -> Path:
    """Make (or re-open) the run folder `out` of a training command: absent or empty gets
    `command`'s marker; an existing run of the same command needs `resume` when
    `has_progress(out)` says it holds checkpoints. `create=False` only checks (the other
    ranks of a data-parallel run, which must refuse exactly when rank 0 does).

    Raises:
        OutputError: `out` is another command's output, a checkpoint, a file, `.`, a
        parent, a folder lmforge did not write, or a run with checkpoints and no `--resume`.
    """
    out = Path(out)
    check_output(out, command)
    if out.is_dir() and read_marker(out) is not None and has_progress(out) and not resume:
        raise OutputError(f"--out {out} already holds a `lmforge {command}` run with checkpoints. Pass --resume "
                          f"to continue it, or choose another --out.")
    if create:
        make_folder(out, command)
    return out


def make_folder(out: Path, command: str) -> None:
    """Create the folder `out` (if absent) and give it `command`'s marker (if it has none); on
    a refusal of the operating system, a folder this call created is removed again.

    Raises:
        FileSystemError: naming the path and what to do.
    """
    created = not (out.exists() or out.is_symlink())
    try:
        out.mkdir(parents=True, exist_ok=True)
        if read_marker(out) is None:
            write_marker(out, command)
    except OSError as exc:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise os_error(exc, out, "write", "Nothing was written.") from None
    except FileSystemError:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
