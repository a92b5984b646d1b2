"""What the operating system refused: a failed write (in Python or in a native library) as
the system's error, then as a `FileSystemError` naming the path as the user knows it.

- Whatever the operating system refuses during a write (permission denied, a read-only or
  full file system, the `ulimit -f` size limit, a link loop), in Python or in a native
  library (safetensors, torch, tokenizers), becomes a `FileSystemError` naming the path and
  what to do; the temporary is removed, the lock released, and the output left as it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
from pathlib import Path

from lmforge.errors import FileSystemError, LmforgeError, os_error


# -- what the operating system refused ----------------------------------------------------------
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]")
#: Free space below which a write that failed without saying why is taken as "disk full".
NEARLY_FULL = 16 << 20


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
        if free < NEARLY_FULL:
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


def failure_or_none(exc: BaseException, tmp: Path, out: Path) -> FileSystemError | None:
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
