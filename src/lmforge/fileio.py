"""The one writer for every output lmforge makes: folders and files, atomically.

Rules (docs/design.md, "Outputs and errors"), enforced here for every command:
- An output folder is written only if it is absent, empty, or holds what the *same*
  command wrote before, recognised by lmforge's own marker file (`MARKER_FILE`, a small
  JSON naming the command) — never by file names other tools also use. An existing file,
  `.`, a parent of the current folder, or another command's output is refused with a
  message that says what it is.
- A folder is built in a temporary sibling with a unique name (`.NAME.tmp-XXXXXX`, made by
  this process and removed only by it) and moved into place when complete; the previous
  output is replaced only then (an atomic exchange where the kernel has one, else two
  renames with the old kept until the new is in place).
- Files are written to a unique temporary sibling and `os.replace`d; `fsync=True` makes
  the bytes durable before the rename (checkpoints).
- A lock file (`.NAME.lock` beside the output) refuses a second writer of the same output
  while the first runs; a lock whose process is gone is taken over.
- Whatever the operating system refuses during a write (permission denied, a read-only or
  full file system, the `ulimit -f` size limit, a link loop), in Python or in a native
  library (safetensors, torch, tokenizers), becomes a `FileSystemError` naming the path and
  what to do; the temporary is removed, the lock released, and the output left as it was.
- Only a regular file or a link is ever replaced (the link itself, never its target); a
  FIFO, a device or a socket at an output path is refused, `--force` or not.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import re
import resource
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lmforge.errors import FileSystemError, LmforgeError, os_advice, os_error

MARKER_FILE = ".lmforge-output"


class OutputError(LmforgeError):
    """An output path lmforge refuses to write (it holds something else), or a failed write."""


# -- what is at a path -----------------------------------------------------------------------
def read_marker(folder: Path) -> dict | None:
    """The marker of a folder lmforge wrote ({"command": ...}), or None (absent, or not a marker).

    Raises:
        FileSystemError: the marker is there but the system refuses to read it (permission
        denied, an I/O error): lmforge cannot tell whose folder it is, so it touches nothing.
    """
    path = Path(folder) / MARKER_FILE
    try:
        data = loads_json(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError, UnicodeDecodeError):
        return None
    except OSError as exc:
        if exc.errno in (errno.ENAMETOOLONG, errno.ELOOP, errno.ENXIO):
            return None
        raise os_error(exc, path, "read", "lmforge cannot tell whose output the folder is; nothing was changed.") \
            from None
    return data if isinstance(data, dict) and isinstance(data.get("command"), str) else None


def write_marker(folder: Path, command: str, **extra) -> None:
    """Write the marker of `folder` (atomically: a failed write leaves no half marker)."""
    write_text(Path(folder) / MARKER_FILE, json.dumps({"command": command, **extra}) + "\n")


#: Marker commands in words, for error messages.
KINDS = {
    "tokenizer": "a tokenizer folder (train-tokenizer / import-tokenizer)",
    "prepare": "a prepared data folder (lmforge prepare)",
    "pretrain": "a pretraining run folder",
    "sft": "an SFT run folder",
    "checkpoint": "a checkpoint (a step_NNNNNN folder of a run)",
    "export": "a Hugging Face export folder (lmforge export --format hf)",
    "export-peft": "a PEFT adapter folder (lmforge export --format peft)",
    "dpo": "a DPO run folder",
    "import-hf": "a checkpoint imported from Hugging Face (lmforge import-hf)",
    "speedrun": "a speedrun folder",
}


#: Outputs that hold other outputs by design: a speedrun folder holds its stages' folders, a
#: training run folder its checkpoints (and may hold a user's evaluation results).
NESTING = ("speedrun", "pretrain", "sft")


def special_kind(path: Path) -> str | None:
    """'a FIFO', 'a device', 'a socket' (or 'a link loop') when `path` is none of a regular file,
    a folder or a link to one of them; None otherwise (absent included)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return "a symbolic link loop" if exc.errno == errno.ELOOP else None
    except ValueError:
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


def describe(path: Path) -> str:
    """What `path` holds, in words, for an error message."""
    special = special_kind(path)
    if special:
        return special + (" (behind a link)" if path.is_symlink() and "loop" not in special else "")
    marker = read_marker(path) if path.is_dir() else None
    if marker:
        return KINDS.get(marker["command"], f"the output of `lmforge {marker['command']}`")
    if path.is_file():
        return "an existing file"
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError:
        names = []
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return f"a folder lmforge did not write (it holds {shown})" if names else "an empty folder"


def _is_cwd_or_parent(path: Path) -> bool:
    try:
        here, target = Path.cwd().resolve(), path.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symbolic link loop (Python < 3.13)
        return False
    return target == here or target in here.parents


def check_output(out: Path, command: str, what: str | None = None, replace_whole: bool = False) -> None:
    """Raise OutputError unless `command` may write the folder `out`: absent, empty, or
    carrying `command`'s own marker.

    Raises:
        OutputError: `out` is a file, `.`, a parent of the current folder, another
        command's output, a checkpoint, or a folder lmforge did not write.
    """
    out = Path(out)
    what = what or f"`lmforge {command}`"
    if not str(out):
        raise OutputError(f"--out is empty; {what} needs a folder to write. Give a path.")
    if _is_cwd_or_parent(out):
        raise OutputError(f"--out {out} is the current folder or one of its parents; {what} writes a folder of "
                          f"its own there. Choose a new folder name, e.g. --out {Path(out) / 'out'}.")
    check_not_inside_output(out)
    try:
        exists = out.exists() or out.is_symlink()
        if not exists:
            return
        if not out.is_dir() or out.is_symlink():
            kind = special_kind(out) or ("a link" if out.is_symlink() else "an existing file")
            raise OutputError(f"--out {out} is {kind}, not a folder. {what} writes a folder: choose a new path "
                              f"(nothing was changed).")
        marker = read_marker(out)
        entries = list(out.iterdir())
    except OSError as exc:
        raise OutputError(f"--out {out}: cannot be examined ({exc.strerror or exc}). Choose another path.") from None
    if marker is not None and marker["command"] == command:
        if replace_whole and not isinstance(marker.get("files"), list):
            raise OutputError(f"--out {out} carries a marker of {what} without the list of the files it wrote, so "
                              f"lmforge cannot tell its files from yours; it is left untouched. Choose a new folder "
                              f"(or remove this one yourself).")
        extra = sorted(_unlisted(out, marker))
        if extra:
            raise OutputError(f"--out {out} is an earlier result of {what}, but it now also holds files lmforge "
                              f"did not write ({', '.join(extra[:5])}); replacing it would delete them. Move them "
                              f"out, or choose another --out.")
        return
    if marker is None and not entries:
        return
    raise OutputError(f"--out {out} is {describe(out)}, not an earlier result of {what}; it is left untouched. "
                      f"Choose an empty or new folder.")


def _manifest(folder: Path) -> list[str]:
    """Every path under `folder` (relative, '/'-separated), for the marker: what lmforge wrote."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.name != MARKER_FILE)


def _unlisted(folder: Path, marker: dict) -> set[str]:
    """Paths under an lmforge output that its marker does not list (a user's additions).
    A marker without a manifest (a run folder, written step by step) lists nothing to compare."""
    listed = marker.get("files")
    if not isinstance(listed, list):
        return set()
    return set(_manifest(folder)) - set(listed)


def check_not_inside_output(path: Path) -> None:
    """Refuse a path inside a folder lmforge replaces whole (a tokenizer, data, export or
    checkpoint folder...): the next run of that command would delete it. A speedrun folder,
    and a run folder's own checkpoints, are the exceptions that hold outputs by design.

    Raises:
        OutputError: naming the enclosing output.
    """
    try:
        parents = Path(path).resolve().parents
    except (OSError, RuntimeError):
        return
    for parent in parents:
        marker = read_marker(parent)
        if marker is not None and marker["command"] not in NESTING:
            raise OutputError(f"{path} is inside {parent}, {describe(parent)}, which lmforge replaces whole; "
                              f"anything written there would be lost. Choose a path outside it.")


# -- locking -----------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make_parent(path: Path) -> None:
    """Create the folder `path` goes into.

    Raises:
        OutputError: a parent is a file, or the folder cannot be made (read-only, /proc...).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{path}: its folder {path.parent} cannot be created ({exc.strerror or exc}); "
                          f"{os_advice(exc) if exc.errno != errno.EEXIST else 'a parent is an existing file'}. "
                          f"Choose another path.") from None


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold `.NAME.lock` beside `out` while writing it.

    Raises:
        OutputError: another live process holds the lock.
    """
    out = Path(out)
    make_parent(out)
    lock = out.parent / f".{out.name}.lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if lock.is_dir() or lock.is_symlink():
                raise OutputError(f"the lock path {lock} is a folder or a link, not an lmforge lock; remove it, "
                                  f"or choose another --out.") from None
            try:
                pid = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _pid_alive(pid):
                raise OutputError(f"{out} is being written by another lmforge process (pid {pid}, lock {lock}). "
                                  f"Wait for it to finish, or stop it first.") from None
            lock.unlink(missing_ok=True)  # stale: its process is gone
            continue
        except OSError as exc:
            raise OutputError(f"--out {out}: cannot create the lock {lock.name} beside it ({exc.strerror}); "
                              f"{'a shorter name is needed' if exc.errno == 36 else os_advice(exc)}. Nothing was "
                              f"written.") from None
        try:
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()}\n")
        except OSError as exc:  # a full disk, a file-size limit: no half-written lock stays behind
            with contextlib.suppress(OSError):
                lock.unlink()
            raise os_error(exc, lock, "write the lock file", f"Nothing was written to {out}.") from None
        except BaseException:
            with contextlib.suppress(OSError):
                lock.unlink()
            raise
        break
    else:
        raise OutputError(f"could not take the lock {lock}; remove it if no lmforge process is running.")
    try:
        yield
    finally:
        for _ in range(2):  # once more after a transient failure; a lock left behind is taken over by the
            with contextlib.suppress(OSError):  # next run (its process is gone)
                lock.unlink(missing_ok=True)


# -- durable renames ---------------------------------------------------------------------------
def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    for p in sorted(Path(folder).rglob("*"), reverse=True):
        if p.is_file() or p.is_dir():
            fsync_path(p)
    fsync_path(folder)


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD = -100
    rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def check_removable(folder: Path) -> None:
    """Raise the OSError that removing `folder` would meet (a read-only folder in it, or a
    read-only file system), before anything is changed."""
    parent = folder.parent
    for d in [parent, *(Path(p) for p, _, _ in os.walk(folder, onerror=_raise))]:
        if not os.access(d, os.W_OK | os.X_OK):
            code = errno.EROFS if _read_only_fs(d) else errno.EACCES
            raise OSError(code, os.strerror(code), str(d))


def _raise(exc: OSError) -> None:
    raise exc


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def replace_dir(new: Path, out: Path) -> None:
    """Move the complete folder `new` to `out`; a previous `out` is removed only once `new`
    is in place (atomic exchange where supported, else rename-aside then rename-in)."""
    if not out.exists():
        new.rename(out)
        old = None
    else:
        check_removable(out)  # before the swap: never a new output beside an old one that cannot go
        if _exchange(new, out):
            old = new  # `new` now holds the previous output
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            old.rmdir()
            out.rename(old)
            try:
                new.rename(out)
            except BaseException:
                old.rename(out)
                raise
    if old is not None:
        for _ in range(2):  # once more after a transient failure (EIO, EINTR, a busy file system)
            shutil.rmtree(old, ignore_errors=True)
        if old.exists():
            raise FileSystemError(f"{out} is written, but its previous version could not be removed completely; "
                                  f"what is left of it is in {old}. Remove that folder yourself.")
    with contextlib.suppress(OSError):
        fsync_path(out.parent)


# -- what the operating system refused ----------------------------------------------------------
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]")
#: Free space below which a write that failed without saying why is taken as "disk full".
_NEARLY_FULL = 16 << 20


def write_failure(exc: BaseException, folder: Path) -> OSError | None:
    """The operating system's refusal behind a failed write into `folder`, or None when the
    failure is not the file system's (a bug: it keeps its traceback).

    Native writers do not raise OSError: safetensors and tokenizers say "(os error 28)" in
    their message, torch only "unexpected pos" and numpy "N requested and M written". So,
    in order: an OSError with an errno; an errno in the message; a file under `folder` at
    the `ulimit -f` size limit (EFBIG); a file system with (nearly) no free space (ENOSPC).
    """
    if isinstance(exc, OSError) and exc.errno:
        return exc
    package = type(exc).__module__.split(".")[0]
    if not (isinstance(exc, (OSError, RuntimeError)) or type(exc) is Exception
            or package not in ("builtins", "lmforge")):
        return None  # TypeError, KeyError, Interrupted, an LmforgeError...: not the disk's doing
    m = _OS_ERROR_IN_TEXT.search(str(exc))
    if m:
        code = int(m.group(1) or m.group(2))
        return OSError(code, os.strerror(code))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        with contextlib.suppress(OSError):
            files = [folder] if folder.is_file() else folder.rglob("*")
            if any(p.is_file() and p.stat().st_size >= limit for p in files):
                return OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    with contextlib.suppress(OSError):
        st = os.statvfs(folder if folder.is_dir() else folder.parent)
        free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
        if free < _NEARLY_FULL:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return exc if isinstance(exc, OSError) else None


def _shown_path(name, tmp: Path, out: Path) -> Path:
    """A path inside the temporary `tmp` shown as where it was going (inside `out`)."""
    if name is None:
        return out
    try:
        rel = Path(os.fsdecode(name)).relative_to(tmp)
    except (ValueError, TypeError):
        return Path(os.fsdecode(name))
    return out / rel if str(rel) != "." else out


def _failure_or_none(exc: BaseException, tmp: Path, out: Path) -> FileSystemError | None:
    """The FileSystemError for a failed write of `out` (being built in `tmp`), naming the path
    that failed as the user knows it; None when the failure is not the file system's (or is
    already explained, or is Ctrl-C)."""
    if isinstance(exc, (LmforgeError, KeyboardInterrupt, SystemExit)) or not isinstance(exc, Exception):
        return None
    failure = write_failure(exc, tmp)
    if failure is None:
        return None
    name = failure.filename
    here = name is None or _is_within(name, tmp) or _is_within(name, out)
    shown = _shown_path(name, tmp, out) if here else name
    failure = OSError(failure.errno, failure.strerror or str(failure), shown, failure.filename2)
    tail = f"Nothing was written: {out} is as it was." if here else f"{out} was not written (it is as it was)."
    return os_error(failure, doing="write" if here else "use", what=tail)


def _is_within(name, folder: Path) -> bool:
    try:
        Path(os.fsdecode(name)).relative_to(folder)
        return True
    except (ValueError, TypeError):
        return False


# -- the writers ---------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_dir(out: str | Path, command: str, fsync: bool = False, what: str | None = None,
               check: bool = True) -> Iterator[Path]:
    """Build the folder `out` in a unique temporary sibling, yielded to the caller; on
    success it is marked as `command`'s output and moved into place, on any error (or
    Ctrl-C) it is removed and `out` is left as it was.

    `check=False` is for a folder inside one the caller already owns and holds locked (a
    checkpoint inside its run folder): no output check and no lock of its own.

    Raises:
        OutputError: `out` may not be written by `command` (see `check_output`), or another
        process is writing it.
    """
    out = Path(out)
    if check:
        check_output(out, command, what, replace_whole=True)
        if out.is_dir():
            try:
                check_removable(out)  # a read-only earlier output: refused before any work
            except OSError as exc:
                raise os_error(exc, doing="replace a folder in", what=f"Nothing was written: {out} is as it "
                                                                      f"was.") from None
    make_parent(out)
    with output_lock(out) if check else contextlib.nullcontext():
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        except OSError as exc:
            raise OutputError(f"--out {out}: cannot create a temporary folder beside it ({exc.strerror}); "
                              f"{'choose a shorter name' if exc.errno == 36 else os_advice(exc)}. Nothing was "
                              f"written.") from None
        try:
            yield tmp
            write_marker(tmp, command, files=_manifest(tmp))
            if fsync:
                fsync_tree(tmp)
            replace_dir(tmp, out)
        except BaseException as exc:
            failure = _failure_or_none(exc, tmp, out)
            shutil.rmtree(tmp, ignore_errors=True)
            if failure is not None:
                raise failure from None
            raise


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
        failure = _failure_or_none(exc, tmp, path)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if failure is not None:
            raise failure from None
        raise


@contextlib.contextmanager
def user_file(path: str | Path, force: bool = False) -> Iterator[Path]:
    """`atomic_file` for a command's `--out FILE` (eval results, a GGUF file): refused inside
    a folder lmforge replaces whole, an existing file or link only replaced with `force`,
    and one writer at a time.

    Raises:
        OutputError: see `atomic_file`, `check_not_inside_output`, `output_lock`.
    """
    path = Path(path)
    check_user_file(path, force)
    with output_lock(path), atomic_file(path, replace=force) as tmp:
        yield tmp


def check_user_file(path: str | Path, force: bool = False) -> None:
    """What `user_file` refuses, checked before any work (nothing is written).

    Raises:
        OutputError: an empty path, a folder, a file inside an lmforge output, an existing
        file or link without `force`, or a file that belongs to an lmforge output.
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


def loads_json(text: str):
    """`json.loads`; input nested past Python's recursion limit is a ValueError that says so
    (callers that report ValueError as damaged JSON then name the file)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to read (Python's recursion limit)") from None


def write_json(path: str | Path, obj, fsync: bool = False) -> Path:
    """`obj` as indented JSON; text that UTF-8 cannot hold (a file name's bytes that are not
    UTF-8, kept by Python as surrogate escapes) is written as JSON's \\u escapes instead."""
    text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(obj, indent=2) + "\n"
    return write_text(path, text, fsync=fsync)


#: The prefix of a path that `path_text` had to encode: a NUL, which no path can hold, so no
#: real path is ever read as one.
FS_BYTES_PREFIX = "\x00fs-bytes:"


def path_text(text: str) -> str:
    """A path as text that UTF-8 files (config.toml, JSON, safetensors metadata) can hold:
    `text` itself when it is UTF-8, else (a Linux file name whose bytes are not UTF-8, which
    Python keeps as surrogate escapes) FS_BYTES_PREFIX + its bytes percent-encoded.
    `path_from_text` reverses it."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        from urllib.parse import quote

        return FS_BYTES_PREFIX + quote(os.fsencode(text), safe="/._-~")


def path_from_text(text: str) -> str:
    """The path `path_text` encoded (any other text is returned as it is)."""
    if isinstance(text, str) and text.startswith(FS_BYTES_PREFIX):
        from urllib.parse import unquote_to_bytes

        return os.fsdecode(unquote_to_bytes(text[len(FS_BYTES_PREFIX):]))
    return text


def shown_path(path: str | Path) -> str:
    """A path for messages and reports: bytes that are not UTF-8 as \\xNN (always printable)."""
    return os.fsencode(str(path)).decode("utf-8", "backslashreplace")


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


def check_readable(path: str | Path) -> None:
    """Open and close `path`: a reader whose library words a refusal badly (safetensors says
    "No such file" for permission denied) calls this first, or when it failed.

    Raises:
        FileSystemError: naming the path, the system's reason and what to do.
    """
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise os_error(exc, path, "read") from None


def check_path_text(text: str, what: str) -> None:
    """Refuse a path no file system call can take: a NUL character, or a character that
    cannot be encoded to the file system's bytes (a lone surrogate that is not an escaped
    byte). `what` names it in the message ("--config", "data.source").

    Raises:
        FileSystemError: naming the field, the character and its position.
    """
    if not isinstance(text, str):
        return
    if "\x00" in text:
        raise FileSystemError(f"{what} = {text!r} holds a NUL character at position {text.index(chr(0))}; no file "
                              f"name can. Give the path without it.")
    try:
        os.fsencode(text)
    except UnicodeEncodeError as exc:
        raise FileSystemError(f"{what} = {text!r}: the character {text[exc.start]!r} at position {exc.start} cannot "
                              f"be encoded as a file name ({exc.reason}). Give the path as UTF-8 text.") from None


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


__all__ = ["MARKER_FILE", "OutputError", "AppendFile", "open_append", "copy_file", "check_path_text", "check_readable", "make_folder", "special_kind",
           "write_failure", "atomic_dir", "atomic_file", "check_output", "check_not_inside_output",
           "check_user_file", "describe", "make_parent", "open_run_dir", "user_file",
           "output_lock", "read_marker", "replace_dir", "write_json", "write_marker", "write_text", "fsync_tree"]


# -- native readers and writers (safetensors, tokenizers) take str paths, which must be UTF-8 ------
def _native(path: str | Path) -> str | None:
    """str(path) when a native library can take it, None when its bytes are not UTF-8."""
    try:
        str(path).encode("utf-8")
        return str(path)
    except UnicodeEncodeError:
        return None


def load_safetensors(path: str | Path) -> dict:
    """`safetensors.torch.load_file`, also for a path whose bytes are not UTF-8 (read by Python)."""
    from safetensors.torch import load, load_file

    native = _native(path)
    return load_file(native) if native is not None else load(Path(path).read_bytes())


def save_safetensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, also into a folder whose name is not UTF-8."""
    from safetensors.torch import save, save_file

    native = _native(path)
    if native is not None:
        save_file(tensors, native, metadata=metadata)
    else:
        Path(path).write_bytes(save(tensors, metadata=metadata))


def safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file (its JSON header), read without the weights.

    Raises:
        ValueError: not a safetensors header.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n > 100 * 1024 * 1024:
            raise ValueError(f"a header of {n} bytes")
        header = json.loads(f.read(n))
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def load_hf_tokenizer(path: str | Path):
    """`tokenizers.Tokenizer.from_file`, also for a path whose bytes are not UTF-8."""
    from tokenizers import Tokenizer

    native = _native(path)
    return Tokenizer.from_file(native) if native is not None else Tokenizer.from_str(
        Path(path).read_text(encoding="utf-8"))


def save_hf_tokenizer(tok, path: str | Path) -> None:
    """`tokenizers.Tokenizer.save` (pretty JSON), also into a folder whose name is not UTF-8."""
    native = _native(path)
    if native is not None:
        tok.save(native)
    else:
        Path(path).write_text(tok.to_str(pretty=True), encoding="utf-8")
