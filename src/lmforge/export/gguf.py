"""GGUF out (`lmforge export --format gguf`): one file that llama.cpp, Ollama and LM Studio run.

The file is written with the `gguf` package (PyPI; maintained inside llama.cpp as gguf-py);
this module only maps lmforge's names, hyper-parameters, tokenizer and tensors onto the keys
and tensor names llama.cpp reads. The mapping follows llama.cpp's own converter,
`convert_hf_to_gguf.py` (classes `TextModel`, `LlamaModel`, `Qwen2Model`/`Qwen3Model`,
`Gemma3Model`/`Gemma2Model`, `Olmo2Model`, and `_set_vocab_gpt2` / `get_vocab_base` for the
tokenizer), and the loader in `src/llama-model.cpp` / `src/llama-vocab.cpp`.

Families. Which llama.cpp architecture a model is, its tensor names and storage rules come from
its family record (`export/families.py`: `Family.gguf_arch`, `gguf_names`, `gguf_norm_shift`,
`gguf_permute_qk`; `families.family_of` picks the record by the model's mechanisms):

    family (HF model_type)   general.architecture  what llama.cpp adds to Llama
    llama, mistral           llama     Q/K rows permuted; Llama 3.1 RoPE scaling as rope_freqs
    qwen2                    qwen2     q/k/v biases
    qwen3                    qwen3     QK-norm per head
    gemma3_text              gemma3    (1 + w) norms stored as 1 + w, 4 per layer, QK-norm, GeGLU,
                                       embeddings x sqrt(dim), 5 sliding : 1 full layers
    gemma2                   gemma2    the same norms (no QK-norm), alternating sliding layers,
                                       soft-capped attention scores and logits
    olmo2                    olmo2     norms after attention and MLP only, QK-norm over the projection

What llama.cpp's runtime hard-codes for an architecture, whatever the file says, is
`LLAMA_CPP_ARCHS` (read from `llama_model::load_hparams` and the graphs in src/models/): gemma3
makes layer il sliding iff il % 6 < 5 and rotates those with base 10000, scales queries by
1/sqrt(head_dim) (never reading Gemma's query_pre_attn_scalar; 1/sqrt(dim / heads) at the 27B's
62 layers) and embeddings by sqrtf(dim), has no attention soft-cap and drops a final one when
layers slide; gemma2 alternates (il % 2 < 1 slides) with one RoPE base, the same scales, and
always soft-caps scores and logits (50 and 30 when the keys are absent); llama (so Mistral),
qwen2, qwen3 and olmo2 have no sliding-window attention. A model outside what its architecture
computes (other layer kinds, another sliding base, attention scale, embedding scale, a soft-cap
missing or extra, NoPE layers, an untied head for gemma2, which has no output tensor) is refused
by `gguf_family` with an `ExportError` naming the field, its value, what llama.cpp does and what
to do: never a file that loads and computes something else.

What goes into the file:

    general.architecture       the family's (above)
    {arch}.context_length      model.max_seq_len
    {arch}.embedding_length    model.dim
    {arch}.block_count         model.n_layers
    {arch}.feed_forward_length model.resolved_ffn_dim()
    {arch}.attention.head_count / head_count_kv / key_length / value_length
    {arch}.rope.dimension_count = head_dim (lmforge rotates the whole head); rope.freq_base = rope_theta
    {arch}.attention.layer_norm_rms_epsilon = norm_eps;  {arch}.vocab_size = the tokenizer's
    {arch}.attention.sliding_window   model.sliding_window (gemma3, gemma2)
    {arch}.rope.freq_base_swa         the sliding layers' base (gemma3; rope.freq_base is the full layers')
    {arch}.attn_logit_softcapping / final_logit_softcapping   model.attn_softcap / final_softcap (gemma2)
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

Padded vocabulary (P6). lmforge pads the embedding and output matrices to a multiple of 64
rows; those rows are never inputs or targets. The export slices them off: `token_embd` and
`output` have exactly `contract.vocab_size` rows, so n_vocab in llama.cpp is the tokenizer's
vocab and a padding row can never be sampled.

Tensors (names from `gguf.TENSOR_NAMES`, shapes in PyTorch (rows, cols) order; GGUF stores
them reversed):

    tok_embeddings.weight           token_embd.weight          (vocab, dim)
    layers.{i}.attention_norm       blk.{i}.attn_norm          (dim,)  always float32 (not olmo2)
    layers.{i}.attention_post_norm  blk.{i}.post_attention_norm (dim,) gemma3, gemma2, olmo2
    layers.{i}.attention.wq         blk.{i}.attn_q             (n_heads*hd, dim)    rows permuted (llama)
    layers.{i}.attention.wk         blk.{i}.attn_k             (n_kv_heads*hd, dim) rows permuted (llama)
    layers.{i}.attention.wv / wo    blk.{i}.attn_v / attn_output
    layers.{i}.attention.q_norm/k_norm  blk.{i}.attn_q_norm / attn_k_norm  (hd,)  qwen3, gemma3;
                                    (n_heads*hd,) / (n_kv_heads*hd,) olmo2 (over the projection)
    layers.{i}.ffn_norm             blk.{i}.ffn_norm           (dim,)  always float32 (not olmo2)
    layers.{i}.ffn_post_norm        blk.{i}.post_ffw_norm      (dim,)  gemma3, gemma2, olmo2
    layers.{i}.feed_forward.w1/w3/w2  blk.{i}.ffn_gate / ffn_up / ffn_down
    norm.weight                     output_norm.weight         (dim,)  always float32
    output.weight                   output.weight              (vocab, dim); absent when tied (gemma2: always)
    layers.{i}.attention.wq/wk/wv.bias  blk.{i}.attn_q/k/v.bias  qwen2 only (model.qkv_bias)
    (computed)                      rope_freqs.weight          (head_dim/2,)  Llama 3.1 RoPE scaling only

Every name is the family record's (`Family.gguf_names`) and is checked against gguf-py's
MODEL_TENSORS[arch]. Norms (every `*norm.weight`, q/k norms included) are stored + 1 for Gemma
(`Family.gguf_norm_shift`: llama.cpp multiplies by the stored weight, lmforge and transformers by
1 + w; the sum is rounded to float32, as llama.cpp's converter rounds it).

Rotary layout. lmforge's `apply_rope` is the half-split ("rotate_half") layout of HF Llama.
llama.cpp's `llama` architecture rotates adjacent pairs (ROPE_TYPE_NORM), so the rows of
Q and K are permuted within each head exactly as `LlamaModel.permute` in
convert_hf_to_gguf.py does (rows [0..hd/2) and [hd/2..hd) interleaved; `Family.gguf_permute_qk`).
qwen2, qwen3, gemma3, gemma2 and olmo2 use the half-split layout themselves (ROPE_TYPE_NEOX): no
permutation. Any model option no family carries, or any weight the family's names do not know,
is refused with an `ExportError` naming it.

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
import math
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
from lmforge.export.families import FAMILIES, MECHANISMS, Family, by_gguf_arch, family_of
from lmforge.fileio import check_user_file, loads_json, user_file
from lmforge.loading import load_checkpoint
from lmforge.model.io import model_state
from lmforge.tokenizer import CHAT_TEMPLATE, SPLIT_PATTERN, TOKENIZER_FILE, byte_decoder

GGUF_DTYPES = EXPORT_DTYPES["gguf"]

#: Model options of Llama's shape, which every family shares; the mechanisms (families.MECHANISMS)
#: are the family records' to allow. Any other field must sit at its default.
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
@dataclass(frozen=True)
class LlamaCppArch:
    """What llama.cpp's runtime hard-codes for one `general.architecture`, beyond the keys it
    reads (`llama_model::load_hparams` in src/llama-model.cpp, the graphs in src/models/). The
    family records (`export/families.py`) say which architecture a family is and its names;
    this says what that architecture computes, so that export refuses what it cannot hold and
    import (`gguf_in`) writes back what a file computes.

    swa_pattern: `set_swa_pattern(p)`: layer il attends through the sliding window iff
        il % p < p - 1, whatever the file says; 0: no sliding-window attention at all.
    rope_theta_sliding: the sliding layers' RoPE base, hard-coded (gemma3: 10000, whatever
        `rope.freq_base_swa` says); 0: the sliding layers use `rope.freq_base` (or `freq_base_swa`).
    embed_scale_sqrt_dim: token embeddings are multiplied by sqrtf(n_embd) (Gemma).
    attn_scale_dim_layers: the block count at which queries are scaled by 1/sqrt(n_embd / n_head)
        (integer division; Gemma 2 27B: 46, Gemma 3 27B: 62) instead of 1/sqrt(head_dim).
    attn_softcap: scores are always soft-capped (gemma2: `attn_logit_softcapping`, 50 when absent).
    final_softcap: "always" (gemma2: `final_logit_softcapping`, 30 when absent), "without_swa"
        (gemma3: only in its graph without sliding layers), "none".
    rope_freqs: Llama 3.1's RoPE scaling is read as the `rope_freqs` tensor (llama only).
    """

    swa_pattern: int = 0
    rope_theta_sliding: float = 0.0
    embed_scale_sqrt_dim: bool = False
    attn_scale_dim_layers: int = 0
    attn_softcap: bool = False
    final_softcap: str = "none"
    rope_freqs: bool = False

    def sliding(self, n_layers: int) -> list[bool]:
        """Which of `n_layers` layers llama.cpp runs through the sliding window."""
        p = self.swa_pattern
        return [bool(p) and il % p < p - 1 for il in range(n_layers)]

    def attn_scale(self, dim: int, n_heads: int, n_layers: int, head_dim: int) -> float:
        """The scale llama.cpp multiplies queries by (`f_attention_scale`, or 1/sqrt(head_dim))."""
        if self.attn_scale_dim_layers and n_layers == self.attn_scale_dim_layers:
            return (dim // n_heads) ** -0.5
        return head_dim ** -0.5


#: llama.cpp's runtime, by `general.architecture` (every `Family.gguf_arch` has an entry)
LLAMA_CPP_ARCHS: dict[str, LlamaCppArch] = {
    "llama": LlamaCppArch(rope_freqs=True),
    "qwen2": LlamaCppArch(),
    "qwen3": LlamaCppArch(),
    "olmo2": LlamaCppArch(),  # its sliding window (OLMo 3's, pattern 4) is not OLMo 2's
    "gemma3": LlamaCppArch(swa_pattern=6, rope_theta_sliding=10000.0, embed_scale_sqrt_dim=True,
                           attn_scale_dim_layers=62, final_softcap="without_swa"),
    "gemma2": LlamaCppArch(swa_pattern=2, embed_scale_sqrt_dim=True, attn_scale_dim_layers=46, attn_softcap=True,
                           final_softcap="always"),
}

_FIX = "Export with --format hf (transformers computes it), or change the model."


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def gguf_family(model: ModelConfig) -> Family:
    """The family record (`export/families.py`) the model is written as, checked against what
    llama.cpp's runtime for its architecture computes (`LLAMA_CPP_ARCHS`).

    The family is `families.family_of` of the model without the fields llama.cpp decides for
    itself (layer kinds, window, sliding RoPE base, soft-caps, NoPE layers); those are then
    checked here against the architecture, each refusal naming the field.

    Raises:
        ExportError: a model option no family carries (named, with its value: `family_of`), or one
        llama.cpp cannot represent: sliding layers other than its hard-coded pattern (or any, for
        an architecture without sliding-window attention: llama, so Mistral, qwen2/3, olmo2); a
        sliding-layer RoPE base other than the one it hard-codes; an attention scale or embedding
        scale other than its own; a soft-cap it does not apply (or lacks one it always applies);
        NoPE layers; RoPE scaling outside llama; an untied head where the architecture has no
        output tensor (gemma2).
    """
    known = _LLAMA_FIELDS | set(MECHANISMS)
    for f in dataclasses.fields(model):
        if f.name in known:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        value = getattr(model, f.name)
        if value != default:
            raise ExportError(
                f"config.toml model.{f.name} = {value!r} (default {default!r}): GGUF export maps the families of "
                f"export/families.py only, and llama.cpp has no architecture with this option, so the file would "
                f"compute something else. Export with --format hf if transformers supports it, or train with "
                f"model.{f.name} = {default!r}."
            )
    qk_norm, qkv_bias = bool(model.qk_norm), bool(model.qkv_bias)
    scaling = model.rope_scaling
    if qk_norm and qkv_bias:
        raise ExportError("config.toml model.qk_norm = true with model.qkv_bias = true: llama.cpp has Qwen3 "
                          "(QK-norm, no biases) and Qwen2 (q/k/v biases, no QK-norm), no architecture with both. "
                          "Export with --format hf.")
    if scaling != "none" and (qk_norm or qkv_bias):
        raise ExportError(f"config.toml model.rope_scaling = {scaling!r} with model.{'qk_norm' if qk_norm else 'qkv_bias'} "
                          f"= true: llama.cpp reads Llama 3.1's RoPE scaling (rope_freqs) for its llama architecture "
                          f"only. Export with --format hf.")
    if model.nope_layers:
        raise ExportError(f"config.toml model.nope_layers = {_short(model.nope_layers)}: llama.cpp rotates q and k in "
                          f"every layer of the architectures lmforge writes (only its smollm3 skips RoPE, in every 4th "
                          f"layer), so the file would compute something else. {_FIX}")
    hd = model.resolved_head_dim()
    plain = dataclasses.replace(  # what llama.cpp decides for itself is checked below, field by field
        model, layer_types=[], sliding_window=0, rope_theta_sliding=0.0, attn_softcap=0.0, final_softcap=0.0,
        head_dim=0 if model.head_dim * model.n_heads == model.dim else model.head_dim,
        attn_scale=0.0 if math.isclose(model.attn_scale, hd ** -0.5, rel_tol=1e-9) else model.attn_scale)
    family = family_of(plain)
    if family.gguf_arch is None or family.gguf_arch not in LLAMA_CPP_ARCHS:
        raise ExportError(f"model family {family.model_type!r} has no llama.cpp architecture lmforge writes. {_FIX}")
    arch, rt = family.gguf_arch, LLAMA_CPP_ARCHS[family.gguf_arch]
    where = f"llama.cpp's {arch} architecture"

    sliding = [model.is_sliding(i) for i in range(model.n_layers)]
    want = rt.sliding(model.n_layers)
    if not rt.swa_pattern and any(sliding):
        why = (" (llama.cpp never implemented Mistral's sliding window: ggml-org/llama.cpp#3377)"
               if arch == "llama" else "")
        raise ExportError(
            f"config.toml model.layer_types = {_short(model.layer_types)} with model.sliding_window = "
            f"{model.sliding_window}: {where} has no sliding-window attention{why}, so every layer of the file "
            f"would attend to all earlier keys (expected every layer \"full\"). {_FIX}")
    if rt.swa_pattern and sliding != want:
        pattern = ["sliding" if s else "full" for s in want]
        raise ExportError(
            f"config.toml model.layer_types = {_short(model.layer_types or 'every layer full')}: {where} hard-codes "
            f"which layers slide (layer il iff il % {rt.swa_pattern} < {rt.swa_pattern - 1}; expected "
            f"{_short(pattern)}), so the file would attend differently. {_FIX}")
    theta_sliding = model.rope_theta_sliding or model.rope_theta
    if any(sliding) and rt.rope_theta_sliding and theta_sliding != rt.rope_theta_sliding:
        raise ExportError(
            f"config.toml model.rope_theta_sliding = {theta_sliding!r}: {where} rotates the sliding layers with "
            f"base {rt.rope_theta_sliding!r} whatever the file says (expected {rt.rope_theta_sliding!r}). {_FIX}")
    if any(sliding) and not rt.rope_theta_sliding and theta_sliding != model.rope_theta:
        raise ExportError(
            f"config.toml model.rope_theta_sliding = {theta_sliding!r}: {where} has one RoPE base for every layer "
            f"(expected rope_theta = {model.rope_theta!r}, or 0). {_FIX}")
    scale = model.attn_scale or hd ** -0.5
    want_scale = rt.attn_scale(model.dim, model.n_heads, model.n_layers, hd)
    if not math.isclose(scale, want_scale, rel_tol=1e-6):
        raise ExportError(
            f"config.toml model.attn_scale = {model.attn_scale!r} (scores scaled by {scale:.6g}, Gemma's "
            f"query_pre_attn_scalar = {scale ** -2:.6g}): {where} scales them by {want_scale:.6g} "
            f"(1/sqrt({round(want_scale ** -2)})) and never reads query_pre_attn_scalar, so the file would attend "
            f"differently (expected attn_scale = {want_scale:.6g}). {_FIX}")
    want_embed = math.sqrt(model.dim) if rt.embed_scale_sqrt_dim else 1.0
    if not math.isclose(model.embed_scale, want_embed, rel_tol=1e-6):
        raise ExportError(
            f"config.toml model.embed_scale = {model.embed_scale!r}: {where} multiplies the embeddings by "
            f"{want_embed:.6g}{' (sqrt(dim))' if rt.embed_scale_sqrt_dim else ''} (expected that). {_FIX}")
    if rt.attn_softcap and not model.attn_softcap:
        raise ExportError(
            f"config.toml model.attn_softcap = 0: {where} always soft-caps the attention scores (50 when "
            f"attn_logit_softcapping is absent; 0 would divide by zero), so it cannot compute uncapped scores. {_FIX}")
    if not rt.attn_softcap and model.attn_softcap:
        raise ExportError(
            f"config.toml model.attn_softcap = {model.attn_softcap!r}: {where} never soft-caps attention scores "
            f"(llama.cpp's converter asserts attn_logit_softcapping is null for it), so the file would attend "
            f"differently (expected 0). {_FIX}")
    if rt.final_softcap == "always" and not model.final_softcap:
        raise ExportError(
            f"config.toml model.final_softcap = 0: {where} always soft-caps the logits (30 when "
            f"final_logit_softcapping is absent; 0 would divide by zero). {_FIX}")
    if model.final_softcap and (rt.final_softcap == "none" or (rt.final_softcap == "without_swa" and any(sliding))):
        why = "drops it in its graph with sliding layers" if rt.final_softcap == "without_swa" else "never applies one"
        raise ExportError(
            f"config.toml model.final_softcap = {model.final_softcap!r}"
            f"{' with sliding layers' if any(sliding) else ''}: {where} {why}, so the file would give uncapped "
            f"logits (expected 0). {_FIX}")
    if scaling != "none" and not rt.rope_freqs:
        raise ExportError(f"config.toml model.rope_scaling = {scaling!r}: llama.cpp reads Llama 3.1's RoPE scaling "
                          f"(rope_freqs) for its llama architecture only, not {arch}. {_FIX}")
    gguf = require_gguf()
    if not model.tie_embeddings and gguf.MODEL_TENSOR.OUTPUT not in gguf.MODEL_TENSORS[_model_arch(gguf, arch)]:
        raise ExportError(f"config.toml model.tie_embeddings = false: {where} has no output tensor (its head is "
                          f"always token_embd), so an untied head cannot be written (expected true). {_FIX}")
    return family


def gguf_arch(model: ModelConfig) -> str:
    """llama.cpp's `general.architecture` for the model: its family's (`gguf_family`): "llama"
    (Llama, Mistral; Llama 3.1 RoPE scaling as the rope_freqs tensor), "qwen2" (q/k/v biases),
    "qwen3" (QK-norm), "gemma3", "gemma2", "olmo2".

    Raises:
        ExportError: see `gguf_family`.
    """
    return gguf_family(model).gguf_arch  # type: ignore[return-value]


def _model_arch(gguf, arch: str):
    """gguf-py's MODEL_ARCH member named `arch`."""
    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)


def gguf_tensor_names(gguf, arch: str, n_layers: int) -> set[str]:
    """Every tensor name (without .weight/.bias) llama.cpp's `arch` may load, from gguf-py's
    MODEL_TENSORS and TENSOR_NAMES."""
    names = set()
    for kind in gguf.MODEL_TENSORS[_model_arch(gguf, arch)]:
        pattern = gguf.TENSOR_NAMES[kind]
        names.update({pattern.format(bid=i) for i in range(n_layers)} if "{bid}" in pattern else {pattern})
    return names


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
                 arch: str | Family) -> list[tuple[str, np.ndarray]]:
    """lmforge weights -> [(GGUF tensor name, float32 array)], in the order of `state`.

    Names are the family's (`Family.gguf_names`), each checked against gguf-py's
    MODEL_TENSORS[arch]; every `*norm.weight` is stored as w + `Family.gguf_norm_shift` (Gemma:
    llama.cpp's RMSNorm multiplies by the stored weight, transformers' by 1 + w); q/k rows are
    permuted where `Family.gguf_permute_qk` (llama rotates adjacent pairs).

    Args:
        state: lmforge weights (`model_state`: a tied output weight is absent); embedding and
            output rows = the padded model vocab (sliced to `vocab_size` here).
        model: the model config (head counts for the rotary permutation, tie_embeddings).
        arch: the family record, or a llama.cpp architecture name (its first family: "llama",
            "qwen2", "qwen3", "gemma3", "gemma2", "olmo2").
    Raises:
        ExportError: a weight with no GGUF counterpart in the family (named, with the known
            ones), or a missing one.
    """
    gguf = require_gguf()
    family = arch if isinstance(arch, Family) else next(iter(by_gguf_arch(arch)), None)
    if family is None:
        raise ExportError(f"llama.cpp architecture {arch!r}: lmforge writes "
                          f"{', '.join(sorted({f.gguf_arch for f in FAMILIES.values() if f.gguf_arch}))}.")
    arch = family.gguf_arch
    names = dict(family.gguf_names)
    allowed = gguf_tensor_names(gguf, arch, model.n_layers)
    layer_re = re.compile(r"^layers\.(\d+)\.(.+)$")
    out = []
    for name, t in state.items():
        if name == "output.weight" and model.tie_embeddings:
            continue
        m = layer_re.match(name)
        pattern = names.get(f"layers.{{i}}.{m.group(2)}" if m else name)
        gname = pattern.format(i=m.group(1)) if pattern and m else pattern
        if gname is None or gname.rsplit(".", 1)[0] not in allowed:
            known = [n for n, g in names.items() if g.format(i=0).rsplit(".", 1)[0] in allowed]
            raise ExportError(
                f"weight {name!r} has no GGUF counterpart in architecture {arch!r} (known: {', '.join(known)}). "
                f"This model has a feature llama.cpp's {arch} does not compute; export it with --format hf instead."
            )
        a = t.detach().to(torch.float32).cpu().numpy()
        if name in ("tok_embeddings.weight", "output.weight"):
            a = a[:vocab_size]  # the padding rows (P6) are sliced off: n_vocab = the tokenizer's
        if gname.endswith("norm.weight") and family.gguf_norm_shift:
            a = a + np.float32(family.gguf_norm_shift)  # Gemma: llama.cpp multiplies by the stored 1 + w
        if family.gguf_permute_qk and gname.endswith((".attn_q.weight", ".attn_k.weight")):
            a = _permute_rope_rows(a, model.n_heads if ".attn_q." in gname else model.n_kv_heads)
        out.append((gname, np.ascontiguousarray(a)))
    if model.rope_scaling == "llama3":
        out.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_rope_factors(model)))
    written = {n for n, _ in out}
    need = ["token_embd.weight", "output_norm.weight"] + ([] if model.tie_embeddings else ["output.weight"])
    for missing in [n for n in need if n not in written]:
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
    family = gguf_family(model)
    arch, rt = family.gguf_arch, LLAMA_CPP_ARCHS[family.gguf_arch]
    vocab = gguf_vocab(tokenizer_json, contract.vocab_size)
    tensors = gguf_tensors(state, model, contract.vocab_size, family)
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
    if rt.swa_pattern:  # llama.cpp decides which layers slide (gguf_family checked the model's are those)
        w.add_sliding_window(model.sliding_window)
    if rt.rope_theta_sliding:  # what llama.cpp's converter writes (its runtime hard-codes the same value)
        w.add_rope_freq_base_swa(float(model.rope_theta_sliding or model.rope_theta))
    if model.attn_softcap:
        w.add_attn_logit_softcapping(float(model.attn_softcap))
    if model.final_softcap:
        w.add_final_logit_softcapping(float(model.final_softcap))

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


__all__ = ["GGUF_DTYPES", "GGUFVocab", "LLAMA_CPP_ARCHS", "LlamaCppArch", "export_gguf", "gguf_arch", "gguf_family",
           "gguf_tensor_names", "gguf_tensors", "gguf_vocab", "llama3_rope_factors", "require_gguf", "tokenizer_keys",
           "write_gguf"]
