"""Document sources: the Python standard library, a folder of text files, JSONL, Parquet.

Every source yields `Document(name, text)` in a deterministic order and assigns each
document to "train" or "val" by a hash of its key (the module name for the standard
library, the relative path for a folder, the content for JSONL/Parquet records), so
the split never changes between runs, machines or Python hash seeds.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.data.records import RECORD_SUFFIXES, check_text, content_key, iter_records, short
from lmforge.errors import DataError, os_error
from lmforge.fileio import shown_path

TEXT_SUFFIXES = (".txt", ".md", ".py")
SPLITS = ("train", "val")


@dataclass(frozen=True)
class Document:
    name: str
    """Where it came from: a module name, a relative path, or `file:line`."""
    text: str
    key: str
    """What the split is decided on (module name, relative path, or content hash)."""


@dataclass
class SourceStats:
    documents: int = 0
    bad_utf8: int = 0
    empty: int = 0
    not_regular: int = 0
    """Files with a corpus suffix that are not regular files (a FIFO, a device, a link to one): never read."""
    skipped_names: list[str] = field(default_factory=list)


def split_of(key: str, val_fraction: float) -> str:
    """"val" for about `val_fraction` of keys, decided by sha256 (stable everywhere)."""
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
    return "val" if (h % 1_000_000) < val_fraction * 1_000_000 else "train"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_name(rel: Path) -> str:
    """`email/mime/text.py` -> `email.mime.text`; `json/__init__.py` -> `json`."""
    parts = list(rel.with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _unlistable(exc: OSError) -> None:
    """os.walk skips a folder it cannot list; a corpus never silently loses one."""
    raise os_error(exc, doing="list", what="Its files would be missing from the corpus.")


def _walk(root: Path, suffixes: tuple[str, ...], skip_dirs: set[str], stats: "SourceStats | None" = None
          ) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root, onerror=_unlistable):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if not name.endswith(suffixes):
                continue
            # regular files only, never read otherwise: a FIFO, a device or a link to one named *.txt would
            # block the read forever or never end (/dev/zero); each is counted and named in the report
            try:
                regular = stat.S_ISREG(path.stat().st_mode)
            except OSError:  # a broken link or a loop: _read_text names the system's reason
                regular = True
            if regular:
                yield path
            elif stats is not None:
                stats.not_regular += 1
                stats.skipped_names.append(shown_path(path))


def _read_text(path: Path, stats: SourceStats, on_bad_utf8: str) -> str | None:
    # A file name whose bytes are not UTF-8 is a real Linux name: its text is read like any other,
    # and the document is named with those bytes as \xNN (shown_path).
    try:
        data = path.read_bytes()
    except OSError as exc:  # vanished, unreadable, a broken link
        raise DataError(f"{shown_path(path)}: cannot be read ({exc.strerror}). Restore it or remove it from the "
                        f"corpus.") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if on_bad_utf8 == "error":
            raise DataError(
                f"{shown_path(path)} is not UTF-8 ({exc.reason} at byte {exc.start}). Convert it to UTF-8, "
                f"remove it, or set data.on_bad_utf8=\"skip\" to skip such files with a count."
            ) from None
        stats.bad_utf8 += 1
        stats.skipped_names.append(shown_path(path))
        return None


def iter_documents(
    source: str,
    split: str | None = None,
    val_fraction: float = 0.02,
    include_tests: bool = False,
    on_bad_utf8: str = "skip",
    stats: SourceStats | None = None,
) -> Iterator[Document]:
    """Yield the documents of `source` (all of them, or only those of `split`).

    Args:
        source: "stdlib", a folder, a `.jsonl` file or a `.parquet` file.
        split: "train", "val" or None (both).
    Raises:
        DataError: missing or empty source, malformed JSONL, a non-UTF-8 file under "error".
    """
    if split is not None and split not in SPLITS:
        raise DataError(f"split {split!r}: expected one of {SPLITS}.")
    stats = stats if stats is not None else SourceStats()
    for doc in _iter_all(source, include_tests, on_bad_utf8, stats):
        if not doc.text:
            stats.empty += 1
            continue
        if split is None or split_of(doc.key, val_fraction) == split:
            stats.documents += 1
            yield doc


def _iter_all(source: str, include_tests: bool, on_bad_utf8: str, stats: SourceStats) -> Iterator[Document]:
    if source == "stdlib":
        root = stdlib_root()
        skip = {"site-packages", "dist-packages", "__pycache__"}
        if not include_tests:
            skip |= {"test", "tests"}
        for path in _walk(root, (".py",), skip, stats):
            text = _read_text(path, stats, on_bad_utf8)
            if text is not None:
                rel = path.relative_to(root)
                yield Document(str(rel), text, key=module_name(rel))
        return
    path = Path(source)
    if not path.exists():
        raise DataError(
            f"data.source = {source!r} does not exist. Use \"stdlib\", a folder of "
            f"{'/'.join(TEXT_SUFFIXES)} files, a .jsonl file with a \"text\" field, or a .parquet file."
        )
    if path.is_dir():
        found = False
        for file in _walk(path, TEXT_SUFFIXES, {"__pycache__"}, stats):
            found = True
            text = _read_text(file, stats, on_bad_utf8)
            if text is not None:
                rel = shown_path(file.relative_to(path).as_posix())
                yield Document(rel, text, key=rel)
        if not found:
            raise DataError(
                f"data.source folder {path} holds no {'/'.join(TEXT_SUFFIXES)} files. "
                f"Add text files or point data.source at another folder."
            )
        return
    if path.suffix in RECORD_SUFFIXES:
        yield from _iter_records(path)
        return
    raise DataError(
        f"data.source = {source!r}: unsupported file type {path.suffix!r}; expected a folder, "
        f".jsonl or .parquet."
    )


def _iter_records(path: Path) -> Iterator[Document]:
    """JSONL records with a string "text" field, or a Parquet file's "text" column."""
    for where, record in iter_records(path, columns=["text"] if path.suffix == ".parquet" else None):
        if path.suffix == ".parquet" and record.get("text") is None:
            continue  # a null cell: no document
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DataError(
                f"{where}: expected an object with a string \"text\" field, got "
                f"{type(record).__name__} with keys {sorted(record)[:10] if isinstance(record, dict) else '-'}"
                f"{'' if not isinstance(record, dict) or 'text' not in record else f' (text is {short(text)})'}."
            )
        name = path.name + where[len(str(path)):]  # "f.jsonl:12", "f.parquet row 7"
        yield Document(name, check_text(text, where, '"text"'), key=content_key(text))
