"""Pretokenized shards: write them (`prepare`) and read them (`Shard`).

A prepared data folder holds, per split ("train", "val"):

- `{split}.bin`: every document's tokens back to back, `contract.token_dtype`
  (uint16 when the vocab fits, else uint32). Each document is `[bos] text [eos]` (no BOS for a
  model without one: the contract's `document_start`).
- `{split}.idx`: int64 offsets, n_documents + 1 of them: document i is
  `bin[idx[i]:idx[i+1]]` (so idx[0] = 0 and idx[-1] = number of tokens).

plus `contract.json` (copied from the tokenizer) and `meta.json` (documents, tokens,
UTF-8 bytes and max id per split). Reading uses `numpy.memmap`: memory stays flat
whatever the corpus size. The folder is written through `lmforge.fileio.atomic_dir`, so a failed prepare leaves
nothing half-written and the previous data folder intact.
"""

from __future__ import annotations

import errno
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmforge.contract import CONTRACT_FILE, Contract, check_match
from lmforge.data.fast_encode import batch_encoder
from lmforge.data.reports import DataReport
from lmforge.data.sources import SPLITS, SourceStats, iter_documents, source_path
from lmforge.errors import DataError, os_error
from lmforge.fileio import atomic_dir, shown_path
from lmforge.tokenizer import Tokenizer

META_FILE = "meta.json"
REPORT_FILE = "report.json"
PREPARE_OUTPUT = "prepare"
#: `{split}.hashes`: every document's content hash (`hash64`), uint64 little-endian, in shard order.
HASHES_SUFFIX = ".hashes"
#: A mixture's data folder (lmforge.data.mixture): its sources, one prepared folder each.
MIXTURE_FILE = "mixture.json"
BATCH_DOCS = 64


def prepare(
    source: str,
    tokenizer: Tokenizer,
    out_dir: str | Path,
    val_fraction: float = 0.02,
    include_tests: bool = False,
    on_bad_utf8: str = "skip",
    progress: bool = True,
    extra_files: dict[str, str] | None = None,
    seq_len: int = 0,
    text_field: str = "text",
) -> dict:
    """Tokenize every document of `source` (`text_field`: the records' text) into
    `out_dir`/{train,val}.{bin,idx}.

    Returns the meta dict written to meta.json: per split `documents`, `tokens`,
    `bytes` (UTF-8 bytes of the documents' text), `max_id`; and `skipped_bad_utf8`.
    `extra_files` ({name: text}) go into the folder too (the stage's config.toml). The data
    report (`lmforge.data.reports.DataReport`, measured against `seq_len`) goes into the folder as
    report.json and is returned under "report" (not in meta.json).
    Written through `lmforge.fileio.atomic_dir`: `out_dir` must be absent, empty or an
    earlier prepare's folder, and is replaced only once the new one is complete.
    Raises:
        DataError: missing/empty source, or a split left with no documents.
        OutputError: `out_dir` holds something else (a run, a tokenizer, a file...).
    """
    out = Path(out_dir)
    with atomic_dir(out, PREPARE_OUTPUT, what="`lmforge prepare`", inputs=[("data.source", source_path(source))]) as tmp:
        meta = prepare_into(tmp, source, tokenizer, val_fraction, include_tests, on_bad_utf8, progress, seq_len,
                            text_field)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
    return meta


class SeenHashes:
    """The 64-bit content hashes of the documents kept so far, for exact deduplication, in 8
    bytes a document: a sorted numpy array, with the newest in a small set merged into it every
    `buffer` documents. (A Python set would take about 70 bytes a document.)"""

    def __init__(self, buffer: int = 1 << 16):
        self.sorted = np.zeros(0, dtype=np.uint64)
        self.recent: set[int] = set()
        self.buffer = buffer

    def add(self, h: int) -> bool:
        """Record `h`; False when it was seen before."""
        if h in self.recent:
            return False
        # a numpy scalar: a Python int above 2**63 would make searchsorted convert the whole array
        i = int(np.searchsorted(self.sorted, np.uint64(h)))
        if i < len(self.sorted) and int(self.sorted[i]) == h:
            return False
        self.recent.add(h)
        if len(self.recent) >= self.buffer:  # none of them is in `sorted`: a merge, no deduplication
            merged = np.concatenate([self.sorted, np.fromiter(self.recent, dtype=np.uint64, count=len(self.recent))])
            merged.sort()
            self.sorted = merged
            self.recent.clear()
        return True


#: Names of the first documents kept, for the examples of exact duplicates (beyond them a
#: duplicate's original is "an earlier document"): memory bounded whatever the corpus size.
NAMED_DOCUMENTS = 20_000


def hash64(data: bytes) -> int:
    """The first 8 bytes of sha256(`data`, a text's UTF-8), as an unsigned integer (big-endian):
    the content hash of deduplication and of `{split}.hashes`."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def prepare_into(tmp: Path, source: str, tokenizer: Tokenizer, val_fraction: float, include_tests: bool,
                  on_bad_utf8: str, progress: bool, seq_len: int = 0, text_field: str = "text",
                  input: dict | None = None) -> dict:
    contract = tokenizer.contract
    dtype = contract.dtype
    meta: dict = {"source": source, "val_fraction": val_fraction, "splits": {}}
    if input is not None:
        meta["input"] = input
    stats = SourceStats()
    t0 = time.perf_counter()
    files = {s: open(tmp / f"{s}.bin", "wb") for s in SPLITS}
    idx_files = {s: open(tmp / f"{s}.idx", "wb") for s in SPLITS}
    hash_files = {s: open(tmp / f"{s}{HASHES_SUFFIX}", "wb") for s in SPLITS}
    bar = None
    try:
        ends = {s: 0 for s in SPLITS}
        for s in SPLITS:
            idx_files[s].write(np.zeros(1, dtype=np.int64).tobytes())
        split_meta = {s: {"documents": 0, "tokens": 0, "bytes": 0, "max_id": -1} for s in SPLITS}
        report = DataReport()
        # progress in bytes of the input files on disk (compressed as they are), so the ETA holds for
        # any format; the total is known once the source is listed (at its first document)
        bar = tqdm(desc="prepare", unit="B", unit_scale=True, disable=not progress, mininterval=1.0)
        # tiktoken from the same merges when installed (ids proven identical), else HF tokenizers
        encode_batch = batch_encoder(tokenizer)

        def write(batch: list) -> None:
            for (doc, split, h, nbytes), ids in zip(batch, encode_batch([doc.text for doc, *_ in batch])):
                arr = np.array([*contract.document_start, *ids, contract.eos_id], dtype=np.int64)
                files[split].write(arr.astype(dtype).tobytes())
                ends[split] += len(arr)
                idx_files[split].write(np.int64(ends[split]).tobytes())
                hash_files[split].write(np.uint64(h).astype("<u8").tobytes())
                m = split_meta[split]
                m["documents"] += 1
                m["tokens"] += len(arr)
                m["bytes"] += nbytes
                m["max_id"] = max(m["max_id"], int(arr.max()))
                report.add(doc.name, split, ids, len(arr), nbytes)
            if bar.total is None and stats.input_bytes:
                bar.total = stats.input_bytes
            bar.update(max(0, min(stats.input_read(), stats.input_bytes) - bar.n))
            text = sum(m["bytes"] for m in split_meta.values())
            bar.set_postfix_str(f"{report.documents:,} documents, {text / 1e6:,.1f} MB of text", refresh=False)

        from lmforge.data.sources import split_of

        batch: list = []
        seen = SeenHashes()
        names: dict[int, str] = {}
        duplicates = 0
        for doc in iter_documents(source, None, val_fraction, include_tests, on_bad_utf8, stats, text_field):
            data = doc.text.encode("utf-8")
            h = hash64(data)
            if not seen.add(h):  # exact duplicates are kept once, so no val text is trained on
                duplicates += 1
                report.duplicate(names.get(h, "an earlier document"), doc.name)
                continue
            if len(names) < NAMED_DOCUMENTS:
                names[h] = doc.name
            batch.append((doc, split_of(doc.key, val_fraction), h, len(data)))
            if len(batch) >= BATCH_DOCS:
                write(batch)
                batch = []
        if batch:
            write(batch)
        bar.close()
        for f in (*files.values(), *idx_files.values(), *hash_files.values()):
            f.close()
        total = sum(m["documents"] for m in split_meta.values())
        if total == 0:
            raise DataError(
                f"data.source = {source!r} yielded no documents (all empty or skipped: "
                f"{stats.bad_utf8} not UTF-8, {stats.empty} empty, {stats.not_regular} not regular files, "
                f"{stats.other} files of other types" + (f": {', '.join(stats.skipped_names[:3])}"
                                                          if stats.skipped_names else "")
                + "). Point data.source at real text."
            )
        for s in SPLITS:
            if split_meta[s]["documents"] == 0:
                raise DataError(
                    f"data.source = {source!r}: the {s!r} split has no documents ({total} in all, "
                    f"data.val_fraction = {val_fraction}). Add documents or change data.val_fraction"
                    + (f" (about 3 of {total} documents: --set data.val_fraction={min(0.5, 3 / total):.2g})."
                       if s == "val" and total >= 6 else ".")
                )
        meta["splits"] = split_meta
        meta["skipped_bad_utf8"] = stats.bad_utf8
        meta["skipped_empty"] = stats.empty
        meta["skipped_not_regular"] = stats.not_regular
        meta["skipped_other"] = stats.other
        meta["skipped_names"] = stats.skipped_names[:20]
        meta["skipped_duplicates"] = duplicates
        meta["seconds"] = round(time.perf_counter() - t0, 2)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        data_report = report.finish(seq_len)
        (tmp / REPORT_FILE).write_text(json.dumps(data_report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        contract.save(tmp)
    finally:
        if bar is not None:  # its last state ends with a newline before any error line (stderr not a terminal)
            bar.close()
        for f in (*files.values(), *idx_files.values(), *hash_files.values()):
            f.close()
    return {**meta, "report": data_report}


def read_hashes(folder: str | Path) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(val, train) content hashes of a prepared folder, each a sorted uint64 array (hash64):
    `{split}.hashes`, or the hashes.json of a folder prepared before 2026-11-26 (the first 16
    hex digits of each); (None, None) when the folder has neither.

    Raises:
        DataError: a file that is not what prepare writes.
    """
    folder = Path(folder)
    out = []
    for split in ("val", "train"):
        path = folder / f"{split}{HASHES_SUFFIX}"
        if not path.is_file():
            break
        if path.stat().st_size % 8:
            raise DataError(f"{path}: size {path.stat().st_size} is not a multiple of 8 bytes. Re-run `lmforge prepare`.")
        out.append(np.sort(np.fromfile(path, dtype="<u8").astype(np.uint64)))
    else:
        return out[0], out[1]
    legacy = folder / "hashes.json"
    if not legacy.is_file():
        return None, None
    hashes = _read_json(legacy, dict)
    val, train = hashes.get("val", []), hashes.get("train", [])
    if not (isinstance(val, list) and isinstance(train, list) and all(isinstance(h, str) for h in val + train)):
        raise DataError(f"{legacy}: expected {{\"train\": [hashes], \"val\": [hashes]}}. Re-run `lmforge prepare`.")
    try:
        return tuple(np.sort(np.array([int(h[:16], 16) for h in v], dtype=np.uint64)) for v in (val, train))
    except ValueError:
        raise DataError(f"{legacy}: a hash that is not hexadecimal. Re-run `lmforge prepare`.") from None


def _read_json(path: Path, kind: type):
    """A data folder's side file, parsed; a DataError naming it when it does not parse or is
    not a `kind` (dict / list)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:  # the system's refusal, in its own words (not a damaged folder)
        if exc.errno not in (errno.ENOENT, errno.EISDIR, errno.ENOTDIR):
            raise os_error(exc, path, "read") from None
        raise DataError(f"{path}: not readable JSON ({str(exc)[:120]}). The data folder is damaged: re-run "
                        f"`lmforge prepare`.") from None
    except (ValueError, RecursionError) as exc:
        raise DataError(f"{path}: not readable JSON ({str(exc)[:120]}). The data folder is damaged: re-run "
                        f"`lmforge prepare`.") from None
    if not isinstance(value, kind):
        raise DataError(f"{path}: expected a JSON {kind.__name__}, found {type(value).__name__}. The data folder "
                        f"is damaged: re-run `lmforge prepare`.")
    return value


def read_mixture(folder: Path) -> list[dict] | None:
    """mixture.json's sources ([{name, source, text_field}]), or None when `folder` holds none.

    Raises:
        DataError: a mixture.json that is not what prepare writes.
    """
    path = Path(folder) / MIXTURE_FILE
    if not path.is_file():
        return None
    damaged = DataError(f"{shown_path(path)}: not the mixture.json `lmforge prepare` writes. The data folder is "
                        f"damaged: re-run `lmforge prepare`.")
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))["sources"]
    except (OSError, ValueError, KeyError, TypeError):
        raise damaged from None
    if not (isinstance(entries, list) and all(isinstance(e, dict) and isinstance(e.get("name"), str)
                                              for e in entries)):
        raise damaged
    return entries



@dataclass
class Shard:
    """One split of a prepared data folder, memory-mapped.

    `tokens`: (N,) uint16/uint32 memmap; `offsets`: (D + 1,) int64.
    """

    folder: Path
    split: str
    tokens: np.ndarray
    offsets: np.ndarray
    contract: Contract
    meta: dict

    @classmethod
    def open(cls, folder: str | Path, split: str, contract: Contract | None = None,
             contract_path: str | Path = "the tokenizer") -> "Shard":
        """Open `folder`/{split}.bin/.idx; check its contract against `contract` if given.

        Raises:
            DataError: missing files or a malformed index.
            ContractError: the data was prepared with another tokenizer.
        """
        folder = Path(folder)
        bin_path, idx_path = folder / f"{split}.bin", folder / f"{split}.idx"
        if not bin_path.is_file() or not idx_path.is_file():
            mixture = read_mixture(folder)
            if mixture is not None:
                raise DataError(f"data folder {folder} holds a mixture of {len(mixture)} sources "
                                f"({', '.join(e['name'] for e in mixture)}; mixture.json), not one {split} split: "
                                f"pretraining reads it with data.sources set as when it was prepared; elsewhere "
                                f"give one source's folder ({folder / mixture[0]['name']}).")
            raise DataError(
                f"data folder {folder} has no {split}.bin/{split}.idx. Run `lmforge prepare --out {folder}` "
                f"first (or set data.dir to a prepared folder)."
            )
        own = Contract.load(folder, what="data folder")
        if contract is not None:
            check_match(contract, contract_path, own, folder / CONTRACT_FILE)
        meta_path = folder / META_FILE
        meta = _read_json(meta_path, dict) if meta_path.is_file() else {}
        dtype = own.dtype
        nbytes = bin_path.stat().st_size
        if nbytes % dtype.itemsize:
            raise DataError(f"{bin_path}: size {nbytes} is not a multiple of {dtype} ({dtype.itemsize} bytes).")
        tokens = np.memmap(bin_path, dtype=dtype, mode="r") if nbytes else np.zeros(0, dtype)
        offsets = np.fromfile(idx_path, dtype=np.int64)
        n = nbytes // dtype.itemsize
        if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) <= 0):
            raise DataError(
                f"{idx_path}: offsets must start at 0, increase strictly and end at the token count {n}; "
                f"found {len(offsets)} offsets ending at {offsets[-1] if len(offsets) else '-'}. "
                f"Re-run `lmforge prepare`."
            )
        return cls(folder, split, tokens, offsets, own, meta)

    @property
    def n_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def n_bytes(self) -> int:
        """UTF-8 bytes of the split's text (from meta.json)."""
        splits = self.meta.get("splits")
        entry = splits.get(self.split) if isinstance(splits, dict) else None
        nbytes = entry.get("bytes") if isinstance(entry, dict) else None
        return nbytes if isinstance(nbytes, int) and nbytes >= 0 else 0

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]: self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def preflight(folder: str | Path, contract: Contract, contract_path: str | Path = "the tokenizer") -> dict[str, dict]:
    """Check a prepared data folder before training (P6): its contract equals `contract`,
    the dtype holds the vocab, every id is < vocab_size, every document ends in eos_id, and
    no validation document appears (by content hash) in the training split.

    Returns per split: documents, tokens, max_id.
    Raises:
        ContractError / DataError naming the shard and the offending offset.
    """
    folder = Path(folder)
    report = {}
    for split in SPLITS:
        shard = Shard.open(folder, split, contract, contract_path)
        bin_path = folder / f"{split}.bin"
        if shard.tokens.dtype != np.dtype(contract.token_dtype):
            raise DataError(f"{bin_path}: dtype {shard.tokens.dtype}, the contract says {contract.token_dtype}.")
        max_id = -1
        chunk = 1 << 24
        for start in range(0, shard.n_tokens, chunk):
            part = shard.tokens[start: start + chunk]
            m = int(part.max())
            if m >= contract.vocab_size:
                bad = start + int(np.argmax(part >= contract.vocab_size))
                raise DataError(
                    f"{bin_path}: token id {int(shard.tokens[bad])} at offset {bad} is >= the tokenizer's "
                    f"vocab size {contract.vocab_size}. The shard was not made by this tokenizer or is damaged; "
                    f"re-run `lmforge prepare`."
                )
            max_id = max(max_id, m)
        ends = shard.tokens[shard.offsets[1:] - 1]
        wrong = np.flatnonzero(ends != contract.eos_id)
        if len(wrong):
            i = int(wrong[0])
            raise DataError(
                f"{bin_path}: document {i} (ending at offset {int(shard.offsets[i + 1]) - 1}) ends in id "
                f"{int(ends[i])}, not eos_id {contract.eos_id}. Re-run `lmforge prepare`."
            )
        report[split] = {"documents": shard.n_documents, "tokens": shard.n_tokens, "max_id": max_id}
    val, train = read_hashes(folder)
    if val is not None:
        leaked = np.intersect1d(val, train)
        if len(leaked):
            raise DataError(
                f"{folder}: {len(leaked)} validation document(s) also appear in the training split (by content "
                f"hash). Deduplicate the corpus, then re-run `lmforge prepare`."
            )
    return report
