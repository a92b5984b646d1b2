"""Training lmforge's byte-level BPE tokenizer (HF tokenizers) and saving a tokenizer folder:
tokenizer.json, tokenizer_config.json and a fresh contract, written atomically."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from lmforge.contract import (
    CONTRACT_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    Contract,
    padded_vocab_size,
    token_dtype_for,
    tokenizer_sha256,
)
from lmforge.errors import LmforgeError, raise_if_stopped
from lmforge.fileio import atomic_dir, check_output, save_hf_tokenizer
from lmforge.tokenizer.runtime import Tokenizer
from lmforge.tokenizer.specials import CHAT_TEMPLATE, SPECIAL_TOKENS, special_ids_of, vocab_size_of

#: Qwen2's pre-tokenizer split (Llama 3's regex with single digits).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MAX_TOKEN_BYTES = 32


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
    extra_files: dict | None = None,
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


def save_tokenizer(tok: HFTokenizer, out_dir: str | Path, spellings: dict[str, str | None] | None = None,
                   extra_config: dict | None = None, extra_files: dict | None = None,
                   chat_template: str = CHAT_TEMPLATE, add_bos: bool = True) -> "Tokenizer":
    """Save an HF tokenizer with lmforge's config and a fresh contract, atomically.

    Args:
        tok: the tokenizer; every special token must be in it (as a special added token).
        spellings: special-token strings by name (default SPECIAL_TOKENS; an imported tokenizer
            keeps its own, e.g. {"eos": "</s>", ...}). They go into tokenizer_config.json,
            which is where `Tokenizer.load` reads them back.
        extra_config: tokenizer_config.json keys to add or override (an imported tokenizer's
            unk_token and add_prefix_space).
        extra_files: {file name: text, or a function of the (temporary) folder returning it}
            written into the folder too (the stage's config.toml, the tokenizer report).
        chat_template: the contract's (and tokenizer_config.json's) template: lmforge's ChatML,
            or an imported model's own.
        add_bos: the contract's `add_bos` (documents start with the BOS).
    Raises:
        ContractError: a special token is missing, or two share an id.
        OutputError: `out_dir` is not absent, empty or an earlier tokenizer folder
            (`lmforge.fileio.check_output`).
    """
    spellings = dict(spellings or SPECIAL_TOKENS)
    out = Path(out_dir)
    with atomic_dir(out, TOKENIZER_OUTPUT, what="the tokenizer stage") as tmp:
        _save_into(tok, tmp, spellings, extra_config or {}, chat_template, add_bos)
        for name, text in (extra_files or {}).items():
            if callable(text):  # computed from the saved tokenizer (a report), before the folder moves in
                text = text(tmp)
            (tmp / name).write_text(text, encoding="utf-8")
    return Tokenizer.load(out)


def _save_into(tok: HFTokenizer, tmp: Path, spellings: dict[str, str | None], extra: dict, chat_template: str,
               add_bos: bool) -> None:
    save_hf_tokenizer(tok, tmp / TOKENIZER_FILE)
    specials = special_ids_of(tok, where=str(tmp / TOKENIZER_FILE), spellings=spellings)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spellings["bos"],
        "eos_token": spellings["eos"],
        "pad_token": spellings["pad"],
        "additional_special_tokens": [t for t in (spellings["im_start"], spellings["im_end"])
                                      if t is not None and t != spellings["eos"]],
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": chat_template,
        **extra,
    }
    config = {k: v for k, v in config.items() if v is not None}
    (tmp / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    vocab = vocab_size_of(tok)
    contract = Contract(
        tokenizer_sha256=tokenizer_sha256(tmp / TOKENIZER_FILE),
        vocab_size=vocab,
        model_vocab_size=padded_vocab_size(vocab),
        special_tokens=specials,
        chat_template=chat_template,
        token_dtype=token_dtype_for(vocab),
        add_bos=add_bos,
    )
    contract.check_consistent(tmp / CONTRACT_FILE)
    contract.save(tmp)
