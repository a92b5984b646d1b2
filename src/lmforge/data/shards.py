"""Pretokenized shards: what a prepared data folder holds, read (`Shard`) and checked before
training (`preflight`); `data/prepare.py` writes it (`prepare`).

A prepared data folder holds, per split ("train", "val"):

- `{split}.bin`: every document's tokens back to back, `contract.token_dtype`
  (uint16 when the vocab fits, else uint32). Each document is `[bos] text [eos]` (no BOS for a
  model without one: the contract's `document_start`).
- `{split}.idx`: int64 offsets, n_documents + 1 of them: document i is
  `bin[idx[i]:idx[i+1]]` (so idx[0] = 0 and idx[-1] = number of tokens).

plus `contract.json` (copied from the tokenizer) and `meta.json` (documents, tokens,
UTF-8 bytes and max id per split). Reading uses `numpy.memmap`: memory stays flat
whatever the corpus size.
"""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge.contract import CONTRACT_FILE, Contract, check_match
from lmforge.data.prepare import HASHES_SUFFIX, META_FILE
from lmforge.data.sources import SPLITS
from lmforge.errors import DataError, os_error
from lmforge.fileio import shown_path

#: A mixture's data folder (lmforge.data.mixture): its sources, one prepared folder each.
MIXTURE_FILE = "mixture.json"


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
