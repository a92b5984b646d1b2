"""One writer per output: the lock beside an output while it is written (`output_lock`), and
the folder it goes into (`make_parent`).

- A lock file (`.NAME.lock` beside the output) refuses a second writer of the same output
  while the first runs; a lock whose process is gone is taken over.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from lmforge.errors import os_advice, os_error
from lmforge.fileio.ownership import OutputError


# -- locking -----------------------------------------------------------------------------------
def pid_alive(pid: int) -> bool:
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
            if pid and pid_alive(pid):
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
