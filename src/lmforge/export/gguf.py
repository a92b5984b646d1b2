"""GGUF out (`lmforge export --format gguf`): one file that llama.cpp, Ollama and LM Studio run.

The file is written with the `gguf` package (PyPI; maintained inside llama.cpp as gguf-py);
this module only maps lmforge's names, hyper-parameters, tokenizer and tensors onto the keys
and tensor names llama.cpp reads. The mapping follows llama.cpp's own converter,
`convert_hf_to_gguf.py` (classes `TextModel`, `LlamaModel`, `Qwen2Model`/`Qwen3Model`, and
`_set_vocab_gpt2` / `get_vocab_base` for the tokenizer), and the loader in
`src/llama-model.cpp` / `src/llama-vocab.cpp`.

What goes into the file:

    general.architecture       "llama" (or "qwen3" for a model with QK-norm, see below)
    {arch}.context_length      model.max_seq_len
    {arch}.embedding_length    model.dim
    {arch}.block_count         model.n_layers
    {arch}.feed_forward_length model.resolved_ffn_dim()
    {arch}.attention.head_count / head_count_kv / key_length / value_length
    {arch}.rope.dimension_count = head_dim (lmforge rotates the whole head); rope.freq_base = rope_theta
    {arch}.attention.layer_norm_rms_epsilon = norm_eps;  {arch}.vocab_size = the tokenizer's
    tokenizer.ggml.model / .pre   what the tokenizer is (below); .tokens, .token_type, and
                               .merges ("gpt2") or .scores + .add_space_prefix ("llama")
    tokenizer.ggml.bos/eos/padding_token_id  from contract.json; eot_token_id = the end-of-turn
                               token (im_end) where it is not the EOS; unknown_token_id if any
    tokenizer.ggml.add_bos_token  whether documents start with the BOS (the contract); add_eos_token false
    tokenizer.chat_template    the contract's (lmforge's ChatML, or an imported model's own)

Tokenizer: mapped by what tokenizer.json computes, never by its name (`gguf_vocab`):

    byte-level BPE, pre-tokenizer                          tokenizer.ggml.model / .pre
    ByteLevel with GPT-2's regex (GPT-2)                   gpt2 / gpt-2
    Digits(individual) + ByteLevel (SmolLM, SmolLM2)       gpt2 / smollm
    Split(Llama 3's regex) + ByteLevel, ignore_merges      gpt2 / llama-bpe   (Llama 3)
    Split(Llama 3's regex) + ByteLevel, merges always      gpt2 / smaug-bpe
    Split(Qwen2's regex) + ByteLevel (Qwen2, lmforge's)    gpt2 / qwen2
    BPE with byte fallback, "▁" for spaces                 llama / default    (Llama 2, Mistral, TinyLlama)

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

Padded vocabulary (P6). lmforge pads the embedding and output matrices to a multiple of 64
rows; those rows are never inputs or targets. The export slices them off: `token_embd` and
`output` have exactly `contract.vocab_size` rows, so n_vocab in llama.cpp is the tokenizer's
vocab and a padding row can never be sampled.

Tensors (names from `gguf.TENSOR_NAMES`, shapes in PyTorch (rows, cols) order; GGUF stores
them reversed):

    tok_embeddings.weight           token_embd.weight          (vocab, dim)
    layers.{i}.attention_norm       blk.{i}.attn_norm          (dim,)  always float32
    layers.{i}.attention.wq         blk.{i}.attn_q             (n_heads*hd, dim)    rows permuted (llama)
    layers.{i}.attention.wk         blk.{i}.attn_k             (n_kv_heads*hd, dim) rows permuted (llama)
    layers.{i}.attention.wv / wo    blk.{i}.attn_v / attn_output
    layers.{i}.attention.q_norm/k_norm  blk.{i}.attn_q_norm / attn_k_norm  (hd,)  qwen3 only
    layers.{i}.ffn_norm             blk.{i}.ffn_norm           (dim,)  always float32
    layers.{i}.feed_forward.w1/w3/w2  blk.{i}.ffn_gate / ffn_up / ffn_down
    norm.weight                     output_norm.weight         (dim,)  always float32
    output.weight                   output.weight              (vocab, dim); absent when tied
    layers.{i}.attention.wq/wk/wv.bias  blk.{i}.attn_q/k/v.bias  qwen2 only (model.qkv_bias)
    (computed)                      rope_freqs.weight          (head_dim/2,)  Llama 3.1 RoPE scaling only

Rotary layout. lmforge's `apply_rope` is the half-split ("rotate_half") layout of HF Llama.
llama.cpp's `llama` architecture rotates adjacent pairs (ROPE_TYPE_NORM), so the rows of
Q and K are permuted within each head exactly as `LlamaModel.permute` in
convert_hf_to_gguf.py does (rows [0..hd/2) and [hd/2..hd) interleaved). The `qwen3` and
`qwen2` architectures use the half-split layout themselves (ROPE_TYPE_NEOX): no permutation.

Model options beyond Llama. `model.qk_norm = true` (RMSNorm over each head of q and k
before RoPE, one weight of head_dim per layer) maps to llama.cpp's `qwen3` architecture,
which is Llama plus exactly that; `model.qkv_bias = true` (an imported Qwen2) to `qwen2`,
Llama plus q/k/v biases; `model.rope_scaling = "llama3"` (an imported Llama 3.1/3.2) to the
llama architecture's `rope_freqs` tensor. Any other model option with a non-default value, or any
weight this mapping does not know, is refused with an `ExportError` naming it: never a file
that loads and computes something else.

Weights: "float32", "float16", "bfloat16", or "q8_0" (`gguf.quants`; 2-D weights whose rows are
a multiple of 32 long, others fall back to float16 as llama.cpp's converter does). Norm weights
stay float32 in every case. A weight beyond the range of the type it is stored as (float16:
|x| <= 65504; q8_0: its float16 block scale |max| / 127) is refused with its name and the range
(`lmforge.export.options.check_dtype_range`, shared with the HF export), never written as infinity.

The file is written to a unique temporary name beside `out` and renamed into place when
complete: an interrupted export leaves no partial `.gguf`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.errors import require_package
from lmforge.export.options import EXPORT_DTYPES, ExportError, check_dtype_range, check_export_options
from lmforge.export.card import gguf_facts
from lmforge.fileio import check_user_file, loads_json, user_file
from lmforge.loading import load_checkpoint
from lmforge.model.io import model_state
from lmforge.tokenizer import CHAT_TEMPLATE, SPLIT_PATTERN, TOKENIZER_FILE, byte_decoder

GGUF_DTYPES = EXPORT_DTYPES["gguf"]

#: Model options lmforge's Llama mapping knows; any other field must sit at its default.
_LLAMA_FIELDS = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "norm_eps", "rope_theta",
                 "max_seq_len", "tie_embeddings", "attention", "qk_norm", "qkv_bias", "rope_scaling", "rope_factor",
                 "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len"}


def require_gguf():
    """The `gguf` package (maintained with llama.cpp).

    Raises:
        LmforgeError: gguf is not installed (`errors.require_package`).
    """
    return require_package("gguf", "gguf", "GGUF export")


# -- tokenizer ---------------------------------------------------------------------------
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
    """

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    scores: list[float] | None = None
    add_space_prefix: bool | None = None
    unk_id: int | None = None


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
    TinyLlama) -> True; Replace(" ", "▁") alone, or pre-tokenizer Metaspace(prepend_scheme "never",
    split false) -> False.

    Raises:
        ExportError: any other normalizer or pre-tokenizer (Metaspace with "first"/"always" keeps a
        leading space as the only "▁" where llama.cpp adds one; NFKC and others change text).
    """
    norm, pre = tj.get("normalizer"), tj.get("pre_tokenizer")
    steps = norm.get("normalizers") if isinstance(norm, dict) and norm.get("type") == "Sequence" else [norm]
    steps = [s for s in steps or [] if s is not None]
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPM_SPACE}
    prepend = {"type": "Prepend", "prepend": SPM_SPACE}
    if pre is None and steps in ([prepend, replace], [replace]):
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


def gguf_vocab(tokenizer_json: str | Path, vocab_size: int) -> GGUFVocab:
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
    Raises:
        ExportError: anything llama.cpp would tokenize differently, named with what was seen: another
            model type (Unigram, WordPiece), a normalizer, a pre-tokenizer llama.cpp lacks, dropout,
            a subword prefix/suffix, missing byte tokens, added tokens with lstrip/rstrip/single_word,
            two ids with one spelling, ids outside [0, vocab_size).
    """
    gguf = require_gguf()
    path = Path(tokenizer_json)
    try:
        tj = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: cannot read it as JSON ({exc}).") from None
    fix = ("The GGUF would tokenize differently from this checkpoint, so it is not written. Export with "
           "--format hf, or use a tokenizer llama.cpp computes (`lmforge train-tokenizer` makes one).")
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
    for added in tj.get("added_tokens") or []:
        flags = [f for f in ("lstrip", "rstrip", "single_word") if added.get(f)]
        if flags:
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

    pairs: list[tuple[str, str]] = []
    for m in model.get("merges") or []:
        pair = m.split(" ") if isinstance(m, str) else list(m)
        if len(pair) != 2 or any(" " in p for p in pair):
            raise ExportError(f"{path}: merge {m!r} is not a pair of tokens without spaces. {fix}")
        pairs.append((pair[0], pair[1]))
    names = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    if spm:
        scores = _spm_scores(tokens, pairs, path, fix)
        return GGUFVocab(kind, pre, names, types, [], scores, add_space_prefix, unk_id)
    return GGUFVocab(kind, pre, names, types, [f"{a} {b}" for a, b in pairs], unk_id=unk_id)


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


# -- model ---------------------------------------------------------------------------------
def gguf_arch(model: ModelConfig) -> str:
    """"llama"; "qwen3" when model.qk_norm is on (llama.cpp's Llama with QK-norm); "qwen2" when
    model.qkv_bias is on (Llama with q/k/v biases). Llama 3.1 RoPE scaling (model.rope_scaling =
    "llama3") is llama's rope_freqs tensor (`gguf_tensors`).

    Raises:
        ExportError: a model option no llama.cpp architecture computes (named, with its value).
    """
    for f in dataclasses.fields(model):
        if f.name in _LLAMA_FIELDS:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        value = getattr(model, f.name)
        if value != default:
            raise ExportError(
                f"config.toml model.{f.name} = {value!r} (default {default!r}): GGUF export maps Llama "
                f"(and QK-norm as Qwen3) only, and llama.cpp has no architecture with this option, so the "
                f"file would compute something else. Export with --format hf if transformers supports it, "
                f"or train with model.{f.name} = {default!r}."
            )
    qk_norm, qkv_bias = bool(getattr(model, "qk_norm", False)), bool(getattr(model, "qkv_bias", False))
    scaling = getattr(model, "rope_scaling", "none")
    if qk_norm and qkv_bias:
        raise ExportError("config.toml model.qk_norm = true with model.qkv_bias = true: llama.cpp has Qwen3 "
                          "(QK-norm, no biases) and Qwen2 (q/k/v biases, no QK-norm), no architecture with both. "
                          "Export with --format hf.")
    if scaling != "none" and (qk_norm or qkv_bias):
        raise ExportError(f"config.toml model.rope_scaling = {scaling!r} with model.{'qk_norm' if qk_norm else 'qkv_bias'} "
                          f"= true: llama.cpp reads Llama 3.1's RoPE scaling (rope_freqs) for its llama architecture "
                          f"only. Export with --format hf.")
    return "qwen3" if qk_norm else "qwen2" if qkv_bias else "llama"


def _permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """(n_heads*hd, dim) half-split rows -> interleaved rows per head (llama.cpp ROPE_TYPE_NORM);
    `LlamaModel.permute` in convert_hf_to_gguf.py."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(model: ModelConfig) -> np.ndarray:
    """Llama 3.1 RoPE scaling as llama.cpp reads it: `rope_freqs.weight`, (head_dim/2,) float32,
    each rotary frequency's divisor (plain inverse frequency / scaled one, the scaling being
    lmforge.model's `llama3_inv_freq`); `LlamaModel.generate_extra_tensors` in llama.cpp's converter."""
    from lmforge.model.transformer import llama3_inv_freq

    hd = model.resolved_head_dim()
    inv = 1.0 / (model.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    scaled = llama3_inv_freq(inv, model.rope_factor, model.rope_low_freq_factor, model.rope_high_freq_factor,
                             model.rope_original_max_seq_len)
    return (inv / scaled).to(torch.float32).numpy()


def gguf_tensors(state: dict[str, torch.Tensor], model: ModelConfig, vocab_size: int,
                 arch: str) -> list[tuple[str, np.ndarray]]:
    """lmforge weights -> [(GGUF tensor name, float32 array)], in llama.cpp's order.

    Args:
        state: lmforge weights (`model_state`: a tied output weight is absent); embedding and
            output rows = the padded model vocab (sliced to `vocab_size` here).
        model: the model config (head counts for the rotary permutation, tie_embeddings).
        arch: "llama" (Q/K rows permuted; rope_freqs with Llama 3.1 scaling), "qwen3" (half-split
            RoPE kept; q/k norms mapped) or "qwen2" (half-split RoPE kept; q/k/v biases mapped).
    Raises:
        ExportError: a weight with no GGUF counterpart (named), or a missing one.
    """
    gguf = require_gguf()
    T = gguf.MODEL_TENSOR
    per_layer = {
        "attention_norm.weight": T.ATTN_NORM, "attention.wq.weight": T.ATTN_Q, "attention.wk.weight": T.ATTN_K,
        "attention.wv.weight": T.ATTN_V, "attention.wo.weight": T.ATTN_OUT, "ffn_norm.weight": T.FFN_NORM,
        "feed_forward.w1.weight": T.FFN_GATE, "feed_forward.w3.weight": T.FFN_UP, "feed_forward.w2.weight": T.FFN_DOWN,
    }
    if arch == "qwen3":
        per_layer.update({"attention.q_norm.weight": T.ATTN_Q_NORM, "attention.k_norm.weight": T.ATTN_K_NORM})
    if arch == "qwen2":
        per_layer.update({"attention.wq.bias": T.ATTN_Q, "attention.wk.bias": T.ATTN_K, "attention.wv.bias": T.ATTN_V})
    top = {"tok_embeddings.weight": T.TOKEN_EMBD, "norm.weight": T.OUTPUT_NORM, "output.weight": T.OUTPUT}
    layer_re = re.compile(r"^layers\.(\d+)\.(.+)$")
    out = []
    for name, t in state.items():
        if name == "output.weight" and model.tie_embeddings:
            continue
        a = t.detach().to(torch.float32).cpu().numpy()
        m = layer_re.match(name)
        kind = per_layer.get(m.group(2)) if m else top.get(name)
        if kind is None:
            raise ExportError(
                f"weight {name!r} has no GGUF counterpart in architecture {arch!r} (known: "
                f"{', '.join([*top, *('layers.{i}.' + k for k in per_layer)])}). This model has a feature "
                f"llama.cpp's {arch} does not compute; export it with --format hf instead."
            )
        bid = int(m.group(1)) if m else None
        if name in ("tok_embeddings.weight", "output.weight"):
            a = a[:vocab_size]  # the padding rows (P6) are sliced off: n_vocab = the tokenizer's
        if arch == "llama" and kind == T.ATTN_Q:
            a = _permute_rope_rows(a, model.n_heads)
        elif arch == "llama" and kind == T.ATTN_K:
            a = _permute_rope_rows(a, model.n_kv_heads)
        gname = gguf.TENSOR_NAMES[kind].format(bid=bid) + "." + name.rsplit(".", 1)[1]  # .weight or .bias
        out.append((gname, np.ascontiguousarray(a)))
    if getattr(model, "rope_scaling", "none") == "llama3":
        out.append((gguf.TENSOR_NAMES[T.ROPE_FREQS] + ".weight", llama3_rope_factors(model)))
    names = {n for n, _ in out}
    need = ["token_embd.weight", "output_norm.weight"] + ([] if model.tie_embeddings else ["output.weight"])
    for missing in [n for n in need if n not in names]:
        raise ExportError(f"the checkpoint has no weight for GGUF tensor {missing!r}; the checkpoint is incomplete.")
    return out


def _encode(gguf, array: np.ndarray, name: str, dtype: str) -> tuple[np.ndarray, object]:
    """(data, raw_dtype or None) for one tensor in the requested `dtype` (norms: float32).

    Raises:
        ExportError: a value beyond the range of the type it is stored as (`check_dtype_range`):
        never an infinity in the file.
    """
    Q = gguf.GGMLQuantizationType
    if array.ndim == 1 or dtype == "float32":
        return array.astype(np.float32), None
    if dtype == "float16":
        check_dtype_range(name, array, "float16")
        return array.astype(np.float16), None
    if dtype == "bfloat16":
        check_dtype_range(name, array, "bfloat16")
        return gguf.quants.quantize(array, Q.BF16), Q.BF16
    # q8_0: blocks of 32 along each row; a row of another length stays float16 (as the converter does)
    if array.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0:
        check_dtype_range(name, array, "q8_0", note=": each block of 32 values shares a float16 scale |max| / 127")
        return gguf.quants.quantize(array, Q.Q8_0), Q.Q8_0
    check_dtype_range(name, array, "float16", note=f"; with --dtype q8_0 its rows of {array.shape[-1]} values, not a "
                                                   f"multiple of 32, are stored as float16")
    return array.astype(np.float16), None


def write_gguf(out: str | Path, model: ModelConfig, contract: Contract, state: dict[str, torch.Tensor],
               tokenizer_json: str | Path, dtype: str = "float32", name: str = "lmforge",
               facts: dict | None = None) -> Path:
    """Write the GGUF file `out` (directly; `export_gguf` adds the temp-file-and-rename).

    Args:
        model: the checkpoint's model config; contract: its contract (vocab, special ids).
        state: lmforge weights (see `gguf_tensors`).
        tokenizer_json: the checkpoint's tokenizer.json (checked by `gguf_vocab`).
        dtype: one of GGUF_DTYPES.
        facts: what the model card says (`export.card.gguf_facts`): general.description, tags,
            datasets and base model, where known.
    Raises:
        ExportError: see `gguf_arch`, `gguf_vocab`, `gguf_tensors`; an unknown dtype; a weight
            beyond the range of `dtype` (`check_dtype_range`; checked before the file is opened).
    """
    gguf = require_gguf()
    if dtype not in GGUF_DTYPES:
        raise ExportError(f"--dtype {dtype!r}: GGUF export writes one of {', '.join(GGUF_DTYPES)}.")
    arch = gguf_arch(model)
    vocab = gguf_vocab(tokenizer_json, contract.vocab_size)
    tensors = gguf_tensors(state, model, contract.vocab_size, arch)
    file_type = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                 "bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]

    encoded = [(tname, *_encode(gguf, array, tname, dtype)) for tname, array in tensors]  # refused before a write
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    facts = facts or {}
    if facts.get("description"):
        w.add_description(facts["description"])
    if facts.get("tags"):
        w.add_tags(facts["tags"])
    if facts.get("datasets"):
        w.add_dataset_count(len(facts["datasets"]))
        for i, d in enumerate(facts["datasets"]):
            w.add_dataset_name(i, d)
    if facts.get("base_model"):
        w.add_base_model_count(1)
        w.add_base_model_name(0, facts["base_model"])
    w.add_file_type(int(file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(model.max_seq_len)
    w.add_embedding_length(model.dim)
    w.add_block_count(model.n_layers)
    w.add_feed_forward_length(model.resolved_ffn_dim())
    w.add_head_count(model.n_heads)
    w.add_head_count_kv(model.n_kv_heads)
    w.add_key_length(model.resolved_head_dim())
    w.add_value_length(model.resolved_head_dim())
    w.add_rope_dimension_count(model.resolved_head_dim())
    w.add_rope_freq_base(float(model.rope_theta))
    w.add_layer_norm_rms_eps(float(model.norm_eps))
    w.add_vocab_size(contract.vocab_size)

    w.add_tokenizer_model(vocab.model)
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.token_types)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    if vocab.add_space_prefix is not None:
        w.add_add_space_prefix(vocab.add_space_prefix)
    for key, value in tokenizer_keys(contract, vocab).items():
        getattr(w, f"add_{key}")(value)

    for tname, data, raw in encoded:
        w.add_tensor(tname, data, raw_dtype=raw)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    return Path(out)


def export_gguf(checkpoint: str | Path, out: str | Path, dtype: str = "float32", force: bool = False,
                verify: bool = False) -> Path:
    """Write a checkpoint as one GGUF file for llama.cpp (atomically).

    Args:
        checkpoint: a checkpoint folder, or a run folder (its newest checkpoint is used).
        out: the .gguf file to write. An existing file is refused unless `force`.
        dtype: "float32" (default), "float16", "bfloat16" or "q8_0".
        verify: refused (it compares with transformers; GGUF is checked by `make interop`).
    Returns:
        `out`.
    Raises:
        CheckpointError / ContractError: the checkpoint is incomplete or inconsistent.
        ExportError: an option that does not apply (`check_export_options`); `out` exists (without
            `force`) or is a folder; the tokenizer or model has
            something llama.cpp would compute differently (see the module docstring).
    """
    check_export_options("gguf", dtype, verify, force)
    require_gguf()
    out = Path(out)
    check_user_file(out, force)  # a name too long, inside an lmforge output, an existing file without --force
    if out.is_dir():
        raise ExportError(f"--out {out} is a folder; GGUF export writes one file. Give a file name such as {out / 'model.gguf'}.")
    model, tok, cfg, path = load_checkpoint(checkpoint)
    contract = tok.contract
    with user_file(out, force) as tmp:  # the one writer: a unique temporary, renamed when complete
        write_gguf(tmp, model.config, contract, model_state(model), path / TOKENIZER_FILE, dtype,
                   name=path.parent.name or "lmforge", facts=gguf_facts(path))
    return out


__all__ = ["GGUF_DTYPES", "GGUFVocab", "export_gguf", "gguf_arch", "gguf_tensors", "gguf_vocab", "llama3_rope_factors",
           "require_gguf", "tokenizer_keys", "write_gguf"]
