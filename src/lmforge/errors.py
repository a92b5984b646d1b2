"""The one exception family lmforge raises for bad input.

Every message names the file or field, the value seen, the value expected and
what to do. The command line prints the message (no traceback) and exits 2.
"""

import errno
import os


class LmforgeError(Exception):
    """Base class: bad input or inconsistent artefacts, explained for a user."""


class ConfigError(LmforgeError):
    """A config file, key, value or command-line override is wrong."""


class ContractError(LmforgeError):
    """Tokenizer, data, model and checkpoint disagree (P1, P4, P6)."""


class DataError(LmforgeError):
    """A corpus, shard or SFT file is missing, empty or malformed."""


class CheckpointError(LmforgeError):
    """A checkpoint folder is missing, incomplete or does not match."""


class TrainingError(LmforgeError):
    """Training cannot go on: a non-finite loss, gradient or weight (the step is not taken)."""


class FileSystemError(LmforgeError):
    """The operating system refused to open, read, list, write, rename or remove a path
    (permission denied, a read-only or full file system, a file-size limit, a link loop...)."""


#: What to do about an OSError, by errno (`os_error`); the rest get the system's words only.
_ADVICE = {
    errno.EACCES: "permission denied: give your user access to it (ls -l shows who may read/write it), or use "
                  "another path",
    errno.EPERM: "operation not permitted: give your user access to it, or use another path",
    errno.EROFS: "the file system is read-only: write to a folder on a writable disk (choose another --out)",
    errno.ENOSPC: "the disk is full: free space on it, or write to another disk, then run the command again",
    errno.EDQUOT: "your disk quota is used up: free space, or write to another disk, then run the command again",
    errno.EFBIG: "the file is larger than this process may write (`ulimit -f` or the file system's limit): raise "
                 "the limit (`ulimit -f unlimited`) or write to another file system",
    errno.ELOOP: "a symbolic link loop (a link that points, directly or not, back to itself): fix or remove "
                 "the link",
    errno.ENAMETOOLONG: "the name is too long for the file system: choose a shorter path",
    errno.ENOTDIR: "a part of the path is a file, not a folder: fix the path",
    errno.EISDIR: "it is a folder, not a file: give the file's path",
    errno.ENOENT: "it does not exist (or vanished while in use): check the path",
    errno.EIO: "an input/output error of the device: check the disk (dmesg), or use another one",
    errno.EMFILE: "too many files open: raise `ulimit -n`",
    errno.ENFILE: "too many files open on the system: close some programs, then run the command again",
    errno.ENXIO: "no such device (a FIFO with no reader, or a removed device): use a regular file",
    errno.ETXTBSY: "the file is in use as a running program: use another path",
    errno.EBUSY: "the path is busy (a mount point, or in use): use another path",
}


def os_error(exc: OSError, path: object = None, doing: str = "use", what: str = "") -> FileSystemError:
    """A FileSystemError for `exc`: names the path (`exc.filename`, else `path`), what was being
    done, the system's reason and what to do about it.

    `doing` is a verb phrase ("read", "write"); `what` an optional tail (e.g. "nothing was
    changed"). Use as `raise os_error(exc, path, "write") from None`.
    """
    name = exc.filename if exc.filename is not None else path
    reason = exc.strerror or str(exc) or type(exc).__name__
    code = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    advice = _ADVICE.get(exc.errno)
    why = f"{reason}{', ' + code if code else ''}"
    text = (f"{_shown(name)}: cannot {doing} it ({why})" if name is not None
            else f"the operating system refused a file operation ({why})")
    if exc.filename2 is not None:
        text += f" (with {_shown(exc.filename2)})"
    text += f"; {advice}." if advice else ". Check the path and its permissions, then run the command again."
    return FileSystemError(text + (f" {what}" if what else ""))


def os_advice(exc: OSError) -> str:
    """What to do about `exc`, in words (from its errno); a generic hint when unknown."""
    return _ADVICE.get(exc.errno, "check the path and its permissions, then run the command again")


def _shown(path: object) -> str:
    """A path for a message: bytes that are not UTF-8 shown escaped, never an encoding error."""
    text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def require_package(module: str, extra: str | None, purpose: str, error: type[LmforgeError] = LmforgeError,
                    package: str | None = None):
    """Import the optional `module` and return it, or explain how to install it: the one
    handling of a missing optional package.

    `extra` is the pyproject extra that installs it (None: the package alone), `purpose` what
    needs it ("GGUF export"), `package` its name on PyPI when not the module's top name.

    Raises:
        `error` (an LmforgeError): the module cannot be imported; the message names the package
        and the command that installs it.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        name = package or module.split(".")[0]
        how = (f'pip install "lmforge[{extra}]" (in a clone of lmforge: pip install -e ".[{extra}]")' if extra
               else f"pip install {name}")
        raise error(f"{purpose} needs the {name} package: {name} is not installed. Install it: {how}.") from None


class Interrupted(Exception):
    """A command stopped by SIGINT/SIGTERM after saving what it could; the command line
    exits 128 + `signum` (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message or f"stopped by signal {signum}")
        self.signum = signum


#: Signals received by the command line's handler (lmforge.signals). Native code that runs Python
#: callbacks (the Rust BPE trainer) can swallow the exception a handler raises; it calls
#: `raise_if_stopped()` when it returns, so the stop is never lost.
_STOP_REQUESTS: list[int] = []


def request_stop(signum: int) -> None:
    _STOP_REQUESTS.append(signum)


def stop_requested() -> bool:
    """True once a SIGINT/SIGTERM was received (the shutdown of the first is under way)."""
    return bool(_STOP_REQUESTS)


def first_stop_signal() -> int | None:
    """The first SIGINT/SIGTERM received, or None."""
    return _STOP_REQUESTS[0] if _STOP_REQUESTS else None


def clear_stop_requests() -> None:
    """Forget earlier signals (a new command starts; tests call the command line repeatedly)."""
    _STOP_REQUESTS.clear()


def raise_if_stopped() -> None:
    if _STOP_REQUESTS:
        raise Interrupted(_STOP_REQUESTS[-1])
