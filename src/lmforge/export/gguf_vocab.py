"""The tokenizer of a GGUF file (`export/gguf.py` writes it; `export/gguf_in.py` reads it back):
tokenizer.json mapped to the llama.cpp tokenizer that computes the same ids (`gguf_vocab` ->
`GGUFVocab`), and the special-token keys from the contract (`tokenizer_keys`).

Tokenizer: mapped by what tokenizer.json computes, never by its name (`gguf_vocab`):

    byte-level BPE, pre-tokenizer                          tokenizer.ggml.model / .pre
    ByteLevel with GPT-2's regex (GPT-2)                   gpt2 / gpt-2
    Digits(individual) + ByteLevel (SmolLM, SmolLM2)       gpt2 / smollm
    Split(Llama 3's regex) + ByteLevel, ignore_merges      gpt2 / llama-bpe   (Llama 3)
    Split(Llama 3's regex) + ByteLevel, merges always      gpt2 / smaug-bpe
    Split(Qwen2's regex) + ByteLevel (Qwen2, lmforge's)    gpt2 / qwen2
    BPE with byte fallback, "▁" for spaces                 llama / default    (Llama 2, Mistral, TinyLlama;
                                                           Gemma, with add_space_prefix false)

llama.cpp's converter recognises a pre-tokenizer by hashing the ids of a fixed text; the split
regexes and names here are those of its loader (`llama_vocab::impl::load`). SentencePiece-style
tokenizers have no merges in llama.cpp: it merges the adjacent pair whose concatenation scores
highest, so each token's score is minus the rank of the first HF merge that makes it, which
applies HF's merges in HF's order (`_spm_scores` says when, and refuses otherwise; llama.cpp's
own converter writes -1000 for every token of such a tokenizer, which does not). Anything else
(Unigram or WordPiece, a normalizer llama.cpp does not apply, another split, dropout, added
tokens that strip spaces, missing byte tokens, two ids with one spelling) is refused with an
`ExportError` naming what was seen: llama.cpp would load the file and tokenize differently.
Special added tokens are CONTROL (plain text that spells one stays plain text unless the runtime
parses specials, as lmforge's data path does), other added tokens USER_DEFINED; an id the
tokenizer leaves unused (a gap) becomes an UNUSED placeholder "[PAD{id}]".

BOS. `add_bos_token` follows the contract: lmforge's completion (`lmforge generate`, every
pretraining document) starts with the BOS exactly when llama.cpp prepends it to a prompt.
lmforge's ChatML rendering (`Tokenizer.render_chat`) has no BOS; llama.cpp's chat mode prepends
one before the first <|im_start|> when add_bos_token is true (one extra token at the start).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from lmforge.contract import Contract
from lmforge.export.llama_cpp import require_gguf, rstrip_rule
from lmforge.export.options import ExportError
from lmforge.fileio import loads_json
from lmforge.tokenizer import CHAT_TEMPLATE, SPLIT_PATTERN, byte_decoder

#: The split regexes of the byte-level BPE pre-tokenizers llama.cpp implements (as they appear
#: in tokenizer.json; llama.cpp's `llm_tokenizer_bpe` carries an equivalent form of each).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = SPLIT_PATTERN
SPM_SPACE = "\u2581"  # "▁": SentencePiece's escaped space
_BYTE_TOKEN = re.compile(r"<0x([0-9A-F]{2})>")

#: llama.cpp's name for each byte-level BPE pre-tokenizer (tokenizer.ggml.pre), by the structure
#: of tokenizer.json that computes the same split: (split regex or None for ByteLevel's own
#: GPT-2 regex, digits split first, model.ignore_merges) -> name. The names are those of
#: `llama_vocab::impl::load` (src/llama-vocab.cpp); the converter picks the same ones by hash.
_BYTE_LEVEL_PRE = {
    (None, False, False): "gpt-2",       # GPT-2's ByteLevel regex
    (None, True, False): "smollm",       # digits one at a time, then GPT-2's regex (SmolLM, SmolLM2)
    (LLAMA3_PATTERN, False, True): "llama-bpe",   # Llama 3 (a whole pre-token in the vocab is kept)
    (LLAMA3_PATTERN, False, False): "smaug-bpe",  # Llama 3's regex, merges always applied
    (QWEN2_PATTERN, False, False): "qwen2",       # Qwen2/2.5/3, and lmforge's own tokenizer
}


@dataclass
class GGUFVocab:
    """The tokenizer as llama.cpp reads it.

    model: tokenizer.ggml.model: "gpt2" (byte-level BPE with merges) or "llama"
        (SentencePiece-style: BPE over characters with byte fallback, merged by score).
    pre: tokenizer.ggml.pre: the byte-level pre-tokenizer ("gpt-2", "smollm", "llama-bpe",
        "smaug-bpe", "qwen2"), or "default" for "llama".
    tokens: one string per id, 0..vocab_size-1 (byte-level spellings such as "Ġthe" for "gpt2";
        "▁the" and "<0x0A>" for "llama").
    token_types: gguf.TokenType per id (NORMAL; CONTROL for special tokens; USER_DEFINED for
        other added tokens; BYTE for "<0xNN>"; UNKNOWN for the unk token; UNUSED for ids the
        tokenizer never produces).
    merges: "left right" per merge rule, in rank order ("gpt2" only; empty for "llama").
    scores: per id ("llama" only): minus the rank of the first merge that makes the token, so
        that llama.cpp's highest-score-first merging applies HF's merges in rank order.
    add_space_prefix: "llama" only: a "▁" is put before the text (and after each special token).
    unk_id: the model's unk token id, or None.
    rstrip: the added tokens strip the spaces after them as llama.cpp's Phi-3 rule makes them
        (`llama_cpp.rstrip_rule`; Phi-3's own tokenizer): the file's general.name must then say "phi3"
        (`llama_cpp.gguf_name`), and must not otherwise.
    """

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    scores: list[float] | None = None
    add_space_prefix: bool | None = None
    unk_id: int | None = None
    rstrip: bool = False


def _brief(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)[:300]


def _byte_level_pre(tj: dict, path: Path, fix: str) -> str:
    """llama.cpp's pre-tokenizer name for a byte-level BPE tokenizer.json (see _BYTE_LEVEL_PRE).

    Raises:
        ExportError: a pre-tokenizer llama.cpp does not implement (what was seen, what is known).
    """
    pre = tj.get("pre_tokenizer")
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    steps = [s for s in steps or [] if isinstance(s, dict)]
    byte_level = steps[-1] if steps and steps[-1].get("type") == "ByteLevel" else None
    key = None
    if byte_level is not None and not byte_level.get("add_prefix_space", False):
        head = steps[:-1]
        if byte_level.get("use_regex", True):
            if not head:
                key = (None, False)
            elif len(head) == 1 and head[0].get("type") == "Digits" and head[0].get("individual_digits"):
                key = (None, True)
        elif len(head) == 1 and head[0].get("type") == "Split" and head[0].get("behavior") == "Isolated" \
                and not head[0].get("invert") and set(head[0].get("pattern") or {}) == {"Regex"}:
            key = (head[0]["pattern"]["Regex"], False)
    ignore_merges = bool((tj.get("model") or {}).get("ignore_merges"))
    name = _BYTE_LEVEL_PRE.get((*key, ignore_merges)) if key else None
    if name is None:
        known = ("ByteLevel with GPT-2's regex (gpt-2); Digits(individual_digits) then ByteLevel (smollm); "
                 "Split with Llama 3's regex then ByteLevel(use_regex=false), with model.ignore_merges true "
                 "(llama-bpe) or false (smaug-bpe); Split with Qwen2's regex then ByteLevel(use_regex=false) "
                 "(qwen2); no add_prefix_space")
        seen = f"pre_tokenizer = {_brief(pre)}, model.ignore_merges = {str(ignore_merges).lower()}"
        raise ExportError(f"{path}: {seen}: llama.cpp implements no byte-level pre-tokenizer that splits text "
                          f"this way (it knows: {known}). {fix}")
    return name


def _spm_space_prefix(tj: dict, path: Path, fix: str) -> bool:
    """Whether a SentencePiece-style tokenizer.json puts "▁" before the text, in the forms llama.cpp's
    `llama` tokenizer computes: normalizer Prepend("▁") + Replace(" ", "▁") (Llama 2, Mistral,
    TinyLlama) -> True; Replace(" ", "▁") alone (Gemma), or pre-tokenizer Metaspace(prepend_scheme
    "never", split false) -> False. After Replace no space is left, so a pre-tokenizer that splits on
    the string " " (Gemma's tokenizer.json: Split(" ", MergedWithPrevious)) splits nothing and is
    accepted with it.

    Raises:
        ExportError: any other normalizer or pre-tokenizer (Metaspace with "first"/"always" keeps a
        leading space as the only "▁" where llama.cpp adds one; NFKC and others change text).
    """
    norm, pre = tj.get("normalizer"), tj.get("pre_tokenizer")
    steps = norm.get("normalizers") if isinstance(norm, dict) and norm.get("type") == "Sequence" else [norm]
    steps = [s for s in steps or [] if s is not None]
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPM_SPACE}
    prepend = {"type": "Prepend", "prepend": SPM_SPACE}
    no_op = isinstance(pre, dict) and pre.get("type") == "Split" and pre.get("pattern") == {"String": " "} \
        and not pre.get("invert")  # on text without spaces (Gemma's, after the Replace normalizer)
    if (pre is None or no_op) and steps in ([prepend, replace], [replace]):
        return steps[0] == prepend
    if not steps and isinstance(pre, dict) and pre.get("type") == "Metaspace" \
            and pre.get("replacement") == SPM_SPACE and pre.get("prepend_scheme") == "never" and not pre.get("split"):
        return False
    raise ExportError(
        f"{path}: normalizer = {_brief(norm)}, pre_tokenizer = {_brief(pre)}: llama.cpp's SentencePiece "
        f"tokenizer (`llama`) escapes spaces as \"▁\" and puts one \"▁\" before the text, so it computes only "
        f"normalizer Prepend(\"▁\") + Replace(\" \", \"▁\") with no pre-tokenizer (Llama 2, Mistral, TinyLlama), "
        f"or no prefix at all (Replace alone, or Metaspace with prepend_scheme \"never\" and split false). "
        f"Metaspace with prepend_scheme \"first\"/\"always\" differs on text that starts with a space; any other "
        f"normalizer changes the text before tokenizing, which llama.cpp does not. {fix}"
    )


def _spm_scores(tokens: list[str | None], merges: list[tuple[str, str]], path: Path, fix: str) -> list[float]:
    """Scores under which llama.cpp's SentencePiece merging (always the adjacent pair whose
    concatenation is the highest-scoring token, leftmost first; `llm_tokenizer_spm_session`)
    applies exactly HF's merges (always the lowest-ranked merge rule, leftmost first).

    score(t) = -(rank of the first merge that makes t); tokens no merge makes get 0 (llama.cpp
    never forms them). The two orders agree when (checked here, refused otherwise):
    - every split of a token into two pieces that could be adjacent (tokens or single
      characters) is a merge rule: llama.cpp merges any such pair, HF only its rules
      (true of tokenizers converted from SentencePiece, whose merges list every split);
    - the rules are grouped by the token they make, in order of its first rule.
    One case is left as it is: a token made by two rules that overlap (a+b = b+c, e.g. "▁" + "▁▁"
    and "▁▁" + "▁") from the three pieces a, b, c side by side; llama.cpp applies the left rule,
    as SentencePiece itself does, HF the lower-ranked. Merging equal pieces from the left makes
    that arrangement rare; tests/interop/ finds it in none of its strings.

    Raises:
        ExportError: naming the first pair or rule that breaks a condition.
    """
    rank = {pair: r for r, pair in enumerate(merges)}
    first: dict[str, int] = {}
    last = -1
    for r, (a, b) in enumerate(merges):
        f = first.setdefault(a + b, r)
        if f < last:
            raise ExportError(
                f"{path}: merge {r} ({a!r} {b!r}) makes {a + b!r}, first made by merge {f}, after merges that make "
                f"later tokens; llama.cpp's SentencePiece tokenizer merges by token score, so it would apply this "
                f"rule earlier than HF does. Merge rules must be grouped by the token they make. {fix}")
        last = f
    known = {t for t in tokens if t is not None}
    for t in known:
        chars = list(t)
        for k in range(1, len(chars)):
            a, b = "".join(chars[:k]), "".join(chars[k:])
            if (a in known or k == 1) and (b in known or len(chars) - k == 1) and (a, b) not in rank:
                raise ExportError(
                    f"{path}: token {t!r} splits into {a!r} + {b!r}, which is not a merge rule: llama.cpp's "
                    f"SentencePiece tokenizer merges any adjacent pair whose concatenation is a token, HF only "
                    f"its merge rules, so the two would tokenize differently (the merges of a tokenizer converted "
                    f"from SentencePiece list every split). {fix}")
    return [float(-first[t]) if t is not None and t in first else 0.0 for t in tokens]


def gguf_vocab(tokenizer_json: str | Path, vocab_size: int, pad_id: int | None = None) -> GGUFVocab:
    """Read `tokenizer.json` and map it to the llama.cpp tokenizer that computes the same ids.

    By what the tokenizer is, never by its name:
    - byte-level BPE (no byte fallback, ByteLevel decoder, no normalizer) -> model "gpt2" with
      the pre-tokenizer its split is (`_BYTE_LEVEL_PRE`: GPT-2's regex, SmolLM's digits + GPT-2,
      Llama 3's regex with or without ignore_merges, Qwen2's regex); vocabulary and merges copied.
    - SentencePiece-style BPE (byte fallback, all 256 "<0xNN>" tokens, "▁" for spaces: Llama 2,
      Mistral, TinyLlama) -> model "llama" with scores from the merge ranks (`_spm_scores`) and
      add_space_prefix from the normalizer (`_spm_space_prefix`).
    Special added tokens are CONTROL (text that spells one stays text unless the runtime parses
    specials), other added tokens USER_DEFINED (always matched, as HF does); an id the tokenizer
    leaves unused becomes an UNUSED placeholder "[PAD{id}]".

    Args:
        tokenizer_json: the checkpoint's tokenizer.json.
        vocab_size: the contract's vocab_size (ids 0..vocab_size-1).
        pad_id: the contract's pad (never in text: its stripping does not matter).
    Raises:
        ExportError: anything llama.cpp would tokenize differently, named with what was seen: another
            model type (Unigram, WordPiece), a normalizer, a pre-tokenizer llama.cpp lacks, dropout,
            a subword prefix/suffix, missing byte tokens, added tokens with lstrip/single_word, or with
            rstrip other than llama.cpp's Phi-3 set (`llama_cpp.rstrip_rule`),
            two ids with one spelling, ids outside [0, vocab_size).
    """
    require_gguf()  # the token types are gguf's: refused before any work when it is missing
    path = Path(tokenizer_json)
    try:
        tj = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: cannot read it as JSON ({exc}).") from None
    fix = ("The GGUF would tokenize differently from this checkpoint, so it is not written. Export with "
           "--format hf, or use a tokenizer llama.cpp computes (`lmforge train-tokenizer` makes one).")
    model = tj.get("model") or {}
    spm, kind, pre, add_space_prefix = _tokenizer_kind(tj, path, fix)
    tokens, types, unk_id, rstrip = _token_table(tj, spm, vocab_size, path, fix)
    pairs = _merge_pairs(model, path, fix)
    names = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    _check_rstrip(rstrip, names, types, pad_id, path, fix)
    if spm:
        scores = _spm_scores(tokens, pairs, path, fix)
        return GGUFVocab(kind, pre, names, types, [], scores, add_space_prefix, unk_id, bool(rstrip))
    return GGUFVocab(kind, pre, names, types, [f"{a} {b}" for a, b in pairs], unk_id=unk_id, rstrip=bool(rstrip))


def _tokenizer_kind(tj: dict, path: Path, fix: str) -> tuple[bool, str, str, bool | None]:
    """(SentencePiece-style?, GGUF tokenizer model, pre-tokenizer, add_space_prefix) of a
    tokenizer.json; refuses a model type, option, normalizer or decoder llama.cpp lacks."""
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise ExportError(
            f"{path}: model.type = {model.get('type')!r}: GGUF export maps BPE tokenizers (byte-level, as GPT-2, "
            f"Llama 3, Qwen2 and SmolLM2 use; or SentencePiece-style with byte fallback, as Llama 2, Mistral and "
            f"TinyLlama use). {fix}")
    for key, want in (("dropout", None), ("continuing_subword_prefix", None), ("end_of_word_suffix", None)):
        value = model.get(key)
        if value not in (want, ""):
            raise ExportError(f"{path}: model.{key} = {value!r}, expected {want!r}: llama.cpp has no such option. {fix}")
    spm = bool(model.get("byte_fallback"))
    if spm:
        if model.get("ignore_merges"):
            raise ExportError(f"{path}: model.ignore_merges = true with byte_fallback: llama.cpp's SentencePiece "
                              f"tokenizer always merges. {fix}")
        add_space_prefix = _spm_space_prefix(tj, path, fix)
        pre, kind = "default", "llama"
    else:
        if tj.get("normalizer") is not None:
            raise ExportError(f"{path}: normalizer = {_brief(tj['normalizer'])}, expected null: llama.cpp's "
                              f"byte-level BPE does not normalize text, so text the normalizer changes would "
                              f"tokenize differently. {fix}")
        pre, kind, add_space_prefix = _byte_level_pre(tj, path, fix), "gpt2", None
        if (tj.get("decoder") or {}).get("type") != "ByteLevel":
            raise ExportError(f"{path}: decoder = {_brief(tj.get('decoder'))}, expected a ByteLevel decoder "
                              f"(a byte-level vocabulary). {fix}")
    return spm, kind, pre, add_space_prefix


def _token_table(tj: dict, spm: bool, vocab_size: int, path: Path, fix: str):
    """(tokens, token types, unk id, ids of added tokens with rstrip) over ids 0..vocab_size-1 (None
    and UNUSED where the tokenizer has no token); refuses what llama.cpp would match differently."""
    gguf = require_gguf()
    model = tj.get("model") or {}
    byte_of = byte_decoder()
    tokens: list[str | None] = [None] * vocab_size
    types = [int(gguf.TokenType.UNUSED)] * vocab_size

    def place(text: str, i: int, kind_: int) -> None:
        if not 0 <= i < vocab_size:
            raise ExportError(f"{path}: token {text!r} has id {i}, outside the contract's vocab [0, {vocab_size}).")
        tokens[i], types[i] = text, kind_

    for text, i in (model.get("vocab") or {}).items():
        if not spm and any(ch not in byte_of for ch in text):
            raise ExportError(f"{path}: vocab token {text!r} (id {i}) is not a byte-level token. {fix}")
        byte = spm and _BYTE_TOKEN.fullmatch(text)
        place(text, int(i), int(gguf.TokenType.BYTE if byte else gguf.TokenType.NORMAL))
    unk = model.get("unk_token")
    unk_id = model.get("vocab", {}).get(unk) if unk else None
    if unk_id is not None:
        types[unk_id] = int(gguf.TokenType.UNKNOWN)
    rstrip = set()
    for added in tj.get("added_tokens") or []:
        flags = [f for f in ("lstrip", "rstrip", "single_word") if added.get(f)]
        if flags == ["rstrip"]:  # llama.cpp's Phi-3 rule may hold it: checked below
            rstrip.add(int(added["id"]))
        elif flags:
            raise ExportError(f"{path}: added token {added['content']!r} (id {added['id']}) has "
                              f"{', '.join(f + ' = true' for f in flags)}: llama.cpp matches added tokens "
                              f"exactly, without stripping spaces around them. {fix}")
        if spm and not added.get("special") and (" " in added["content"] or SPM_SPACE in added["content"]):
            raise ExportError(f"{path}: added token {added['content']!r} (id {added['id']}) holds a space: HF "
                              f"matches it after spaces become \"▁\", llama.cpp before. {fix}")
        if int(added["id"]) == unk_id:
            continue
        kind_ = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        place(added["content"], int(added["id"]), int(kind_))
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t is not None and seen.setdefault(t, i) != i:
            raise ExportError(f"{path}: ids {seen[t]} and {i} are both spelled {t!r}; llama.cpp looks tokens up by "
                              f"their text, so one of them would be lost. {fix}")
    if spm:
        missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in seen]
        if missing:
            raise ExportError(f"{path}: byte_fallback is on but {len(missing)} byte tokens are missing (first "
                              f"{missing[0]}): llama.cpp falls back to all 256 \"<0xNN>\" tokens, HF to the unk "
                              f"token. {fix}")
    return tokens, types, unk_id, rstrip


def _merge_pairs(model: dict, path: Path, fix: str) -> list[tuple[str, str]]:
    """The merges of tokenizer.json's BPE model as pairs (either spelling: "a b" or ["a", "b"])."""
    pairs: list[tuple[str, str]] = []
    for m in model.get("merges") or []:
        pair = m.split(" ") if isinstance(m, str) else list(m)
        if len(pair) != 2 or any(" " in p for p in pair):
            raise ExportError(f"{path}: merge {m!r} is not a pair of tokens without spaces. {fix}")
        pairs.append((pair[0], pair[1]))
    return pairs


def _check_rstrip(rstrip: set, names: list, types: list, pad_id: int | None, path: Path, fix: str) -> None:
    """Added tokens with rstrip are written only when they are llama.cpp's Phi-3 set (the pad exempt)."""
    if rstrip and (rstrip ^ rstrip_rule(names, types)) - {pad_id}:
        raise ExportError(f"{path}: added tokens {sorted(names[i] for i in rstrip)[:6]} strip the spaces after them "
                          f"(rstrip = true), which llama.cpp does only for Phi-3's set of tokens (every special but "
                          f"<unk>, <s>, <|endoftext|>; expected {sorted(names[i] for i in rstrip_rule(names, types) - {pad_id})[:6]}"
                          f"). {fix}")


def tokenizer_keys(contract: Contract, vocab: GGUFVocab) -> dict:
    """The special-token keys of the GGUF, as {GGUFWriter method suffix: value}, from the contract
    (P1: its ids are the only ones there are) and the vocabulary:

        bos_token_id      the BOS; for a model without one, the EOS (never prepended)
        eos_token_id (end of a document), pad_token_id
        eot_token_id      the end-of-turn token (the contract's im_end) where it is not the EOS;
                          llama.cpp stops generating at EOS and at EOT
        unk_token_id      the tokenizer's unk token, where it has one
        add_bos_token     the contract's add_bos: llama.cpp prepends the BOS to a prompt exactly
                          when lmforge starts a document with it; add_eos_token false
        chat_template     the contract's (the model's own for an imported model)
    """
    specials = contract.special_tokens
    # a model without a BOS (Qwen, SmolLM2): the document terminator, never prepended (add_bos_token
    # false), rather than llama.cpp's default id for a gpt2 vocabulary (11, a plain token)
    keys: dict = {"bos_token_id": specials["eos"] if specials.get("bos") is None else specials["bos"]}
    for name, key in (("eos", "eos_token_id"), ("im_end", "eot_token_id"), ("pad", "pad_token_id")):
        i = specials.get(name)
        if i is not None and not (name == "im_end" and i == specials.get("eos")):
            keys[key] = i
    if vocab.unk_id is not None:
        keys["unk_token_id"] = vocab.unk_id
    keys["add_bos_token"] = contract.add_bos
    keys["add_eos_token"] = False
    keys["chat_template"] = contract.chat_template or CHAT_TEMPLATE
    return keys


__all__ = ["GGUFVocab", "GPT2_PATTERN", "LLAMA3_PATTERN", "QWEN2_PATTERN", "SPM_SPACE", "gguf_vocab", "tokenizer_keys"]
