"""The tokenizer / data / model / checkpoint contract (P1, P4, P6).

`contract.json` is written once by the tokenizer stage (`train_tokenizer`, or
`import_tokenizer` for a tokenizer brought from elsewhere) and copied into every data
folder and every checkpoint. It is the only place special-token ids live: every
stage reads them from here, and every stage boundary compares the contracts it
meets (`check_match`) and stops on any difference.

    {"tokenizer_sha256": "...", "vocab_size": 8192, "model_vocab_size": 8192,
     "special_tokens": {"pad": 0, "bos": 1, "eos": 2, "im_start": 3, "im_end": 4},
     "chat_template": "...", "token_dtype": "uint16", "add_bos": true}

Special tokens by name: `pad` (padding only, never a real token), `bos`, `eos` (ends a
document), `im_start`, `im_end` (ends a chat turn: the chat stop token and the last learned
token of an assistant turn). Every id is an integer in [0, vocab_size). An imported model
follows its own conventions: `bos` and `im_start` may be null (Qwen2.5 has no BOS token;
Llama 3 and Mistral templates have no <|im_start|>), and `im_end` may equal `eos` (Mistral
ends a turn with its </s>). `add_bos` says whether a document (and a completion prompt)
starts with the BOS: true for lmforge's own tokenizers and for models whose tokenizer
prepends one (Llama 3, Mistral), false for models without (SmolLM2, Qwen); every stage
and every export (HF `add_bos_token`, GGUF `tokenizer.ggml.add_bos_token`) follows it. A
contract.json written before the field existed reads as `add_bos: true`.

`tokenizer_sha256` is the hash of what turns text into ids and back (`tokenizer_sha256()`:
tokenizer.json's added tokens, normalizer, pre-tokenizer, model and decoder as canonical JSON),
not of the file's bytes: the post-processor (the BOS an HF `encode` adds, which the export
writes), padding, truncation and formatting are left out, since `transformers`' `save_pretrained`
rewrites them (a model saved by TRL or PEFT re-imports with the same contract). A contract written
before holds the file's sha256, which `check_tokenizer_hash` still accepts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge.errors import ContractError
from lmforge.fileio import loads_json

CONTRACT_FILE = "contract.json"
#: The tokenizer files that travel with the contract into every data folder and checkpoint.
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


#: The model's vocabulary is the tokenizer's rounded up to a multiple of this (P6): matmul
#: shapes that divide well, and the extra rows are never targets (sliced off the logits).
VOCAB_MULTIPLE = 64


def padded_vocab_size(vocab_size: int) -> int:
    """The model's vocab: the tokenizer's, rounded up to a multiple of 64 (P6)."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclass(frozen=True)
class Contract:
    tokenizer_sha256: str
    vocab_size: int
    """Tokenizer vocabulary size (special tokens included): valid ids are [0, vocab_size)."""
    model_vocab_size: int
    """vocab_size rounded up to a multiple of 64: the embedding's row count."""
    special_tokens: dict[str, int]
    chat_template: str
    token_dtype: str
    """numpy dtype of data shards: "uint16" when vocab_size <= 65536, else "uint32"."""
    add_bos: bool = True
    """Documents and completion prompts start with the BOS (module docstring)."""

    # -- special tokens by name: the only accessors stages use ------------------
    @property
    def pad_id(self) -> int:
        return self.special_tokens["pad"]

    @property
    def bos_id(self) -> int | None:
        """The BOS id, or None for a model that has no BOS token."""
        return self.special_tokens.get("bos")

    @property
    def document_start(self) -> list[int]:
        """What every document and completion prompt starts with: [bos_id] when `add_bos`, else []."""
        return [self.special_tokens["bos"]] if self.add_bos else []

    @property
    def eos_id(self) -> int:
        return self.special_tokens["eos"]

    @property
    def im_start_id(self) -> int | None:
        return self.special_tokens.get("im_start")

    @property
    def im_end_id(self) -> int:
        return self.special_tokens["im_end"]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.token_dtype)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    def save(self, folder: str | Path) -> Path:
        """Write `folder/contract.json` atomically."""
        path = Path(folder) / CONTRACT_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, folder: str | Path, what: str = "folder") -> "Contract":
        """Read `folder/contract.json`.

        Raises:
            ContractError: the file is missing or malformed.
        """
        path = Path(folder) / CONTRACT_FILE
        if not path.is_file():
            raise ContractError(
                f"{what} {folder} has no {CONTRACT_FILE}. Every tokenizer, data and checkpoint "
                f"folder written by lmforge holds one; point at such a folder, or re-create this one "
                f"with the stage that writes it (train-tokenizer, prepare, pretrain)."
            )
        try:
            raw = loads_json(path.read_text(encoding="utf-8"))
            fields = {f.name for f in dataclasses.fields(cls)}
            if not isinstance(raw, dict):
                raise ValueError(f"expected a JSON object, found {type(raw).__name__}")
            missing = fields - set(raw) - {"add_bos"}  # add_bos: absent in contracts written before it
            extra = set(raw) - fields
            if missing or extra:
                raise ValueError(f"missing fields {sorted(missing)}, unexpected fields {sorted(extra)}")
            contract = cls(**raw)
            contract.check_consistent(path)
            return contract
        except (ValueError, TypeError, KeyError) as exc:
            raise ContractError(
                f"{path} is not a valid contract ({exc}). Re-create it with `lmforge train-tokenizer` "
                f"or copy it from the tokenizer folder."
            ) from None

    def check_consistent(self, where: str | Path) -> None:
        """Internal consistency: the five special tokens present, their ids distinct and in
        [0, vocab_size), model_vocab_size = vocab_size rounded up to 64, a dtype that holds the vocab
        (P4, P6).

        Raises:
            ContractError: naming `where`, the field, the value and what was expected.
        """
        required = ("pad", "bos", "eos", "im_start", "im_end")
        if not isinstance(self.special_tokens, dict):
            raise ContractError(f"{where}: special_tokens = {self.special_tokens!r}: expected an object "
                                f"{{name: id}} with the names {required}.")
        for name in required:
            if name not in self.special_tokens:
                raise ContractError(f"{where}: special_tokens has no {name!r} (expected {required}).")
        if set(self.special_tokens) - set(required):
            raise ContractError(f"{where}: special_tokens has unknown names "
                                f"{sorted(set(self.special_tokens) - set(required))} (expected {required}).")
        for name, value in (("vocab_size", self.vocab_size), ("model_vocab_size", self.model_vocab_size)):
            if type(value) is not int:
                raise ContractError(f"{where}: {name} = {value!r}: expected an integer.")
        if type(self.add_bos) is not bool:
            raise ContractError(f"{where}: add_bos = {self.add_bos!r}: expected true or false.")
        for name, i in self.special_tokens.items():
            if i is None and name in OPTIONAL_SPECIALS:
                continue
            if type(i) is not int:  # 2.0, "2", true: never an id (bool is an int subclass)
                allowed = " or null" if name in OPTIONAL_SPECIALS else ""
                raise ContractError(f"{where}: special token {name!r} has id {i!r}: expected an integer{allowed}. "
                                    f"Restore contract.json from the tokenizer folder it came from.")
            if not 0 <= i < self.vocab_size:
                raise ContractError(
                    f"{where}: special token {name!r} has id {i}, outside the vocab [0, {self.vocab_size})."
                )
        if self.add_bos and self.special_tokens["bos"] is None:
            raise ContractError(f"{where}: add_bos = true but special token 'bos' is null; a document cannot start "
                                f"with a BOS the vocabulary lacks. Set add_bos to false or give the BOS id.")
        # distinct ids (P4); only the end of a turn may be the end of a document (Mistral's </s>)
        named = [(n, i) for n, i in self.special_tokens.items() if i is not None]
        ids = [i for n, i in named if not (n == "im_end" and i == self.special_tokens["eos"])]
        if len(set(ids)) != len(ids):
            raise ContractError(
                f"{where}: special tokens share ids {self.special_tokens}; PAD, BOS, EOS and the chat "
                f"tokens must each be their own token (P4; only im_end may equal eos)."
            )
        if self.model_vocab_size != padded_vocab_size(self.vocab_size):
            raise ContractError(
                f"{where}: model_vocab_size = {self.model_vocab_size}, expected "
                f"{padded_vocab_size(self.vocab_size)} (vocab_size {self.vocab_size} rounded up to 64)."
            )
        if self.token_dtype != token_dtype_for(self.vocab_size):
            raise ContractError(
                f"{where}: token_dtype = {self.token_dtype!r} cannot hold vocab_size {self.vocab_size}; "
                f"expected {token_dtype_for(self.vocab_size)!r}."
            )


#: Special tokens a model may lack (null in contract.json): a BOS (Qwen) and ChatML's turn start.
OPTIONAL_SPECIALS = ("bos", "im_start")


def token_dtype_for(vocab_size: int) -> str:
    """The numpy dtype name of data shards for a vocabulary: "uint16" up to 65,536 ids, else "uint32"."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


#: tokenizer.json's top-level keys that decide ids and text: what `tokenizer_sha256` covers.
HASHED_TOKENIZER_KEYS = ("added_tokens", "normalizer", "pre_tokenizer", "model", "decoder")


def tokenizer_sha256(path: str | Path) -> str:
    """The contract's `tokenizer_sha256` of a tokenizer.json: the hex sha256 of the canonical
    JSON (sorted keys, no whitespace, UTF-8) of HASHED_TOKENIZER_KEYS, BPE merges in one spelling
    (`"a b"` and `["a", "b"]` are the same merge: `tokenizers` wrote the first before 0.20).

    Left out, since they do not change `encode(text, add_special_tokens=False)` or `decode` and
    `transformers`' `save_pretrained` rewrites them: the post-processor, padding, truncation,
    the version field and the file's formatting.

    Raises:
        ContractError: the file is not JSON (named, with what to do).
    """
    try:
        raw = loads_json(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ContractError(f"{path}: not a tokenizer.json ({str(exc)[:200]}). Re-create the folder with "
                            f"`lmforge train-tokenizer` or `lmforge import-tokenizer`.") from None
    if not isinstance(raw, dict):
        raise ContractError(f"{path}: a JSON {type(raw).__name__}, expected a tokenizer.json object. Re-create the "
                            f"folder with `lmforge train-tokenizer` or `lmforge import-tokenizer`.")
    content = {key: raw.get(key) for key in HASHED_TOKENIZER_KEYS}
    model = content["model"]
    if isinstance(model, dict) and isinstance(model.get("merges"), list):
        merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
        content["model"] = {**model, "merges": merges}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def check_match(a: Contract, a_path: str | Path, b: Contract, b_path: str | Path) -> None:
    """Stop if two contracts differ in any field (a stage boundary check: tokenizer vs data in
    prepare/pretrain, tokenizer vs checkpoint in generate and --resume, checkpoint vs data in eval).

    Raises:
        ContractError: naming both files, the field, both values and the fix.
    """
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    # the telling fields first; the hash last (it differs whenever anything else does)
    order = ["special_tokens", "vocab_size", "model_vocab_size", "token_dtype", "chat_template", "tokenizer_sha256"]
    order += [k for k in da if k not in order]
    details = []
    for key in order:
        if da[key] != db[key]:
            va, vb = da[key], db[key]
            if key == "chat_template":
                va, vb = f"<{len(va)} chars>", f"<{len(vb)} chars>"
            details.append(f"{key!r}: {a_path} has {va!r} but {b_path} has {vb!r}")
    if details:
        raise ContractError(
            f"contract mismatch in {'; '.join(details)}. They were made with different tokenizers. Use the "
            f"tokenizer these were made with, or re-run the earlier stage (prepare / pretrain) with this tokenizer."
        )


def check_tokenizer_hash(contract: Contract, contract_path: str | Path, tokenizer_json: str | Path) -> None:
    """The contract's tokenizer_sha256 must be `tokenizer_sha256()` of the tokenizer.json beside
    it (or, for a contract written before that hash, the file's sha256).

    Raises:
        ContractError: either file was edited or swapped (names both, with both hashes).
    """
    try:  # today's contracts first: one read of the file, not two
        actual = tokenizer_sha256(tokenizer_json)
    except ContractError:
        actual = ""
    if actual == contract.tokenizer_sha256 or file_sha256(tokenizer_json) == contract.tokenizer_sha256:
        return
    actual = actual or file_sha256(tokenizer_json)
    raise ContractError(
        f"{contract_path}: tokenizer_sha256 = {contract.tokenizer_sha256[:16]}… but "
        f"{tokenizer_json} hashes to {actual[:16]}…. The tokenizer or the contract was edited or "
        f"swapped; restore the original files, or re-run `lmforge train-tokenizer` (or `lmforge "
        f"import-tokenizer`) to make a new folder."
    )
