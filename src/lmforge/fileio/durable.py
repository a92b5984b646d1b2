"""Durable renames: fsync a file or a folder tree, and move a complete folder into place
(`replace_dir`) with the previous output removed only once the new one is there (an atomic
exchange where the kernel has one, else two renames with the old kept until the new is in
place), after checking that the previous output can be removed at all (`check_removable`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import tempfile
from pathlib import Path

from lmforge.errors import FileSystemError


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


def exchange_paths(a: Path, b: Path) -> bool:
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
        if exchange_paths(new, out):
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
