"""Compressed JSONL read whole or not at all: gzip (every member), bzip2 and xz (every stream:
`_Streams`), Zstandard (every frame: `_ZstdFrames`). A stream cut short, a damaged later stream or
bytes after the last one raise while the file is read (`damage_errors` says what each kind
raises); `lmforge.data.records` turns them into a DataError naming the file and the last good line.
"""

from __future__ import annotations

import io
from pathlib import Path

from lmforge.errors import DataError, require_package
from lmforge.fileio import shown_path


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every Zstandard frame of `raw`, one after another (`zstd -T0`,
    pzstd and `cat a.zst b.zst` write several; skippable frames give nothing). A file that ends
    inside a frame raises EOFError, as gzip, bz2 and lzma do: zstandard's own stream reader
    returns what it has and stops without a word. Input goes in small pieces, so one read's
    output stays bounded whatever the compression ratio."""

    PIECE = 1024  # at most ~32 MiB out per piece (Zstandard's largest ratio is about 32,000)

    def __init__(self, raw, zstd):
        super().__init__()
        self.raw, self.zstd = raw, zstd
        self.dobj = zstd.ZstdDecompressor().decompressobj()
        self.fed = 0  # compressed bytes given to the current frame's decompressor
        self.pending, self.at = b"", 0  # output not handed out yet: pending[at:]
        self.done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.at >= len(self.pending) and not self.done:
            self.pending, self.at = self._fill(), 0
        n = min(len(buffer), len(self.pending) - self.at)
        buffer[:n] = memoryview(self.pending)[self.at: self.at + n]
        self.at += n
        return n

    def _fill(self) -> bytes:
        """The output of the next piece of input (maybe empty); at the end of the file, b"" and
        `done`, or EOFError when the last frame is not complete."""
        data = self.raw.read(self.PIECE)
        if not data:
            if self.fed and not self.dobj.eof:
                raise EOFError("the file ends inside a Zstandard frame: it was cut short")
            self.done = True
            return b""
        out = []
        while data:
            self.fed += len(data)
            out.append(self.dobj.decompress(data))
            if not self.dobj.eof:
                break
            data = self.dobj.unused_data  # the next frame's first bytes
            self.dobj = self.zstd.ZstdDecompressor().decompressobj()
            self.fed = 0
        return b"".join(out)

    def close(self) -> None:
        try:
            self.raw.close()
        finally:
            super().close()


class _Streams(io.RawIOBase):
    """The decompressed bytes of every bzip2 or xz stream of `raw`, one after another (pbzip2,
    `xz -T0` and `cat a.bz2 b.bz2` write several), all or nothing: bz2.BZ2File and lzma.LZMAFile
    stop without a word at the first bytes after a stream that do not begin another (a damaged
    later stream, trailing garbage), so its documents would be lost; here those bytes raise
    OSError (bz2) or LZMAError (xz), and a file that ends inside a stream EOFError, as gzip and
    Zstandard do. xz's stream padding (NUL bytes, a multiple of four, after a stream) is allowed,
    as `xz -d` allows it. One read's output is bounded (`max_length`), whatever the ratio."""

    PIECE = 1 << 16
    OUT = 1 << 20

    def __init__(self, raw, kind: str):
        super().__init__()
        if kind == ".jsonl.bz2":
            import bz2

            self.new, self.name, self.padding = bz2.BZ2Decompressor, "bzip2", False
            self.bad = OSError
        else:
            import lzma

            self.new, self.name, self.padding = lzma.LZMADecompressor, "xz", True
            self.bad = lzma.LZMAError
        self.raw = raw
        self.dec = self.new()
        self.fed = 0  # compressed bytes given to the current stream's decompressor
        self.data = b""  # bytes read from `raw`, not given to a decompressor yet
        self.streams = 0  # complete streams read
        self.zeros = 0  # NUL padding bytes since the last stream ended
        self.done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.done:
            out = self._next(min(len(buffer), self.OUT))
            if out:
                n = len(out)
                buffer[:n] = out
                return n
        return 0

    def _next(self, size: int) -> bytes:
        """The next piece of output (maybe empty); `done` at the end of the file."""
        if self.dec.eof:  # a stream ended: what follows is another stream, xz's padding, or nothing
            self.streams += 1
            self.data = self.dec.unused_data + self.data
            self.dec, self.fed = self.new(), 0
        if self.dec.needs_input and not self.data:
            self.data = self.raw.read(self.PIECE)
            if not self.data:
                self._end()
                return b""
        if self.fed == 0 and self.streams and self.padding:
            rest = self.data.lstrip(b"\0")
            self.zeros += len(self.data) - len(rest)
            self.data = rest
            if not rest:
                return b""
            if self.zeros % 4:
                raise self.bad(f"{self.zeros} NUL bytes after stream {self.streams}: xz's stream padding is a "
                               f"multiple of four")
            self.zeros = 0
        data, self.data = self.data, b""
        try:
            out = self.dec.decompress(data, size)
        except self.bad as exc:
            if self.fed == 0 and self.streams:  # the first bytes after a complete stream
                raise self.bad(f"the bytes after {self.name} stream {self.streams} are not another {self.name} "
                               f"stream (a damaged stream, or trailing data: {exc})") from None
            raise
        self.fed += len(data)
        return out

    def _end(self) -> None:
        if self.fed and not self.dec.eof:
            raise EOFError(f"the file ends inside {self.name} stream {self.streams + 1}: it was cut short")
        if self.zeros % 4:
            raise self.bad(f"{self.zeros} NUL bytes after stream {self.streams}: xz's stream padding is a "
                           f"multiple of four")
        self.done = True

    def close(self) -> None:
        try:
            self.raw.close()
        finally:
            super().close()


#: The compressed JSONL suffixes read through the standard library's modules (each raises EOFError
#: on a stream cut short; bzip2 and xz through `_Streams`, which refuses what follows a stream too).
_STDLIB_CODECS = {".jsonl.gz": "gzip", ".jsonl.bz2": "bz2", ".jsonl.xz": "lzma"}


def open_lines(path: Path, kind: str):
    """(a binary file object over the decompressed bytes of `path` (plain, gzip, bzip2, xz or
    Zstandard, every stream / member / frame of it), a function giving the position in the file
    on disk). A stream or frame cut short raises EOFError while it is read."""
    raw = open(path, "rb")
    try:
        if kind in _STDLIB_CODECS:
            return _Closing(_stdlib_reader(kind, raw), raw), raw.tell
        if kind == ".jsonl.zst":
            zstd = require_package("zstandard", "zstandard", f"{shown_path(path)}: reading Zstandard", DataError)
            return io.BufferedReader(_ZstdFrames(raw, zstd), 1 << 20), raw.tell
    except BaseException:
        raw.close()
        raise
    return raw, raw.tell


def _stdlib_reader(kind: str, raw):
    """gzip's reader, or bzip2's or xz's (`_Streams`), of the open file `raw` (every member /
    stream of it)."""
    if kind == ".jsonl.gz":
        import gzip

        return gzip.GzipFile(fileobj=raw, mode="rb")
    return io.BufferedReader(_Streams(raw, kind), 1 << 20)  # bz2 / xz: every stream, nothing after them


class _Closing:
    """A decompressing file object that closes the file on disk it reads when it is closed
    (gzip, bz2 and lzma leave a `fileobj` they were given open)."""

    def __init__(self, f, raw):
        self.f, self.raw = f, raw

    def __iter__(self):
        return iter(self.f)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.f.close()
        finally:
            self.raw.close()


def damage_errors(kind: str) -> tuple[type[BaseException], ...]:
    """What a damaged file of `kind` raises while it is read (gzip: EOFError, BadGzipFile, an
    OSError; bz2 and lzma: EOFError, OSError, LZMAError; Zstandard: EOFError, ZstdError)."""
    errors: tuple[type[BaseException], ...] = (EOFError, OSError)
    if kind == ".jsonl.xz":
        import lzma

        errors += (lzma.LZMAError,)
    if kind == ".jsonl.zst":
        zstd = require_package("zstandard", "zstandard", "reading Zstandard", DataError)
        errors += (zstd.ZstdError,)
    return errors


__all__ = ["damage_errors", "open_lines"]
