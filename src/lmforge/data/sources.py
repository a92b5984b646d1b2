"""Document sources: the Python standard library, a folder of text files, JSONL, Parquet.

Every source yields `Document(name, text)` in a deterministic order and assigns each
document to "train" or "val" by a hash of its key (the module name for the standard
library, the relative path for a folder, the content for JSONL/Parquet records), so
the split never changes between runs, machines or Python hash seeds. The files a source names
are listed in `inputs.py` (`list_inputs`); this module reads the documents out of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lmforge.data.inputs import InputFile, SourceStats, list_inputs
from lmforge.data.records import MissingColumn, check_text, content_key, iter_records, record_suffix, short
from lmforge.errors import DataError
from lmforge.fileio import shown_path

SPLITS = ("train", "val")


@dataclass(frozen=True)
class Document:
    name: str
    """Where it came from: a module name, a relative path, or `file:line`."""
    text: str
    key: str
    """What the split is decided on (module name, relative path, or content hash)."""


def split_of(key: str, val_fraction: float) -> str:
    """"val" for about `val_fraction` of keys, decided by sha256 (stable everywhere)."""
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
    return "val" if (h % 1_000_000) < val_fraction * 1_000_000 else "train"


def module_name(rel: Path) -> str:
    """`email/mime/text.py` -> `email.mime.text`; `json/__init__.py` -> `json`."""
    parts = list(rel.with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


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
        stats.skip(shown_path(path))
        return None


def iter_documents(
    source: str,
    split: str | None = None,
    val_fraction: float = 0.02,
    include_tests: bool = False,
    on_bad_utf8: str = "skip",
    stats: SourceStats | None = None,
    text_field: str = "text",
    take: Callable[[], bool] | None = None,
) -> Iterator[Document]:
    """Yield the documents of `source` (all of them, or only those of `split`).

    Args:
        source: "stdlib"; a folder of text files (TEXT_SUFFIXES) and record shards
            (RECORD_SUFFIXES); a glob of such files; one such file; a `datasets`
            save_to_disk folder; or "hf:OWNER/NAME[@REVISION][:PATH]", a dataset of the local
            Hugging Face cache (`hf_snapshot`; never downloaded). Files are read in sorted path order.
        split: "train", "val" or None (both).
        text_field: the field / column of a record that holds its text.
        take: called once a record of the source (a text file, a JSONL line, a row), in reading
            order, before it is read: a record it answers False to is passed over (not read, not
            counted): `lmforge.data.parallel`'s tasks each read their own records of one stream.
    Raises:
        DataError: missing or empty source, a glob that matches nothing, a malformed record
        (naming the file and line or row), a record without `text_field` (naming the fields
        it has), a non-UTF-8 file under "error".
    """
    if split is not None and split not in SPLITS:
        raise DataError(f"split {split!r}: expected one of {SPLITS}.")
    stats = stats if stats is not None else SourceStats()
    for doc in _iter_all(source, include_tests, on_bad_utf8, stats, text_field, take):
        if not doc.text:
            stats.empty += 1
            continue
        if split is None or split_of(doc.key, val_fraction) == split:
            stats.documents += 1
            yield doc


def capped(documents: Iterable[Document], max_bytes: float) -> Iterator[Document]:
    """`documents` until `max_bytes` bytes of UTF-8 text have been given (the document that
    reaches the cap included); every document when `max_bytes` <= 0."""
    used = 0
    for doc in documents:
        yield doc
        used += len(doc.text.encode("utf-8"))
        if 0 < max_bytes <= used:
            return


def _iter_all(source: str, include_tests: bool, on_bad_utf8: str, stats: SourceStats,
              text_field: str = "text", take: Callable[[], bool] | None = None) -> Iterator[Document]:
    files = list_inputs(source, include_tests, stats)
    stats.input_bytes, stats.input_done = sum(f.size for f in files), 0
    for f in files:
        if f.kind == "records":
            yield from _iter_records(f.path, text_field, stats, take)
        elif take is None or take():
            text = _read_text(f.path, stats, on_bad_utf8)
            if text is not None:
                yield Document(f.rel, text, key=module_name(Path(f.rel)) if f.kind == "module" else f.rel)
        stats.position = None
        _check_unchanged(f)
        stats.input_done += f.size


def _check_unchanged(f: InputFile) -> None:
    """Raises DataError when `f` is not the file that was listed any more (size or modification
    time): documents read from a file being written are not the corpus the listing named."""
    try:
        st = f.path.stat()
        now = (st.st_size, st.st_mtime_ns)
    except OSError as exc:
        raise DataError(f"{shown_path(f.path)}: gone while the corpus was read ({exc.strerror}). Nothing is "
                        f"written from a corpus that changes; run again once it stays put.") from None
    if now != (f.size, f.mtime_ns):
        raise DataError(f"{shown_path(f.path)}: changed while the corpus was read ({f.size:,} bytes when listed, "
                        f"{now[0]:,} now; or modified since). Nothing is written from a corpus that changes; run "
                        f"again once it stays put.")


def _iter_records(path: Path, text_field: str = "text", stats: SourceStats | None = None,
                  take: Callable[[], bool] | None = None) -> Iterator[Document]:
    """Records with a string `text_field` field (JSONL) or column (Parquet, Arrow); a null cell
    of a column is no document. `stats.position` follows the read."""
    columnar = record_suffix(path) in (".parquet", ".arrow")
    field = f'"{text_field}"'
    cut = len(shown_path(path))  # "/data/f.jsonl:12" -> "f.jsonl:12"
    on_open = None if stats is None else (lambda position: setattr(stats, "position", position))
    try:
        for where, record in iter_records(path, columns=[text_field] if columnar else None, on_open=on_open,
                                          take=take):
            text = record.get(text_field) if isinstance(record, dict) else None
            if columnar and text is None:
                continue
            if not isinstance(text, str):
                if isinstance(record, dict) and text_field not in record:
                    raise DataError(f"{where}: the record has no {field} field (its fields: {sorted(record)[:20]}). "
                                    f"Set data.text_field to the field that holds the text.")
                whose = f" whose {field} is {short(text)}" if isinstance(record, dict) else ""
                raise DataError(f"{where}: expected an object with a string {field} field, got "
                                f"{type(record).__name__}{whose}.")
            name = path.name + where[cut:]  # "f.jsonl:12", "f.parquet row 7"
            yield Document(name, check_text(text, where, field), key=content_key(text))
    except MissingColumn as exc:
        raise DataError(f"{exc} Set data.text_field to the column that holds the text.") from None
