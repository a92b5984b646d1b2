"""Input checks and path text: a path as text that UTF-8 files can hold and back (`path_text`,
`path_from_text`), a path for messages (`shown_path`), a path no file system call can take
(`check_path_text`), a file that cannot be read (`check_readable`), and JSON text nested too
deeply to read (`loads_json`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lmforge.errors import FileSystemError, os_error


def loads_json(text: str):
    """`json.loads`; input nested past Python's recursion limit is a ValueError that says so
    (callers that report ValueError as damaged JSON then name the file)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to read (Python's recursion limit)") from None


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
