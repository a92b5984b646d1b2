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

Bring your own tokenizer: `import_tokenizer` (the `lmforge import-tokenizer` command)
turns a Hugging Face tokenizer folder into an lmforge one. It keeps the foreign
spellings (e.g. EOS "</s>"), which tokenizer_config.json records and `Tokenizer.load`
reads back; it adds a distinct <|pad|> when the foreign PAD equals EOS (labels are
masked by the batch's loss mask, never by comparing ids with pad_id) and the ChatML
tokens when missing, and it refuses a tokenizer without an end-of-text token.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from lmforge.contract import (
    CONTRACT_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    Contract,
    check_tokenizer_hash,
    file_sha256,
    padded_vocab_size,
    token_dtype_for,
)
from lmforge.errors import ContractError, LmforgeError, os_error, raise_if_stopped
from lmforge.fileio import atomic_dir, check_output

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


#: Training texts are cut inside any run of more than this many non-space characters. The
#: BPE trainer's cost grows with the square of a pre-token's length, so one long line without
#: whitespace (minified code, a base64 blob) would take minutes; tokens are capped at
#: MAX_TOKEN_BYTES anyway, so only merges across the cuts are lost.
MAX_TRAINING_WORD = 256
_LONG_RUN = re.compile(r"\S{%d,}" % (MAX_TRAINING_WORD + 1))


def bounded_words(text: str, limit: int = MAX_TRAINING_WORD) -> Iterator[str]:
    """`text` as pieces (for the BPE trainer) in which no run of non-space characters is
    longer than `limit`: linear training time on any input."""
    start = 0
    for m in _LONG_RUN.finditer(text):
        for cut in range(m.start() + limit, m.end(), limit):
            yield text[start:cut]
            start = cut
    yield text[start:]


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's ByteLevel byte-to-unicode table: printable char -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | Path,
    special_tokens: Sequence[str] | None = None,
    show_progress: bool = True,
    extra_files: dict[str, str] | None = None,
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
    check_output(Path(out_dir), TOKENIZER_OUTPUT, "the tokenizer stage", replace_whole=True)  # before the work
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
    raised: list[BaseException] = []

    def counted() -> Iterable[str]:
        try:
            for t in texts:
                seen["n"] += 1
                yield from bounded_words(t)
        except BaseException as exc:  # the Rust trainer swallows an exception raised in its iterator
            raised.append(exc)  # (Ctrl-C, SIGTERM, a DataError) and would train on part of the corpus
            raise

    tok.train_from_iterator(counted(), trainer=trainer)
    if raised:
        raise raised[0]
    raise_if_stopped()  # a signal whose exception the trainer swallowed
    if seen["n"] == 0:
        raise LmforgeError("no text to train the tokenizer on: the corpus yielded no documents.")
    return save_tokenizer(tok, out_dir, extra_files=extra_files)


#: The marker command of a tokenizer folder (`lmforge.fileio`): train-tokenizer and
#: import-tokenizer write the same kind of folder and may replace each other's.
TOKENIZER_OUTPUT = "tokenizer"


def save_tokenizer(tok: HFTokenizer, out_dir: str | Path, spellings: dict[str, str] | None = None,
                   extra_config: dict | None = None, extra_files: dict[str, str] | None = None) -> "Tokenizer":
    """Save an HF tokenizer with lmforge's config and a fresh contract, atomically.

    Args:
        tok: the tokenizer; every special token must be in it (as a special added token).
        spellings: special-token strings by name (default SPECIAL_TOKENS; an imported tokenizer
            keeps its own, e.g. {"eos": "</s>", ...}). They go into tokenizer_config.json,
            which is where `Tokenizer.load` reads them back.
        extra_config: tokenizer_config.json keys to add or override (an imported tokenizer's
            unk_token and add_prefix_space).
        extra_files: {file name: text} written into the folder too (the stage's config.toml).
    Raises:
        ContractError: a special token is missing, or two share an id.
        OutputError: `out_dir` is not absent, empty or an earlier tokenizer folder
            (`lmforge.fileio.check_output`).
    """
    spellings = dict(spellings or SPECIAL_TOKENS)
    out = Path(out_dir)
    with atomic_dir(out, TOKENIZER_OUTPUT, what="the tokenizer stage") as tmp:
        _save_into(tok, tmp, spellings, extra_config or {})
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
    return Tokenizer.load(out)


def _save_into(tok: HFTokenizer, tmp: Path, spellings: dict[str, str], extra: dict) -> None:
    tok.save(str(tmp / TOKENIZER_FILE))
    specials = special_ids_of(tok, where=str(tmp / TOKENIZER_FILE), spellings=spellings)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spellings["bos"],
        "eos_token": spellings["eos"],
        "pad_token": spellings["pad"],
        "additional_special_tokens": [spellings["im_start"], spellings["im_end"]],
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
        **extra,
    }
    (tmp / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    vocab = vocab_size_of(tok)
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


def vocab_size_of(tok: HFTokenizer) -> int:
    """Number of ids, special tokens included: the largest id + 1 (a gap, if any, is never produced)."""
    return max(max(tok.get_vocab(with_added_tokens=True).values()) + 1, tok.get_vocab_size(with_added_tokens=True))


def special_ids_of(tok: HFTokenizer, where: str, spellings: dict[str, str] | None = None) -> dict[str, int]:
    """Ids of the special tokens by name, looked up by their spellings (default SPECIAL_TOKENS).

    Raises:
        ContractError: a spelling is not in the tokenizer, or is not a special added token
        (then plain text could produce its id).
    """
    spellings = spellings or SPECIAL_TOKENS
    special = {a.content for a in tok.get_added_tokens_decoder().values() if a.special}
    ids = {}
    for name in SPECIAL_TOKENS:
        text = spellings[name]
        i = tok.token_to_id(text)
        if i is None:
            raise ContractError(f"{where}: the tokenizer has no {text!r} token ({name}).")
        if text not in special:
            raise ContractError(
                f"{where}: {text!r} ({name}) is not registered as a special token, so plain text that "
                f"spells it would encode to its id. Import the tokenizer with `lmforge import-tokenizer`."
            )
        ids[name] = i
    return ids


def spellings_of(folder: Path) -> dict[str, str]:
    """Special-token strings by name from `folder`/tokenizer_config.json (bos/eos/pad_token;
    the chat tokens are always <|im_start|> and <|im_end|>). Defaults: SPECIAL_TOKENS."""
    spellings = dict(SPECIAL_TOKENS)
    path = folder / TOKENIZER_CONFIG_FILE
    if path.is_file():
        config = _read_json(path)
        for name in ("bos", "eos", "pad"):
            text = _token_text(config.get(f"{name}_token"))
            if text:
                spellings[name] = text
    return spellings


@dataclass
class ChatRendering:
    """A conversation rendered to ids. `loss_mask[i]` is 1 where ids[i] is an assistant
    token to be learned (its content and its <|im_end|>), 0 elsewhere."""

    ids: list[int]
    loss_mask: list[int]


class Tokenizer:
    """A tokenizer folder (trained or imported): tokenizer.json + tokenizer_config.json + contract.json."""

    def __init__(self, hf: HFTokenizer, contract: Contract, folder: Path):
        self.hf = hf
        self.contract = contract
        self.folder = folder
        self.spellings: dict[str, str] = dict(SPECIAL_TOKENS)
        """Special-token strings by name (an imported tokenizer keeps its own, e.g. "</s>")."""
        self.hf.encode_special_tokens = True  # data path: special spellings are plain text

    @classmethod
    def load(cls, folder: str | Path) -> "Tokenizer":
        """Load a tokenizer folder and check it against its contract.

        Raises:
            ContractError: missing files (a foreign folder without contract.json: run
            `lmforge import-tokenizer`), a hash that does not match, special ids or a vocab size
            that differ from the contract, add_prefix_space disagreeing between the two files.
        """
        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise ContractError(
                f"tokenizer folder {folder} has no {TOKENIZER_FILE}. Train one with "
                f"`lmforge train-tokenizer --out {folder}` or set tokenizer.dir."
            )
        if not (folder / CONTRACT_FILE).is_file():
            raise ContractError(
                f"tokenizer folder {folder} has a {TOKENIZER_FILE} but no {CONTRACT_FILE}: it was not made "
                f"by lmforge. Import it first: `lmforge import-tokenizer --from {folder} --out DIR`, then "
                f"set tokenizer.dir=DIR."
            )
        contract = Contract.load(folder, what="tokenizer folder")
        check_tokenizer_hash(contract, folder / CONTRACT_FILE, path)
        hf = HFTokenizer.from_file(str(path))
        spellings = spellings_of(folder)
        ids = special_ids_of(hf, str(path), spellings)
        if ids != contract.special_tokens:
            raise ContractError(
                f"{folder / CONTRACT_FILE}: special_tokens {contract.special_tokens} differ from "
                f"the ids in {path}: {ids} (spellings from {TOKENIZER_CONFIG_FILE}: {spellings}). "
                f"Re-create the folder with `lmforge train-tokenizer` or `lmforge import-tokenizer`."
            )
        vocab = vocab_size_of(hf)
        if vocab != contract.vocab_size:
            raise ContractError(
                f"{folder / CONTRACT_FILE}: vocab_size = {contract.vocab_size}, but {path} has {vocab} ids. "
                f"Re-create the folder with `lmforge train-tokenizer` or `lmforge import-tokenizer`."
            )
        check_prefix_space(_read_json(path), _read_json(folder / TOKENIZER_CONFIG_FILE)
                           if (folder / TOKENIZER_CONFIG_FILE).is_file() else {}, path,
                           folder / TOKENIZER_CONFIG_FILE)
        tok = cls(hf, contract, folder)
        tok.spellings = spellings
        return tok

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


# -- bring your own tokenizer -----------------------------------------------------------
#: Every tokenizer lmforge accepts must give decode(encode(x)) == x on these (P4): a
#: normalizer, an UNK token or a stray prefix space shows up here, at import time.
ROUND_TRIP_PROBES: tuple[str, ...] = (
    "Hello, world!",
    " leading space",
    "two  spaces\tand a tab\nnew lines\r\n\n",
    "def f(x):\n    return x ** 2  # café\n",
    "naïve e\u0301 ﬁ Ａ 中文 日本語 한국어 🙂👍🏽",
    "   ",
)


def _read_json(path: str | Path) -> dict:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:  # the system's refusal, in its own words (not a damaged file)
        raise os_error(exc, path, "read") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ContractError(f"{path}: not readable JSON ({exc}). Restore the file from where it came from.") from None
    if not isinstance(raw, dict):
        raise ContractError(f"{path}: expected a JSON object, found {type(raw).__name__}.")
    return raw


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _prefix_space_settings(node) -> list[tuple[str, bool]]:
    """(type, adds a prefix space) for each ByteLevel / Metaspace in a pre-tokenizer JSON tree."""
    found: list[tuple[str, bool]] = []
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "ByteLevel" and "add_prefix_space" in node:
            found.append((kind, bool(node["add_prefix_space"])))
        elif kind == "Metaspace":
            scheme = node.get("prepend_scheme", "always" if node.get("add_prefix_space", True) else "never")
            found.append((kind, scheme != "never"))
        for value in node.values():
            found += _prefix_space_settings(value)
    elif isinstance(node, list):
        for value in node:
            found += _prefix_space_settings(value)
    return found


def check_prefix_space(tokenizer_json: dict, config: dict, tokenizer_path: str | Path,
                       config_path: str | Path) -> None:
    """P4: `add_prefix_space` in tokenizer_config.json, when set, must agree with the pre-tokenizer
    in tokenizer.json (else `transformers` and lmforge tokenize the same text differently).

    Raises:
        ContractError: naming both files and both values.
    """
    want = config.get("add_prefix_space")
    if want is None:
        return
    for kind, has in _prefix_space_settings(tokenizer_json.get("pre_tokenizer")):
        if has != bool(want):
            raise ContractError(
                f"{config_path} sets add_prefix_space = {bool(want)}, but the {kind} pre-tokenizer in "
                f"{tokenizer_path} has it {has}: the two would tokenize the same text differently (P4). "
                f"Make them agree (set add_prefix_space to {has} in {config_path}), then import again."
            )


def _foreign_config(src: Path) -> dict:
    """special_tokens_map.json (older `transformers`) overlaid by tokenizer_config.json."""
    config: dict = {}
    for name in ("special_tokens_map.json", TOKENIZER_CONFIG_FILE):
        if (src / name).is_file():
            config.update(_read_json(src / name))
    return config


def import_tokenizer(src_dir: str | Path, out_dir: str | Path,
                     log: Callable[[str], None] | None = None) -> "Tokenizer":
    """Bring your own tokenizer: derive lmforge's contract from a Hugging Face tokenizer folder.

    `src_dir` holds `tokenizer.json` and `tokenizer_config.json` as `transformers`'
    `save_pretrained` writes them (`special_tokens_map.json` is read too when present). The
    source folder is never modified; `out_dir` gets a new lmforge tokenizer folder
    (tokenizer.json, tokenizer_config.json, contract.json), written atomically.

    Special tokens, by name:
        eos       tokenizer_config.json's `eos_token` (required: a tokenizer without an
                  end-of-text token is refused; it may not be a chat-turn token).
        bos       `bos_token`; when absent or equal to another special token (GPT-2's
                  bos = eos), a new `<|bos|>` is added.
        pad       `pad_token`; when absent, or equal to EOS, BOS or UNK (many Llama
                  tokenizers set pad = eos), a new `<|pad|>` is added, so PAD is its own
                  token (P4). Labels are masked by the batch's `loss_mask`, never by
                  comparing ids with `pad_id`, so the EOS a document ends with is still learned.
        im_start, im_end   `<|im_start|>` / `<|im_end|>` if the tokenizer has them, else added.
    Every one of them becomes a special added token (plain text that spells it stays plain
    text). The chat template is lmforge's ChatML (CHAT_TEMPLATE); a foreign template is dropped.
    Padding and truncation stored in tokenizer.json are switched off.

    Args:
        log: called with a line per change made (added tokens, dropped template).
    Returns:
        the imported Tokenizer (loaded back from `out_dir`).
    Raises:
        ContractError: no tokenizer.json; no (or an unknown) eos_token; a declared special
            token that is not in the vocab; add_prefix_space disagreeing between the two
            files; a tokenizer that does not round-trip text exactly (ROUND_TRIP_PROBES).
        LmforgeError: `out_dir` is `src_dir`, or holds files that are not a tokenizer's.
    """
    say = log or (lambda _msg: None)
    src, out = Path(src_dir), Path(out_dir)
    path = src / TOKENIZER_FILE
    cfg_path = src / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        raise ContractError(
            f"--from {src}: no {TOKENIZER_FILE} there. lmforge imports the folder that `transformers` "
            f"writes with `tokenizer.save_pretrained(DIR)` (a fast tokenizer: {TOKENIZER_FILE} + "
            f"{TOKENIZER_CONFIG_FILE}); save the tokenizer that way first."
        )
    if out.resolve() == src.resolve():
        raise LmforgeError(f"--out {out} is the --from folder; the source is never modified. Choose another --out.")
    check_output(out, TOKENIZER_OUTPUT, "import-tokenizer", replace_whole=True)  # before any work
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises plain Exception subclasses
        raise ContractError(f"{path}: HF tokenizers cannot read it ({exc}). Use a tokenizer.json that "
                            f"`tokenizers.Tokenizer.from_file` loads.") from None
    config = _foreign_config(src)
    tokenizer_json = _read_json(path)
    check_prefix_space(tokenizer_json, config, path, cfg_path)
    prefix = _prefix_space_settings(tokenizer_json.get("pre_tokenizer"))
    vocab = hf.get_vocab(with_added_tokens=True)

    def declared(name: str) -> str | None:
        text = _token_text(config.get(f"{name}_token"))
        if text is not None and text not in vocab:
            raise ContractError(
                f"{cfg_path}: {name}_token = {text!r} is not a token of {path}. Set {name}_token to a "
                f"token the tokenizer has, or remove it."
            )
        return text

    eos = declared("eos")
    if eos is None:
        raise ContractError(
            f"--from {src}: the tokenizer has no end-of-text token ({cfg_path} sets no eos_token). "
            f"lmforge ends every document with one (P1, P2). Set eos_token in {cfg_path} to the token "
            f"that ends a document (for example \"</s>\" or \"<|endoftext|>\"), or use another tokenizer."
        )
    chat = {"im_start": SPECIAL_TOKENS["im_start"], "im_end": SPECIAL_TOKENS["im_end"]}
    if eos in chat.values():
        raise ContractError(
            f"{cfg_path}: eos_token = {eos!r} is a chat-turn token; lmforge ends a document with its own "
            f"end-of-text token and a chat turn with {chat['im_end']!r} (P2). Set eos_token to the document "
            f"terminator (for Qwen tokenizers: \"<|endoftext|>\")."
        )
    unk = _token_text(config.get("unk_token"))
    spell = {"eos": eos, **chat}
    bos = declared("bos")
    if bos is None or bos in spell.values():
        say(f"bos: {'bos_token ' + repr(bos) + ' is also EOS' if bos else 'no bos_token'}; "
            f"using {SPECIAL_TOKENS['bos']!r}")
        bos = SPECIAL_TOKENS["bos"]
    spell["bos"] = bos
    pad = declared("pad")
    if pad is None or pad in spell.values() or pad == unk:
        say(f"pad: {'pad_token ' + repr(pad) + ' is also EOS/BOS/UNK' if pad else 'no pad_token'}; using "
            f"{SPECIAL_TOKENS['pad']!r} (labels are masked by loss_mask, never by pad id)")
        pad = SPECIAL_TOKENS["pad"]
    spell["pad"] = pad
    spell = {name: spell[name] for name in SPECIAL_TOKENS}
    for name in ("im_start", "im_end"):
        if spell[name] not in vocab:
            say(f"{name}: no {spell[name]!r}; adding it")
    hf.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in spell.values()])
    hf.no_padding()
    hf.no_truncation()
    hf.encode_special_tokens = True
    special_ids = {hf.token_to_id(t) for t in spell.values()}
    for text in (*ROUND_TRIP_PROBES, *spell.values()):
        ids = hf.encode(text, add_special_tokens=False).ids
        back = hf.decode(ids, skip_special_tokens=False)
        if back != text:
            raise ContractError(
                f"{path}: decode(encode({text!r})) gives {back!r}: the tokenizer loses information (a "
                f"normalizer, an unknown-token fallback or a prefix space). lmforge needs exact round trips "
                f"(P4; bits per byte and data checks rely on them). Use a byte-level tokenizer."
            )
        if special_ids & set(ids):
            raise ContractError(
                f"{path}: the plain text {text!r} encodes to a special-token id {sorted(special_ids & set(ids))}; "
                f"text that spells a special token must stay plain text. Use another tokenizer."
            )
    if config.get("chat_template"):
        say("chat_template: replaced by lmforge's ChatML template")
    extra: dict = {"add_prefix_space": prefix[0][1]} if prefix else {}
    if unk and unk in vocab:
        extra["unk_token"] = unk
    return save_tokenizer(hf, out, spell, extra)
