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
turns a Hugging Face tokenizer folder into an lmforge one that follows the model's own
conventions: its document terminator (the vocabulary's <|endoftext|> / <|end_of_text|> / </s>
where eos_token ends a chat turn), its BOS or none (`add_bos`), its chat template and the
token that ends a turn; it adds a distinct <|pad|> when the foreign PAD is another special
token (labels are masked by the batch's loss mask, never by comparing ids with pad_id), and
ChatML's tokens only for a folder without a chat template. A foreign template is rendered by
`ChatTemplate` as `transformers` renders it.
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
    OPTIONAL_SPECIALS,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    Contract,
    check_tokenizer_hash,
    file_sha256,
    padded_vocab_size,
    token_dtype_for,
)
from lmforge.errors import ContractError, DataError, LmforgeError, os_error, raise_if_stopped
from lmforge.fileio import atomic_dir, check_output, load_hf_tokenizer, loads_json, save_hf_tokenizer

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
        tokenizer_sha256=file_sha256(tmp / TOKENIZER_FILE),
        vocab_size=vocab,
        model_vocab_size=padded_vocab_size(vocab),
        special_tokens=specials,
        chat_template=chat_template,
        token_dtype=token_dtype_for(vocab),
        add_bos=add_bos,
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
        text = spellings.get(name)
        if text is None and name in OPTIONAL_SPECIALS:  # a model without a BOS / a ChatML turn start
            ids[name] = None
            continue
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


def spellings_of(hf: HFTokenizer, contract: Contract) -> dict[str, str | None]:
    """Special-token strings by name: the tokens at the contract's ids (None where the contract
    has none). The contract is the only place special ids live (P1); tokenizer_config.json's
    bos_token / eos_token are what `transformers` and the chat template see, which for an
    imported model are its own (e.g. eos_token "<|im_end|>" while documents end with
    "<|endoftext|>")."""
    return {name: (None if i is None else hf.id_to_token(i)) for name, i in contract.special_tokens.items()}


@dataclass
class ChatRendering:
    """A conversation rendered to ids. `loss_mask[i]` is 1 where ids[i] is an assistant
    token to be learned (its content and its <|im_end|>), 0 elsewhere."""

    ids: list[int]
    loss_mask: list[int]


class ChatTemplate:
    """A Hugging Face chat template (Jinja), rendered the way `transformers`' apply_chat_template
    renders it: a sandboxed environment with trim_blocks and lstrip_blocks, loop controls,
    `raise_exception`, `tojson` (no HTML escaping), `strftime_now`, a `{% generation %}` block
    that renders its body, and the tokenizer's special-token strings as variables; the
    rendered string is then tokenized as one piece with special tokens recognised.

    Assistant spans (the loss mask) come from prefix renderings: for the assistant message i,
    P = render(messages[:i], add_generation_prompt=True) and Q = render(messages[:i+1]) must
    satisfy P ⊑ Q ⊑ render(messages) (string prefixes); the span is Q[len(P):] up to and
    including its last end-of-turn token (the contract's im_end). Tokens overlapping the span
    are learned (transformers' rule for `return_assistant_tokens_mask`). A template that breaks
    the prefix property (one that rewrites earlier turns) is refused, never approximated.
    """

    def __init__(self, source: str, variables: dict[str, str], name: str):
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):  # {% generation %}...{% endgeneration %}: its body, as rendered
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            import datetime

            return datetime.datetime.now().strftime(fmt)

        self.name, self.variables = name, dict(variables)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        self._errors = (jinja2.exceptions.TemplateError,)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ContractError(f"{name}: the chat template does not compile ({exc}). Fix the template.") from None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for `messages`.

        Raises:
            DataError: the template raised (its own message is quoted) or failed to render.
        """
        try:
            return self.template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.variables)
        except self._errors as exc:
            raise DataError(f"{self.name} refuses this conversation ({exc}); roles "
                            f"{[m.get('role') for m in messages]}. Change the conversation to the form the "
                            f"model's template accepts.") from None

    def render_ids(self, tok: "Tokenizer", messages: Sequence[dict], add_generation_prompt: bool) -> ChatRendering:
        """ids (tokenized as transformers does) and the assistant-only loss mask (class docstring)."""
        specials = [a.content for a in tok.hf.get_added_tokens_decoder().values() if a.special]
        for i, m in enumerate(messages):
            found = [t for t in specials if t in m["content"]]
            if found:
                raise DataError(
                    f"message {i} ({m['role']}) spells the special token {found[0]!r}; the model's chat template "
                    f"({self.name}) would turn it into the real token, as transformers does. Remove it from the text.")
        text = self.render(messages, add_generation_prompt)
        enc = tok.chat_encoder().encode(text, add_special_tokens=False)
        mask = [0] * len(enc.ids)
        turn_end = tok.spellings["im_end"]
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not (upto.startswith(prompt) and text.startswith(upto)):
                raise DataError(
                    f"{self.name} cannot be rendered faithfully: the rendering of the conversation up to message "
                    f"{i} is not a prefix of the rendering of the next turns (the template changes earlier turns, "
                    f"or renders the generation prompt differently from a reply). lmforge trains only on templates "
                    f"whose turns render independently; use another template (--set in tokenizer_config.json).")
            end = upto.rfind(turn_end, len(prompt))
            if end < 0:
                raise DataError(f"{self.name}: the assistant message {i} renders without the end-of-turn token "
                                f"{turn_end!r}; the model could not learn to stop. Use another template.")
            start, end = len(prompt), end + len(turn_end)
            inside = [t for t, (a, b) in enumerate(enc.offsets) if a < end and b > start]
            for t in range(inside[0], inside[-1] + 1) if inside else ():  # contiguous: trimmed offsets too
                mask[t] = 1
        return ChatRendering(list(enc.ids), mask)


class Tokenizer:
    """A tokenizer folder (trained or imported): tokenizer.json + tokenizer_config.json + contract.json."""

    def __init__(self, hf: HFTokenizer, contract: Contract, folder: Path):
        self.hf = hf
        self.contract = contract
        self.folder = folder
        self.spellings: dict[str, str | None] = dict(SPECIAL_TOKENS)
        """Special-token strings by name (an imported tokenizer keeps its own, e.g. "</s>"; None
        where the contract has no such token)."""
        self._chat: "ChatTemplate | None" = None
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
        try:
            hf = load_hf_tokenizer(path)
        except Exception as exc:  # the tokenizers library raises a bare Exception on a file it cannot parse
            raise ContractError(
                f"{path} is not a tokenizer the `tokenizers` library can read ({str(exc).splitlines()[0][:200]}). "
                f"Re-create the folder with `lmforge train-tokenizer` or `lmforge import-tokenizer`."
            ) from None
        vocab = vocab_size_of(hf)
        if vocab != contract.vocab_size:
            raise ContractError(
                f"{folder / CONTRACT_FILE}: vocab_size = {contract.vocab_size}, but {path} has {vocab} ids. "
                f"Re-create the folder with `lmforge train-tokenizer` or `lmforge import-tokenizer`."
            )
        spellings = spellings_of(hf, contract)
        ids = special_ids_of(hf, str(path), spellings)  # each a special added token: plain text never makes it
        if ids != contract.special_tokens:
            raise ContractError(
                f"{folder / CONTRACT_FILE}: special_tokens {contract.special_tokens} differ from "
                f"the ids in {path}: {ids} (spellings {spellings}). "
                f"Re-create the folder with `lmforge train-tokenizer` or `lmforge import-tokenizer`."
            )
        config = _read_json(folder / TOKENIZER_CONFIG_FILE) if (folder / TOKENIZER_CONFIG_FILE).is_file() else {}
        check_prefix_space(_read_json(path), config, path, folder / TOKENIZER_CONFIG_FILE)
        # tokenizer_config.json names the same tokens (an imported model's eos_token may be its turn end)
        agree = {"eos_token": {spellings["eos"], spellings["im_end"]}, "pad_token": {spellings["pad"]}}
        if contract.add_bos:
            agree["bos_token"] = {spellings["bos"]}
        for key, allowed in agree.items():
            text = _token_text(config.get(key))
            if text is not None and text not in allowed:
                raise ContractError(
                    f"{folder / TOKENIZER_CONFIG_FILE}: {key} = {text!r}, but the special_tokens of "
                    f"{folder / CONTRACT_FILE} name {sorted(allowed)}. One of the files was edited; re-create the "
                    f"folder with `lmforge train-tokenizer` or `lmforge import-tokenizer`.")
        tok = cls(hf, contract, folder)
        tok.spellings = spellings
        return tok

    def chat_encoder(self) -> HFTokenizer:
        """A copy of the tokenizer that recognises special-token spellings (a rendered chat
        template's text, as transformers tokenizes it); the data path never uses it."""
        if "_chat_hf" not in self.__dict__:
            hf = HFTokenizer.from_str(self.hf.to_str())
            hf.encode_special_tokens = False
            self.__dict__["_chat_hf"] = hf
        return self.__dict__["_chat_hf"]

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
        """A pretraining document: the contract's document start ([bos], or nothing for a model
        without one) + encode(text) + [eos] (EOS terminates, P2)."""
        return [*self.contract.document_start, *self.encode(text), self.eos_id]

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt: a document start (the contract's `document_start`) + encode(text)."""
        return [*self.contract.document_start, *self.encode(text)]

    @property
    def chat_template(self) -> "ChatTemplate":
        """The contract's chat template, compiled (lmforge's ChatML, or an imported model's own)."""
        if self._chat is None:
            self._chat = ChatTemplate(self.contract.chat_template, self.template_variables(),
                                      f"the chat template of {self.folder / TOKENIZER_CONFIG_FILE}")
        return self._chat

    def template_variables(self) -> dict[str, str]:
        """What `transformers` passes a chat template besides the messages: tokenizer_config.json's
        special-token strings (bos_token, eos_token, unk_token, pad_token), where set."""
        path = self.folder / TOKENIZER_CONFIG_FILE
        return _template_vars(_read_json(path) if path.is_file() else {})

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> ChatRendering:
        """The conversation's ids and the assistant-only loss mask, rendered with the contract's
        chat template: equal, id for id, to `transformers`' apply_chat_template on this folder.

        lmforge's ChatML (CHAT_TEMPLATE) is built directly, with message contents as plain text
        (text that spells a special token stays text). Any other template (an imported model's
        own) goes through `ChatTemplate.render_ids`, which renders it with Jinja as transformers
        does and finds the assistant spans by rendering prefixes.

        Each message: {"role": "system"|"user"|"assistant", "content": str}.
        Raises:
            DataError: a template lmforge cannot render faithfully for this conversation, or a
            template's own error (e.g. roles that do not alternate), naming the template.
        """
        if self.contract.chat_template != CHAT_TEMPLATE:
            return self.chat_template.render_ids(self, messages, add_generation_prompt)
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
        raw = loads_json(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:  # the system's refusal, in its own words (not a damaged file)
        raise os_error(exc, path, "read") from None
    except (UnicodeDecodeError, ValueError) as exc:
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
                     log: Callable[[str], None] | None = None, eos_token: str = "",
                     extra_files: dict | None = None) -> "Tokenizer":
    """Bring your own tokenizer: derive lmforge's contract from a Hugging Face tokenizer folder.

    `src_dir` holds `tokenizer.json` and `tokenizer_config.json` as `transformers`'
    `save_pretrained` writes them (`special_tokens_map.json` is read too when present). The
    source folder is never modified; `out_dir` gets a new lmforge tokenizer folder
    (tokenizer.json, tokenizer_config.json, contract.json), written atomically.

    Special tokens, by name:
        eos       the document terminator: tokenizer_config.json's `eos_token`, or, where that
                  ends a chat turn (TURN_END_SPELLINGS: <|im_end|>, <|eot_id|>, ...), the first of
                  TERMINATOR_SPELLINGS the vocabulary holds as a special token (said in one
                  line); `eos_token` (the setting tokenizer.eos_token) names it where none exists.
        bos       `bos_token` when the tokenizer prepends it (tokenizer_config.json's
                  add_bos_token, else tokenizer.json's post-processor): `add_bos` true; else
                  null unless it is a distinct special token (SmolLM2 names <|im_start|>).
        im_end    the special token the model's chat template closes a reply with (found by
                  rendering a probe conversation; may equal eos); im_start <|im_start|> where the
                  vocabulary has it, else null. A folder without a template gets lmforge's
                  ChatML and its two tokens (added when missing).
        pad       `pad_token` when it is a distinct special token; otherwise a new `<|pad|>`,
                  so PAD is its own token (P4). Labels are masked by the batch's `loss_mask`,
                  never by comparing ids with `pad_id`.
    Every one of them is a special added token (plain text that spells it stays plain text).
    tokenizer_config.json keeps the model's own bos_token / eos_token (what transformers and
    the template see); the contract holds lmforge's ids.
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
        hf = load_hf_tokenizer(path)
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

    specials = {a.content for a in hf.get_added_tokens_decoder().values() if a.special}
    eos_declared = declared("eos")
    # -- the document terminator (P2): the declared eos_token, unless it ends a chat turn -----------
    if eos_token:
        if eos_token not in vocab:
            raise ContractError(f"tokenizer.eos_token = {eos_token!r} is not a token of {path}; set it to a token "
                                f"the vocabulary has (for example one of {list(TERMINATOR_SPELLINGS)}).")
        eos = eos_token
    elif eos_declared is not None and eos_declared not in TURN_END_SPELLINGS:
        eos = eos_declared
    else:
        eos = next((t for t in TERMINATOR_SPELLINGS if t in specials), None)
        if eos is None:
            seen = f"eos_token = {eos_declared!r} ends a chat turn" if eos_declared else f"{cfg_path} sets no eos_token"
            raise ContractError(
                f"--from {src}: {seen}, and the vocabulary has no document terminator (none of "
                f"{list(TERMINATOR_SPELLINGS)} is a special token). lmforge ends every document with one (P2). "
                f"Name the token that ends a document: --set tokenizer.eos_token=TOKEN.")
        if eos_declared:
            say(f"eos: eos_token {eos_declared!r} ends a chat turn; documents end with {eos!r}, the vocabulary's "
                f"document terminator")
    unk = _token_text(config.get("unk_token"))
    # -- the chat template: the model's own, or lmforge's ChatML when it has none --------------------
    template = _foreign_template(src, config)
    if template is None:
        chat = {"im_start": SPECIAL_TOKENS["im_start"], "im_end": SPECIAL_TOKENS["im_end"]}
        if eos in chat.values():
            raise ContractError(f"--from {src}: the document terminator {eos!r} is ChatML's turn token and the "
                                f"folder has no chat template of its own. Set --set tokenizer.eos_token=TOKEN.")
        for name, text in chat.items():
            if text not in vocab:
                say(f"{name}: no chat template and no {text!r}; adding it (lmforge's ChatML)")
        template = CHAT_TEMPLATE
    else:
        chat = {"im_start": SPECIAL_TOKENS["im_start"] if SPECIAL_TOKENS["im_start"] in specials else None,
                "im_end": None}
    # -- BOS: the model's own convention ------------------------------------------------------------
    bos = declared("bos")
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):  # what tokenizer.json's post-processor does
        probe = hf.encode("a", add_special_tokens=True).ids
        add_bos = bool(probe) and bos is not None and probe[0] == hf.token_to_id(bos)
    if add_bos and bos is None:
        raise ContractError(f"{cfg_path}: add_bos_token is true but there is no bos_token; set bos_token to the "
                            f"token documents start with, or add_bos_token to false.")
    if bos is not None and (bos in (eos, chat["im_start"]) or bos not in specials):
        if add_bos:
            raise ContractError(f"{cfg_path}: bos_token = {bos!r} is prepended to every document but is also the "
                                f"{'EOS' if bos == eos else 'chat-turn start or not a special token'}; lmforge "
                                f"cannot tell documents apart. Use another tokenizer.")
        bos = None  # SmolLM2 names <|im_start|> its bos_token but never prepends it
    say(f"bos: documents start with {bos!r}" if add_bos else "bos: none (the model's tokenizer prepends no BOS)")
    spell = {"eos": eos, "bos": bos if add_bos or bos is not None else None, **chat}
    # -- the end of a chat turn: what the template closes an assistant turn with ---------------------
    if spell["im_end"] is None:
        spell["im_end"] = _turn_end_of(template, {**_template_vars(config), "eos_token": eos_declared or eos},
                                       specials, src)
    pad = declared("pad")
    if pad is None or pad in spell.values() or pad == unk or pad not in specials:
        added = SPECIAL_TOKENS["pad"] not in vocab
        say(f"pad: {'pad_token ' + repr(pad) + ' is also EOS/BOS/UNK/end of turn' if pad else 'no pad_token'}; "
            f"using {SPECIAL_TOKENS['pad']!r}{' (one added token)' if added else ''}; it only pads (labels are "
            f"masked by loss_mask, never by pad id)")
        pad = SPECIAL_TOKENS["pad"]
    spell["pad"] = pad
    spell = {name: spell[name] for name in SPECIAL_TOKENS}
    hf.add_special_tokens([AddedToken(text, special=True, normalized=False)
                           for text in spell.values() if text is not None])
    hf.no_padding()
    hf.no_truncation()
    hf.encode_special_tokens = True
    special_ids = {hf.token_to_id(t) for t in spell.values() if t is not None}
    for text in (*ROUND_TRIP_PROBES, *(t for t in spell.values() if t is not None)):
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
    if template != CHAT_TEMPLATE:
        say(f"chat template: the model's own ({len(template)} characters); turns end with {spell['im_end']!r}")
    extra: dict = {"add_prefix_space": prefix[0][1]} if prefix else {}
    if unk and unk in vocab:
        extra["unk_token"] = unk
    if template != CHAT_TEMPLATE:  # what transformers and the template see stays the model's own
        extra.update({k: v for k, v in _template_vars(config).items() if k in ("bos_token", "eos_token")})
        extra["add_bos_token"] = add_bos
        extra["additional_special_tokens"] = None
    return save_tokenizer(hf, out, spell, extra, extra_files=extra_files, chat_template=template, add_bos=add_bos)


#: eos_token spellings that end a chat turn rather than a document (SmolLM2, Qwen2.5-Instruct:
#: <|im_end|>; Llama 3 Instruct: <|eot_id|> / <|eom_id|>; Gemma: <end_of_turn>; Phi-3: <|end|>).
TURN_END_SPELLINGS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")
#: Document terminators of common vocabularies, in the order they are looked for.
TERMINATOR_SPELLINGS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
#: The conversation a template is probed with at import (its turn end, its prefix property).
PROBE_CHAT = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
              {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye"})


def _template_vars(config: dict) -> dict[str, str]:
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        text = _token_text(config.get(name))
        if text:
            out[name] = text
    return out


def _foreign_template(src: Path, config: dict) -> str | None:
    """The folder's chat template: chat_template.jinja (transformers >= 4.47 writes it), else
    tokenizer_config.json's chat_template (a string, or a list of named templates: "default").

    Raises:
        ContractError: a template that is not text, or a list without a "default" one.
    """
    path = src / "chat_template.jinja"
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ContractError(f"{path}: not readable UTF-8 text ({exc}).") from None
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
        if value is None:
            raise ContractError(f"{src / TOKENIZER_CONFIG_FILE}: chat_template is a list of named templates "
                                f"{sorted(map(str, named))} without a 'default' one; lmforge needs one template.")
    if value is not None and not isinstance(value, str):
        raise ContractError(f"{src / TOKENIZER_CONFIG_FILE}: chat_template = {short_repr(value)}: expected text.")
    return value or None


def short_repr(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _turn_end_of(template: str, variables: dict, specials: set[str], src: Path) -> str:
    """The special token the template closes an assistant turn with: the last one in the text
    a reply adds (PROBE_CHAT), which must also render as a prefix of the longer chat.

    Raises:
        ContractError: the template does not render the probe, breaks the prefix property, or
        ends a reply with no special token.
    """
    name = f"the chat template of {src}"
    tpl = ChatTemplate(template, variables, name)
    try:
        prompt = tpl.render(PROBE_CHAT[:1], add_generation_prompt=True)
        reply = tpl.render(PROBE_CHAT[:2])
        whole = tpl.render(PROBE_CHAT)
    except DataError as exc:
        raise ContractError(f"{exc}") from None
    if not (reply.startswith(prompt) and whole.startswith(reply)):
        raise ContractError(
            f"{name} cannot be rendered faithfully: a reply's rendering is not a prefix of the longer "
            f"conversation's (the template changes earlier turns, e.g. drops their reasoning). lmforge refuses it "
            f"rather than train on a rendering the model is never served with.")
    added = reply[len(prompt):]
    found = max(((added.rfind(t), t) for t in specials if t in added), default=None)
    if found is None:
        raise ContractError(f"{name} ends an assistant reply ({added!r}) with no special token, so generation "
                            f"could not stop at the end of a turn. Use a template with an end-of-turn token.")
    return found[1]
