"""Byte-level BPE tokenizer: training, loading, and the chat template.

The tokenizer is one Hugging Face `tokenizer.json` (pre-tokenizer, decoder and
post-processor in one object) plus `tokenizer_config.json`, so `transformers`'
`AutoTokenizer` loads the same folder (P4). The pre-tokenizer is Qwen2's split
regex (Llama 3's, digits one at a time) followed by `ByteLevel(use_regex=False)`,
with tokens capped at 32 bytes: llama.cpp's `qwen2` pre-tokenizer reproduces it.

Special tokens are declared here, by name, and nowhere else; their ids are read
from the trained tokenizer and recorded in the contract (P1). On the data path,
text that spells a special token is plain text (`encode_special_tokens = True`);
only `render_chat` emits real special tokens.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from lmforge.config import padded_vocab_size
from lmforge.contract import (
    CONTRACT_FILE,
    Contract,
    check_tokenizer_hash,
    file_sha256,
    token_dtype_for,
)
from lmforge.errors import ContractError, LmforgeError

#: Special tokens by name (the one place they are spelled). Order = id order when
#: lmforge trains a tokenizer; nothing depends on that order (a test permutes it).
SPECIAL_TOKENS: dict[str, str] = {
    "pad": "<|pad|>",
    "bos": "<|bos|>",
    "eos": "<|eos|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
}

#: Qwen2's pre-tokenizer split (Llama 3's regex with single digits).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MAX_TOKEN_BYTES = 32

#: ChatML, as a Jinja template that `transformers.apply_chat_template` runs; `render_chat`
#: below builds the same ids directly (a test proves they agree).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _build_empty() -> HFTokenizer:
    tok = HFTokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | Path,
    special_tokens: Sequence[str] | None = None,
    show_progress: bool = True,
) -> "Tokenizer":
    """Train byte-level BPE on `texts` and save tokenizer, config and contract to `out_dir`.

    Args:
        texts: documents (str). Consumed once.
        vocab_size: total vocabulary, special tokens and the 256 byte tokens included.
        special_tokens: the special-token strings in id order (default: SPECIAL_TOKENS's order).
    Raises:
        LmforgeError: vocab_size too small, or no text.
    The folder is written atomically (a temporary folder, then a rename).
    """
    specials = list(special_tokens or SPECIAL_TOKENS.values())
    if sorted(specials) != sorted(SPECIAL_TOKENS.values()):
        raise LmforgeError(f"special_tokens {specials} must be a permutation of {list(SPECIAL_TOKENS.values())}.")
    minimum = 256 + len(specials) + 1
    if vocab_size < minimum:
        raise LmforgeError(
            f"tokenizer.vocab_size = {vocab_size} is too small: byte-level BPE needs 256 byte tokens "
            f"plus {len(specials)} special tokens; use at least {minimum}."
        )
    tok = _build_empty()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=MAX_TOKEN_BYTES,
        show_progress=show_progress,
        min_frequency=2,
    )
    seen = {"n": 0}

    def counted() -> Iterable[str]:
        for t in texts:
            seen["n"] += 1
            yield t

    tok.train_from_iterator(counted(), trainer=trainer)
    if seen["n"] == 0:
        raise LmforgeError("no text to train the tokenizer on: the corpus yielded no documents.")
    return save_tokenizer(tok, out_dir)


def save_tokenizer(tok: HFTokenizer, out_dir: str | Path) -> "Tokenizer":
    """Save an HF tokenizer with lmforge's config and a fresh contract, atomically."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tok.save(str(tmp / TOKENIZER_FILE))
    specials = special_ids_of(tok, where=str(tmp / TOKENIZER_FILE))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS["bos"],
        "eos_token": SPECIAL_TOKENS["eos"],
        "pad_token": SPECIAL_TOKENS["pad"],
        "additional_special_tokens": [SPECIAL_TOKENS["im_start"], SPECIAL_TOKENS["im_end"]],
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }
    (tmp / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    contract = Contract(
        tokenizer_sha256=file_sha256(tmp / TOKENIZER_FILE),
        vocab_size=vocab,
        model_vocab_size=padded_vocab_size(vocab),
        special_tokens=specials,
        chat_template=CHAT_TEMPLATE,
        token_dtype=token_dtype_for(vocab),
    )
    contract.check_consistent(tmp / CONTRACT_FILE)
    contract.save(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return Tokenizer.load(out)


def special_ids_of(tok: HFTokenizer, where: str) -> dict[str, int]:
    ids = {}
    for name, text in SPECIAL_TOKENS.items():
        i = tok.token_to_id(text)
        if i is None:
            raise ContractError(f"{where}: the tokenizer has no {text!r} token ({name}).")
        ids[name] = i
    return ids


@dataclass
class ChatRendering:
    """A conversation rendered to ids. `loss_mask[i]` is 1 where ids[i] is an assistant
    token to be learned (its content and its <|im_end|>), 0 elsewhere."""

    ids: list[int]
    loss_mask: list[int]


class Tokenizer:
    """A trained tokenizer folder: tokenizer.json + tokenizer_config.json + contract.json."""

    def __init__(self, hf: HFTokenizer, contract: Contract, folder: Path):
        self.hf = hf
        self.contract = contract
        self.folder = folder
        self.hf.encode_special_tokens = True  # data path: special spellings are plain text

    @classmethod
    def load(cls, folder: str | Path) -> "Tokenizer":
        """Load a tokenizer folder and check it against its contract.

        Raises:
            ContractError: missing files, a hash that does not match, special ids that differ.
        """
        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise ContractError(
                f"tokenizer folder {folder} has no {TOKENIZER_FILE}. Train one with "
                f"`lmforge train-tokenizer --out {folder}` or set tokenizer.dir."
            )
        contract = Contract.load(folder, what="tokenizer folder")
        check_tokenizer_hash(contract, folder / CONTRACT_FILE, path)
        hf = HFTokenizer.from_file(str(path))
        ids = special_ids_of(hf, str(path))
        if ids != contract.special_tokens:
            raise ContractError(
                f"{folder / CONTRACT_FILE}: special_tokens {contract.special_tokens} differ from "
                f"the ids in {path}: {ids}. Re-create the contract with the tokenizer stage."
            )
        return cls(hf, contract, folder)

    # -- special ids, from the contract only (P1) --------------------------------
    @property
    def vocab_size(self) -> int:
        return self.contract.vocab_size

    @property
    def pad_id(self) -> int:
        return self.contract.pad_id

    @property
    def bos_id(self) -> int:
        return self.contract.bos_id

    @property
    def eos_id(self) -> int:
        return self.contract.eos_id

    @property
    def im_start_id(self) -> int:
        return self.contract.im_start_id

    @property
    def im_end_id(self) -> int:
        return self.contract.im_end_id

    # -- text <-> ids -------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Plain text to ids; special-token spellings stay plain text. No BOS/EOS added."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode_document(self, text: str) -> list[int]:
        """A pretraining document: [bos] + encode(text) + [eos] (EOS terminates, P2)."""
        return [self.bos_id, *self.encode(text), self.eos_id]

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> ChatRendering:
        """ChatML ids and the assistant-only loss mask.

        Each message: {"role": "system"|"user"|"assistant", "content": str}. Equal, id for id,
        to `transformers`' apply_chat_template with CHAT_TEMPLATE on this tokenizer's folder.
        """
        ids: list[int] = []
        mask: list[int] = []
        # Text between two special tokens is encoded as one piece, as transformers does
        # after rendering the template to a string; a token is learned when it starts
        # inside the assistant's content.
        for i, m in enumerate(messages):
            lead = "\n" if i > 0 else ""  # the newline after the previous <|im_end|>
            if lead:
                piece = self.encode(lead)
                ids += piece
                mask += [0] * len(piece)
            head = m["role"] + "\n"
            enc = self.hf.encode(head + m["content"], add_special_tokens=False)
            learn = m["role"] == "assistant"
            ids.append(self.im_start_id)
            mask.append(0)
            for tid, (start, _end) in zip(enc.ids, enc.offsets):
                ids.append(tid)
                mask.append(1 if learn and start >= len(head) else 0)
            ids.append(self.im_end_id)
            mask.append(1 if learn else 0)
        if messages:
            piece = self.encode("\n")
            ids += piece
            mask += [0] * len(piece)
        if add_generation_prompt:
            head = [self.im_start_id, *self.encode("assistant\n")]
            ids += head
            mask += [0] * len(head)
        return ChatRendering(ids, mask)
