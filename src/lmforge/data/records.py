"""The one reader of record files (JSONL plain or compressed, Parquet, Arrow), for corpora and
conversations alike.

`iter_records(path)` yields `(where, record)`: `where` names the file and line (`f.jsonl:12`)
or row (`f.parquet row 7`) for error messages, `record` is what the line or row decodes
to (any JSON value for JSONL; a dict of column values for Parquet). Every malformed input
becomes a `DataError` naming the file and line: invalid JSON or UTF-8, JSON nested too
deeply, a damaged or truncated Parquet file, a file that vanished or is not a regular file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from lmforge.data.compressed import damage_errors, open_lines
from lmforge.errors import DataError, require_package
from lmforge.fileio import shown_path, special_kind

#: The record files lmforge reads, by the end of their name: JSONL (plain, gzip, Zstandard, bzip2,
#: xz), Parquet, and Arrow (the files of a `datasets` save_to_disk folder, IPC stream or file format).
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.bz2", ".jsonl.xz", ".parquet", ".arrow")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.bz2", ".jsonl.xz")
T = TypeVar("T")


class MissingColumn(DataError):
    """A Parquet or Arrow file without a column asked for (the message lists its columns)."""


def record_suffix(path: str | Path) -> str | None:
    """The RECORD_SUFFIXES entry `path`'s name ends with ("a.jsonl.gz" -> ".jsonl.gz"), or None."""
    name = Path(path).name
    return next((s for s in sorted(RECORD_SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def content_key(value: object) -> str:
    """A stable hash of a text or a JSON-able value: the key of the train/validation split
    and of duplicate detection."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def short(value: object, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def check_text(value: object, where: str, field: str) -> str:
    """`value` if it is a string that encodes as UTF-8.

    Raises:
        DataError: not a string, or a lone surrogate (e.g. JSON "\\ud800") that no
        tokenizer can encode.
    """
    if not isinstance(value, str):
        raise DataError(f"{where}: {field} is {short(value)}; expected a string. Fix or remove the record.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(f"{where}: {field} holds a character that is not valid Unicode text ({exc.reason} at "
                        f"character {exc.start}, e.g. a lone surrogate escape like \\ud800). Fix or remove "
                        f"the record.") from None
    return value


def read_items(path: str | Path, key: str, items: str, make: Callable[[object, str], T], empty_help: str) -> list[T]:
    """`make(record, where)` for every record of the `.jsonl` or `.parquet` file `path`, in file
    order: the one reader of a fine-tuning section's data file (`key`: "sft.data", "dpo.data";
    `items`: what the records are, "conversations"; `empty_help`: what to do about an empty file).

    Raises:
        DataError: a missing file, another suffix, a malformed record (naming the file and line /
        row), or a file with no records.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else _not_regular(path) or "does not exist"
        raise DataError(f"{key} = {str(path)!r} {what}. Use \"stdlib\" or a .jsonl / .parquet file of {items}.")
    if record_suffix(path) is None:
        raise DataError(f"{key} = {str(path)!r}: unsupported file type {path.suffix!r}; expected one of "
                        f"{', '.join(RECORD_SUFFIXES)} (or \"stdlib\").")
    out = [make(record, where) for where, record in iter_records(path)]
    if not out:
        raise DataError(f"{path}: the file holds no {items} (it is empty); {empty_help}.")
    return out


def _not_regular(path: Path) -> str | None:
    """"is a FIFO (named pipe), not a regular file" and the like, or None (absent, a regular file
    or a folder): a special file is never read (a FIFO would block, a device never end)."""
    kind = special_kind(path)
    return f"is {kind}, not a regular file (never read)" if kind else None


def iter_records(path: str | Path, columns: list[str] | None = None,
                 on_open: Callable[[Callable[[], int]], None] | None = None,
                 take: Callable[[], bool] | None = None) -> Iterator[tuple[str, object]]:
    """(where, record) for every record of a `.jsonl` or `.parquet` file, in file order.
    `columns` (Parquet only) reads just those columns; a missing one is an error. `on_open`,
    when given, is called once the file is open with a function that says how many bytes of
    the file on disk are read so far (JSONL, compressed or not: the file's position; Parquet
    and Arrow: its size x the share of rows read), for progress. `take`, when given, is called once
    a record (a non-blank line, a row) in file order, as the record is reached and before it is
    given: a record it answers False to is passed over unread (`lmforge.data.parallel`: the
    records of other tasks); a `take` with `peek(n)` (its next n answers, none taken) spares the
    Parquet and Arrow rows it will not take their conversion.

    Raises:
        DataError: the file is missing or not a regular file, has another suffix, or a
        line/row cannot be decoded (naming the file and line or row).
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else _not_regular(path) or "does not exist (it was listed: did it move?)"
        raise DataError(f"{shown_path(path)} {what}; expected one of {', '.join(RECORD_SUFFIXES)}.")
    kind = record_suffix(path)
    on_open = on_open or (lambda position: None)
    if kind in JSONL_SUFFIXES:
        yield from _jsonl(path, kind, on_open, take)
    elif kind == ".parquet":
        yield from _rows(*_parquet(path, columns), on_open, take)
    elif kind == ".arrow":
        yield from _rows(*_arrow(path, columns), on_open, take)
    else:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; expected one of {RECORD_SUFFIXES}.")


def _jsonl(path: Path, kind: str, on_open: Callable, take: Callable[[], bool] | None) -> Iterator[tuple[str, object]]:
    try:
        f, position = open_lines(path, kind)
    except OSError as exc:
        raise DataError(f"{shown_path(path)}: cannot be read ({exc.strerror}).") from None
    on_open(position)
    lineno = 0
    shown = shown_path(path)  # once a file: a record's `where` is made for every line
    with f:
        lines = iter(f)
        while True:
            try:
                raw = next(lines)
            except StopIteration:
                return
            except damage_errors(kind) as exc:
                raise DataError(f"{shown_path(path)}: damaged or cut short after line {lineno} ({_first_line(exc)}). "
                                f"Its documents after that line would be lost: re-write the file (or restore it "
                                f"from its source).") from None
            lineno += 1
            if not raw.strip() or (take is not None and not take()):
                continue
            where = f"{shown}:{lineno}"
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise DataError(f"{where}: not valid JSON ({exc}). Fix or remove the line.") from None
            except ValueError as exc:  # e.g. an integer of more than 4300 digits (Python's int limit)
                raise DataError(f"{where}: a value cannot be read ({str(exc)[:100]}). Fix or remove the line.") from None
            except RecursionError:
                raise DataError(f"{where}: JSON nested too deeply to read. Fix or remove the line.") from None
            yield where, record


def _parquet(path: Path, columns: list[str] | None) -> tuple:
    pq = require_package("pyarrow.parquet", "parquet", f"{path}: reading Parquet", DataError)
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        total = pf.metadata.num_rows
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({_first_line(exc)}). Re-write the file.") from None
    _check_columns(path, names, columns)
    return path, pf.iter_batches(columns=columns, batch_size=1024), total


def _arrow(path: Path, columns: list[str] | None) -> tuple:
    """An Arrow IPC file (stream format, as `datasets` writes, or file format): (path, its record
    batches, its rows or 0 when unknown), for `_rows`."""
    pa = require_package("pyarrow", "parquet", f"{shown_path(path)}: reading Arrow", DataError)
    import pyarrow.ipc as ipc

    source = pa.memory_map(str(path), "r")
    try:
        try:
            reader = ipc.open_stream(source)
            batches, total = _ended_stream(path, reader), 0  # a stream does not say its rows up front
        except pa.ArrowInvalid:
            reader = ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            total = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        names = reader.schema.names
    except Exception as exc:
        raise DataError(f"{shown_path(path)}: not a readable Arrow file ({_first_line(exc)}). Re-write the "
                        f"file.") from None
    _check_columns(path, names, columns)
    if columns:
        batches = (batch.select(columns) for batch in batches)  # selected as each is read
    return path, batches, total


#: The end of an Arrow IPC stream (a continuation marker and a length of 0): every writer puts it
#: last when it closes the stream (datasets' ArrowWriter included).
ARROW_STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _ended_stream(path: Path, reader) -> Iterator:
    """The record batches of an Arrow IPC stream; a stream without its end marker was cut short
    (at a batch boundary pyarrow stops without a word, its later batches lost): an error."""
    yield from reader
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - len(ARROW_STREAM_END)))
        if f.read() != ARROW_STREAM_END:
            raise EOFError("the stream ends without its end-of-stream marker: it was cut short")


def _check_columns(path: Path, names: list[str], columns: list[str] | None) -> None:
    """Raises MissingColumn (listing the file's columns `names`) when one of `columns` is not there."""
    missing = [c for c in columns or () if c not in names]
    if missing:
        raise MissingColumn(f"{shown_path(path)}: no {', '.join(repr(c) for c in missing)} column (columns: {names}).")


def _rows(path: Path, batches, total: int, on_open: Callable,
          take: Callable[[], bool] | None = None) -> Iterator[tuple[str, object]]:
    """(where, record) for every row of a Parquet or Arrow file's record `batches` (`total`
    rows, 0 when unknown) that `take` takes; a batch that cannot be read is a DataError naming the
    last good row."""
    row = 0
    shown = shown_path(path)
    size = path.stat().st_size
    on_open(lambda: size * row // total if total else 0)
    while True:
        try:
            batch = next(batches)
            # which rows `take` will take, asked ahead without taking them (an Owner's `peek`), so that
            # the rows of other tasks are not made Python objects; `take` itself is asked row by row below
            ahead = take.peek(batch.num_rows) if take is not None and hasattr(take, "peek") else None
            if ahead is None or all(ahead):
                records = batch.to_pylist()
            else:
                mine = iter(batch.filter(ahead).to_pylist() if any(ahead) else ())
                records = [next(mine) if own else None for own in ahead]
        except StopIteration:
            return
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
            raise DataError(f"{shown_path(path)}: damaged or cut short after row {row} ({_first_line(exc)}). Its "
                            f"rows after that one would be lost: re-write the file.") from None
        for record in records:
            row += 1
            if take is None or take():  # asked as the row is reached: the caller sees where the stream is
                yield f"{shown} row {row}", record


def _first_line(exc: BaseException) -> str:
    """The first line of a library's message, its own "error:" words left out (the command's one
    `error:` line is lmforge's: "zstd decompress error: ..." would make a second)."""
    import re

    text = re.sub(r"(?i)\berror:\s*", "", str(exc).strip())
    return text.splitlines()[0][:160] if text else type(exc).__name__


__all__ = ["RECORD_SUFFIXES", "MissingColumn", "check_text", "content_key", "iter_records", "record_suffix", "short"]
