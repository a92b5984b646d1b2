"""Bring your own tokenizer: `import_tokenizer` turns a Hugging Face tokenizer folder into an
lmforge one, deriving the contract from the model's own conventions (terminator, BOS, chat
template and turn end, PAD)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from tokenizers import AddedToken

from lmforge.contract import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from lmforge.errors import ContractError, DataError
from lmforge.fileio import OutputError, check_not_input, check_output, load_hf_tokenizer
from lmforge.tokenizer.chat import PROBE_CHAT, ChatTemplate, conversation_close
from lmforge.tokenizer.hf_json import (
    prefix_space_settings,
    read_json,
    template_vars,
    token_text,
    check_prefix_space,
)
from lmforge.tokenizer.runtime import Tokenizer
from lmforge.tokenizer.specials import CHAT_TEMPLATE, SPECIAL_TOKENS
from lmforge.tokenizer.train import TOKENIZER_OUTPUT, save_tokenizer

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


class FamilyTemplate(NamedTuple):
    """What a model family's record says of chat (`export.families.chat_template_of`): the chat
    template a model of the family without one of its own is imported with, and the token that
    closes its turns; `template` None: the record has none (lmforge's ChatML then). `name` names
    the family in the line saying which template was taken."""

    name: str
    template: str | None
    end_of_turn: str | None


def _foreign_config(src: Path) -> dict:
    """special_tokens_map.json (older `transformers`) overlaid by tokenizer_config.json."""
    config: dict = {}
    for name in ("special_tokens_map.json", TOKENIZER_CONFIG_FILE):
        if (src / name).is_file():
            config.update(read_json(src / name))
    return config


def import_tokenizer(src_dir: str | Path, out_dir: str | Path,
                     log: Callable[[str], None] | None = None, eos_token: str = "",
                     extra_files: dict | None = None, inputs=(),
                     family: FamilyTemplate | None = None) -> "Tokenizer":
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
                  vocabulary has it, else null. A folder without a template gets its model
                  family's (`family`: the record's template, no token added; its end of turn
                  becomes a special token where it is a plain one), or, where no family is
                  known, the record has no template or the vocabulary lacks the record's end of
                  turn, lmforge's ChatML and its two tokens (added when missing); one line says
                  which.
        pad       `pad_token` when it is a distinct special token; otherwise a new `<|pad|>`,
                  so PAD is its own token (P4). Labels are masked by the batch's `loss_mask`,
                  never by comparing ids with `pad_id`.
    Every one of them is a special added token (plain text that spells it stays plain text).
    tokenizer_config.json keeps the model's own bos_token / eos_token (what transformers and
    the template see); the contract holds lmforge's ids.
    Padding and truncation stored in tokenizer.json are switched off.

    Args:
        log: called with a line per change made (added tokens, dropped template).
        inputs: the command's other inputs ((name, path) pairs: the corpus its report samples),
            none of which `out_dir` may be, hold or lie inside (as `src_dir`).
        family: the model's family as its record speaks of chat (`export.families.chat_template_of`;
            import-hf and import-gguf pass it): the template for a folder without one. None: no
            model, no family (`lmforge import-tokenizer`).
    Returns:
        the imported Tokenizer (loaded back from `out_dir`).
    Raises:
        ContractError: no tokenizer.json; no (or an unknown) eos_token; a declared special
            token that is not in the vocab; add_prefix_space disagreeing between the two
            files; a tokenizer that does not round-trip text exactly (ROUND_TRIP_PROBES).
        OutputError: `out_dir` is `src_dir` (any name for it), holds it or lies inside it
            (`fileio.check_not_input`), or holds files that are not a tokenizer's.
    """
    say = log or (lambda _msg: None)
    src, out = Path(src_dir), Path(out_dir)
    _check_folders(src, out, inputs)
    hf = _read_foreign(src / TOKENIZER_FILE)
    spell, extra, template, add_bos = _derive_contract(hf, src, eos_token, family, say)
    return save_tokenizer(hf, out, spell, extra, extra_files=extra_files, chat_template=template, add_bos=add_bos)


def _derive_contract(hf, src: Path, eos_token: str, family: FamilyTemplate | None,
                     say: Callable[[str], None]) -> tuple[dict, dict, str, bool]:
    """`import_tokenizer`'s derivation, checks in its order: (spell: the special tokens' texts by
    SPECIAL_TOKENS name, extra: tokenizer_config.json's own entries, chat template, add_bos).
    Adds the special tokens to `hf` and switches off its padding and truncation."""
    path = src / TOKENIZER_FILE
    cfg_path = src / TOKENIZER_CONFIG_FILE
    config = _foreign_config(src)
    tokenizer_json = read_json(path)
    check_prefix_space(tokenizer_json, config, path, cfg_path)
    prefix = prefix_space_settings(tokenizer_json.get("pre_tokenizer"))
    vocab = hf.get_vocab(with_added_tokens=True)

    def declared(name: str) -> str | None:
        return _declared(config, vocab, name, path, cfg_path)

    specials = {a.content for a in hf.get_added_tokens_decoder().values() if a.special}
    eos_declared = declared("eos")
    eos = _document_terminator(eos_token, eos_declared, vocab, specials, src, path, cfg_path, say)
    unk = token_text(config.get("unk_token"))
    template, own, turn_specials, chat = _chat_setup(src, config, family, eos, vocab, specials, say)
    bos, add_bos = _bos_convention(hf, config, declared("bos"), eos, chat["im_start"], specials, cfg_path, say)
    spell = {"eos": eos, "bos": bos if add_bos or bos is not None else None, **chat}
    # -- the end of a chat turn: what the template closes an assistant turn with ---------------------
    if spell["im_end"] is None:
        spell["im_end"] = _turn_end_of(template, {**template_vars(config), "eos_token": eos_declared or eos},
                                       turn_specials, src)
    spell["pad"] = _pad_token(declared("pad"), spell, unk, vocab, specials, say)
    spell = {name: spell[name] for name in SPECIAL_TOKENS}
    had = {a.content: a for a in hf.get_added_tokens_decoder().values()}  # strip flags kept (Phi-3's rstrip)
    hf.add_special_tokens([AddedToken(text, special=True, normalized=False, lstrip=getattr(had.get(text), "lstrip", False),
                                      rstrip=getattr(had.get(text), "rstrip", False),
                                      single_word=getattr(had.get(text), "single_word", False))
                           for text in spell.values() if text is not None])
    hf.no_padding()
    hf.no_truncation()
    hf.encode_special_tokens = True
    _check_round_trips(hf, spell, path)
    if own:
        say(f"chat template: the model's own ({len(template)} characters); turns end with {spell['im_end']!r}")
    extra: dict = {"add_prefix_space": prefix[0][1]} if prefix else {}
    if unk and unk in vocab:
        extra["unk_token"] = unk
    if template != CHAT_TEMPLATE:  # what transformers and the template see stays the model's own
        extra.update({k: v for k, v in template_vars(config).items() if k in ("bos_token", "eos_token")})
        extra["add_bos_token"] = add_bos
        extra["additional_special_tokens"] = None
    return spell, extra, template, add_bos


def _check_folders(src: Path, out: Path, inputs) -> None:
    """Refuse a source without tokenizer.json and an `out` that is, holds or lies in an input,
    or holds files that are not a tokenizer's; before any work (ContractError / OutputError)."""
    path = src / TOKENIZER_FILE
    if not path.is_file():
        raise ContractError(
            f"--from {src}: no {TOKENIZER_FILE} there. lmforge imports the folder that `transformers` "
            f"writes with `tokenizer.save_pretrained(DIR)` (a fast tokenizer: {TOKENIZER_FILE} + "
            f"{TOKENIZER_CONFIG_FILE}); save the tokenizer that way first."
        )
    if out.resolve() == src.resolve():
        raise OutputError(f"--out {out} is the --from folder; the source is never modified. Choose another --out.")
    # nor the same folder under another name (a mount), inside it, or holding it (`fileio.check_not_input`)
    check_not_input(out, [("--from", src), *inputs],
                    own_check=lambda: check_output(out, TOKENIZER_OUTPUT, "import-tokenizer", replace_whole=True))
    check_output(out, TOKENIZER_OUTPUT, "import-tokenizer", replace_whole=True)  # before any work


def _read_foreign(path: Path):
    """The HF `tokenizers.Tokenizer` in `path`; ContractError where the library cannot read it."""
    try:
        return load_hf_tokenizer(path)
    except Exception as exc:  # the Rust library raises plain Exception subclasses
        raise ContractError(f"{path}: HF tokenizers cannot read it ({exc}). Use a tokenizer.json that "
                            f"`tokenizers.Tokenizer.from_file` loads.") from None


def _declared(config: dict, vocab: dict, name: str, path: Path, cfg_path: Path) -> str | None:
    """The text of the config's `{name}_token` (None: unset); ContractError where the vocab lacks it."""
    text = token_text(config.get(f"{name}_token"))
    if text is not None and text not in vocab:
        raise ContractError(
            f"{cfg_path}: {name}_token = {text!r} is not a token of {path}. Set {name}_token to a "
            f"token the tokenizer has, or remove it."
        )
    return text


def _document_terminator(eos_token: str, eos_declared: str | None, vocab: dict, specials: set[str],
                         src: Path, path: Path, cfg_path: Path, say: Callable[[str], None]) -> str:
    """The document terminator (P2): the setting `eos_token`, else the declared eos_token unless it
    ends a chat turn, else the first of TERMINATOR_SPELLINGS that is a special token."""
    if eos_token:
        if eos_token not in vocab:
            raise ContractError(f"tokenizer.eos_token = {eos_token!r} is not a token of {path}; set it to a token "
                                f"the vocabulary has (for example one of {list(TERMINATOR_SPELLINGS)}).")
        return eos_token
    if eos_declared is not None and eos_declared not in TURN_END_SPELLINGS:
        return eos_declared
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
    return eos


def _chat_setup(src: Path, config: dict, family: FamilyTemplate | None, eos: str, vocab: dict,
                specials: set[str], say: Callable[[str], None]) -> tuple[str, bool, set[str], dict]:
    """The chat template (the model's own, its family's, or lmforge's ChatML), whether it is the
    model's own, the specials its turn end is looked among, and the chat tokens ({"im_start",
    "im_end"}: text or None; None im_end: found from the template later)."""
    template = _foreign_template(src, config)
    own = template is not None and template != CHAT_TEMPLATE  # said below, as before
    turn_specials = specials  # where the template's turn end is looked for: the family's end of turn too
    if template is None and family is not None and family.template is not None:
        if family.end_of_turn is None or family.end_of_turn in vocab:
            template, end = family.template, family.end_of_turn
            made = ", made a special token" if end is not None and end not in specials else ""
            turns = f", turns closed by {end!r}{made}" if end is not None else ""
            say(f"chat template: {src} has none; using {family.name}'s chat template (export/families/){turns}; "
                f"no token added")
            turn_specials = specials | ({end} if end is not None else set())
        else:
            why = (f"{family.name}'s chat template (export/families/) closes turns with {family.end_of_turn!r}, "
                   f"which the vocabulary lacks")
    elif template is None:
        why = (f"{family.name}'s record in export/families/ has no chat template" if family is not None
               else "no model family's template applies")
    if template is None:
        say(f"chat template: {src} has none and {why}; using lmforge's ChatML")
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
    return template, own, turn_specials, chat


def _bos_convention(hf, config: dict, bos: str | None, eos: str, im_start: str | None, specials: set[str],
                    cfg_path: Path, say: Callable[[str], None]) -> tuple[str | None, bool]:
    """(bos, add_bos): the model's own BOS convention; `bos` (the declared bos_token) becomes None
    where it is not prepended and is EOS, the chat-turn start or not a special token."""
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):  # what tokenizer.json's post-processor does
        probe = hf.encode("a", add_special_tokens=True).ids
        add_bos = bool(probe) and bos is not None and probe[0] == hf.token_to_id(bos)
    if add_bos and bos is None:
        raise ContractError(f"{cfg_path}: add_bos_token is true but there is no bos_token; set bos_token to the "
                            f"token documents start with, or add_bos_token to false.")
    if bos is not None and (bos in (eos, im_start) or bos not in specials):
        if add_bos:
            raise ContractError(f"{cfg_path}: bos_token = {bos!r} is prepended to every document but is also the "
                                f"{'EOS' if bos == eos else 'chat-turn start or not a special token'}; lmforge "
                                f"cannot tell documents apart. Use another tokenizer.")
        bos = None  # SmolLM2 names <|im_start|> its bos_token but never prepends it
    say(f"bos: documents start with {bos!r}" if add_bos else "bos: none (the model's tokenizer prepends no BOS)")
    return bos, add_bos


def _pad_token(pad: str | None, spell: dict, unk: str | None, vocab: dict, specials: set[str],
               say: Callable[[str], None]) -> str:
    """The declared pad_token where it is a distinct special token, else `<|pad|>` (said in one line)."""
    if pad is None or pad in spell.values() or pad == unk or pad not in specials:
        added = SPECIAL_TOKENS["pad"] not in vocab
        say(f"pad: {'pad_token ' + repr(pad) + ' is also EOS/BOS/UNK/end of turn' if pad else 'no pad_token'}; "
            f"using {SPECIAL_TOKENS['pad']!r}{' (one added token)' if added else ''}; it only pads (labels are "
            f"masked by loss_mask, never by pad id)")
        pad = SPECIAL_TOKENS["pad"]
    return pad


def _check_round_trips(hf, spell: dict, path: Path) -> None:
    """ContractError unless ROUND_TRIP_PROBES and the special tokens' own texts round-trip exactly
    and encode, as plain text, to no special-token id (P4)."""
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


#: eos_token spellings that end a chat turn rather than a document (SmolLM2, Qwen2.5-Instruct:
#: <|im_end|>; Llama 3 Instruct: <|eot_id|> / <|eom_id|>; Gemma: <end_of_turn>; Phi-3: <|end|>).
TURN_END_SPELLINGS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")
#: Document terminators of common vocabularies, in the order they are looked for.
TERMINATOR_SPELLINGS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


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
    close = conversation_close(reply, whole, variables.values()) if reply.startswith(prompt) else None  # Phi-3's
    if close is None:
        raise ContractError(
            f"{name} cannot be rendered faithfully: a reply's rendering is not a prefix of the longer "
            f"conversation's (the template changes earlier turns, e.g. drops their reasoning). lmforge refuses it "
            f"rather than train on a rendering the model is never served with.")
    added = reply[len(prompt):len(reply) - len(close)]
    found = max(((added.rfind(t), t) for t in specials if t in added), default=None)
    if found is None:
        raise ContractError(f"{name} ends an assistant reply ({added!r}) with no special token, so generation "
                            f"could not stop at the end of a turn. Use a template with an end-of-turn token.")
    return found[1]
