"""Who owns an output: lmforge's marker, what is at a path (in words), and what a command may write.

- An output folder is written only if it is absent, empty, or holds what the *same*
  command wrote before, recognised by lmforge's own marker file (`MARKER_FILE`, a small
  JSON naming the command) — never by file names other tools also use. An existing file,
  `.`, a parent of the current folder, or another command's output is refused with a
  message that says what it is.

The marker is written by `write_marker` (in `lmforge.fileio.writers`: atomically, like any file).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from lmforge.errors import LmforgeError, os_error
from lmforge.fileio.paths import loads_json

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
    "rl": "an RL run folder",
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
    return mode_kind(mode) if not stat.S_ISDIR(mode) else None


def mode_kind(mode: int) -> str | None:
    """'a folder', 'a FIFO (named pipe)', 'a device', 'a socket' for an `st_mode` that is not a
    regular file's; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a socket"


class SpecialFile(Exception):
    """`read_capped` met something other than a regular file: `kind` says what (`mode_kind`)."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


def read_capped(path: str | Path, max_bytes: int) -> bytes:
    """At most `max_bytes` + 1 bytes of the regular file `path` (the caller refuses more), opened
    non-blocking and checked before reading: a FIFO would block, a device never end.

    Raises:
        OSError (or ValueError, a NUL in the path): from opening or reading, for the caller to word.
        SpecialFile: `path` is not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    kind = mode_kind(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise SpecialFile(kind)
    with os.fdopen(fd, "rb") as f:
        return f.read(max_bytes + 1)


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


def check_output(out: Path, command: str, what: str | None = None, replace_whole: bool = False,
                 inputs=()) -> None:
    """Raise OutputError unless `command` may write the folder `out`: absent, empty, or
    carrying `command`'s own marker, and none of its `inputs` ((name, path) pairs: `check_not_input`).

    Raises:
        OutputError: `out` is a file, `.`, a parent of the current folder, another
        command's output, a checkpoint, a folder lmforge did not write, or one of `inputs`.
    """
    _check_owner(Path(out), command, what or f"`lmforge {command}`", replace_whole)
    check_not_input(out, inputs)


def _check_owner(out: Path, command: str, what: str, replace_whole: bool) -> None:
    """`check_output` without the inputs."""
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


def listed_files(folder: Path) -> list[str]:
    """Every path under `folder` (relative, '/'-separated), for the marker: what lmforge wrote."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.name != MARKER_FILE)


def _unlisted(folder: Path, marker: dict) -> set[str]:
    """Paths under an lmforge output that its marker does not list (a user's additions).
    A marker without a manifest (a run folder, written step by step) lists nothing to compare."""
    listed = marker.get("files")
    if not isinstance(listed, list):
        return set()
    return set(listed_files(folder)) - set(listed)


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


def check_not_input(out: str | Path, inputs, flag: str = "--out", own_check=None) -> None:
    """Refuse an output path that is, holds, or lies inside one of the command's inputs, with or
    without --force: writing it would destroy the input, or make the output part of it.

    `inputs`: (name, path) pairs, `name` how the input was given ("--tasks", "data.source", or
    words such as "the Hugging Face folder"); an empty or None path is skipped. Refused:

    - `out` is the input: the same path once both are resolved (`./x/../t.jsonl`, a symbolic link
      to it, a link in a parent), or, both existing, the same file (`os.path.samefile`: a hard link);
    - the input is inside `out` (an output folder is replaced whole);
    - `out` is inside an input folder (a corpus, a Hugging Face folder), except a run folder of a
      command whose outputs hold others by design (NESTING: a run's evaluation results).

    `own_check`, when given, is the output's own check (the writer's, `check_output` or
    `check_user_file`): called first where `out` is refused here, so a refusal it makes too is said
    in its words.

    Raises:
        OutputError: naming `flag`, the output, the input and what to do.
    """
    refusal = _input_refusal(Path(out), inputs, flag)
    if refusal is not None:
        if own_check is not None:
            own_check()
        raise refusal


def _input_refusal(out: Path, inputs, flag: str) -> "OutputError | None":
    try:
        out_res = out.resolve()
    except (OSError, RuntimeError, ValueError):  # a link loop, a NUL: the writer's own checks say so
        return None
    for name, value in inputs:
        if value is None or not str(value):
            continue
        path = Path(value)
        if name.startswith("-"):
            given = f"{name} {value}"
        elif " " in name:
            given = f"{value} ({name})"
        else:
            given = f"{name} = {str(value)!r}"
        try:
            res = path.resolve()
        except (OSError, RuntimeError, ValueError):
            continue
        same = res == out_res
        if not same:
            try:
                same = os.path.samefile(out, path)  # a hard link (or a link the resolution missed)
            except (OSError, ValueError):
                same = False
        if same:
            how = "" if res == out_res else " (the same file under another name: a hard link)"
            return OutputError(f"{flag} {out} is {given}{how}, an input of this command: writing it would destroy "
                               f"that input, --force or not. Choose another {flag}.")
        if out_res in res.parents:
            return OutputError(f"{flag} {out} holds {given}, an input of this command: replacing {out} would "
                               f"delete it. Choose another {flag}, outside it.")
        if res in out_res.parents and _is_dir(res):
            marker = read_marker(res)
            if marker is None or marker["command"] not in NESTING:
                return OutputError(f"{flag} {out} is inside {given}, a folder this command reads: the output would "
                                   f"become part of its input. Choose another {flag}, outside it.")
    return None


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False
