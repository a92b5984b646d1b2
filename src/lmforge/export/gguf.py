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
    tokenizer.ggml.model "gpt2", .pre "qwen2", .tokens, .token_type, .merges (from tokenizer.json)
    tokenizer.ggml.bos/eos/eot/padding_token_id  from contract.json (bos, eos, im_end, pad)
    tokenizer.ggml.add_bos_token true, add_eos_token false; tokenizer.chat_template (ChatML)

Tokenizer. lmforge's tokenizer (Qwen2's split regex as a `Split`, then
`ByteLevel(use_regex=False)`, tokens of at most 32 bytes) is what llama.cpp's `gpt2` BPE
with pre-tokenizer `qwen2` computes, so the vocabulary and merges are copied as they are.
Anything else (another pre-tokenizer, a normalizer, byte fallback, `ignore_merges`, a token
longer than 32 bytes) is refused with an `ExportError`: llama.cpp would load the file and
tokenize differently. Every special token is CONTROL (so plain text that spells one stays
plain text unless the runtime parses specials, as lmforge's data path does); an id the
tokenizer leaves unused (a gap) becomes an UNUSED placeholder "[PAD{id}]".

BOS. `add_bos_token` is true: lmforge's completion (`lmforge generate`, every pretraining
document) starts with <|bos|>, and llama.cpp prepends it to a prompt the same way. lmforge's
chat rendering (`Tokenizer.render_chat`) has no <|bos|>; llama.cpp's chat mode prepends one
before the first <|im_start|> (one extra token at the start of the context).

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

Rotary layout. lmforge's `apply_rope` is the half-split ("rotate_half") layout of HF Llama.
llama.cpp's `llama` architecture rotates adjacent pairs (ROPE_TYPE_NORM), so the rows of
Q and K are permuted within each head exactly as `LlamaModel.permute` in
convert_hf_to_gguf.py does (rows [0..hd/2) and [hd/2..hd) interleaved). The `qwen3`
architecture uses the half-split layout itself (ROPE_TYPE_NEOX): no permutation there.

Model options beyond Llama. `model.qk_norm = true` (RMSNorm over each head of q and k
before RoPE, one weight of head_dim per layer) maps to llama.cpp's `qwen3` architecture,
which is Llama plus exactly that. Any other model option with a non-default value, or any
weight this mapping does not know, is refused with an `ExportError` naming it: never a file
that loads and computes something else.

Weights: "float32", "float16", "bfloat16", or "q8_0" (`gguf.quants`; 2-D weights whose rows are
a multiple of 32 long, others fall back to float16 as llama.cpp's converter does). Norm weights
stay float32 in every case.

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
from lmforge.export.options import EXPORT_DTYPES, ExportError, check_export_options
from lmforge.fileio import check_user_file, user_file
from lmforge.loading import load_checkpoint
from lmforge.model.io import model_state
from lmforge.tokenizer import CHAT_TEMPLATE, MAX_TOKEN_BYTES, SPLIT_PATTERN, TOKENIZER_FILE, byte_decoder

GGUF_DTYPES = EXPORT_DTYPES["gguf"]

#: Model options lmforge's Llama mapping knows; any other field must sit at its default.
_LLAMA_FIELDS = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "norm_eps", "rope_theta",
                 "max_seq_len", "tie_embeddings", "attention", "qk_norm"}


def require_gguf():
    """The `gguf` package (maintained with llama.cpp).

    Raises:
        LmforgeError: gguf is not installed (`errors.require_package`).
    """
    return require_package("gguf", "gguf", "GGUF export")


# -- tokenizer ---------------------------------------------------------------------------
@dataclass
class GGUFVocab:
    """The tokenizer as llama.cpp's `gpt2` BPE reads it.

    tokens: one string per id, 0..vocab_size-1 (byte-level spellings, e.g. "Ġthe").
    token_types: gguf.TokenType per id (NORMAL, CONTROL for special tokens, USER_DEFINED for
        other added tokens, UNUSED for ids the tokenizer never produces).
    merges: "left right" per merge rule, in rank order.
    """

    tokens: list[str]
    token_types: list[int]
    merges: list[str]


def _expected_pre_tokenizer() -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": SPLIT_PATTERN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}


def _pre_tokenizer_matches(pre) -> bool:
    want = _expected_pre_tokenizer()
    if not isinstance(pre, dict) or pre.get("type") != "Sequence":
        return False
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return False
    for got, exp in zip(steps, want["pretokenizers"]):
        if any(got.get(k) != v for k, v in exp.items()):
            return False
    return True


def gguf_vocab(tokenizer_json: str | Path, vocab_size: int) -> GGUFVocab:
    """Read `tokenizer.json` and check that llama.cpp's gpt2 BPE with pre-tokenizer `qwen2`
    tokenizes exactly as it does.

    Args:
        tokenizer_json: the checkpoint's tokenizer.json.
        vocab_size: the contract's vocab_size (ids 0..vocab_size-1).
    Raises:
        ExportError: another tokenizer model or pre-tokenizer, a normalizer, byte fallback,
            ignore_merges, a token longer than 32 bytes, or ids outside [0, vocab_size).
    """
    gguf = require_gguf()
    path = Path(tokenizer_json)
    try:
        tj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: cannot read it as JSON ({exc}).") from None
    fix = ("llama.cpp's `qwen2` pre-tokenizer would split text differently, so the GGUF would "
           "tokenize differently from lmforge. Export this checkpoint with --format hf, or train the "
           "tokenizer with `lmforge train-tokenizer` (lmforge's Qwen2-style byte-level BPE).")
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise ExportError(f"{path}: model.type = {model.get('type')!r}, expected \"BPE\". {fix}")
    for key, want in (("byte_fallback", False), ("ignore_merges", False), ("dropout", None),
                      ("continuing_subword_prefix", None), ("end_of_word_suffix", None)):
        value = model.get(key)
        if not (value == want or (value is None and want is False) or (value == "" and want is None)):
            raise ExportError(f"{path}: model.{key} = {value!r}, expected {want!r}. {fix}")
    if tj.get("normalizer") is not None:
        raise ExportError(f"{path}: normalizer = {json.dumps(tj['normalizer'])[:200]}, expected null. {fix}")
    pre = tj.get("pre_tokenizer")
    if not _pre_tokenizer_matches(pre):
        raise ExportError(
            f"{path}: pre_tokenizer = {json.dumps(pre)[:300]}; expected {json.dumps(_expected_pre_tokenizer())} "
            f"(Qwen2's split regex, then ByteLevel without its own regex). {fix}"
        )
    if (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise ExportError(f"{path}: decoder = {json.dumps(tj.get('decoder'))[:200]}, expected a ByteLevel decoder. {fix}")

    byte_of = byte_decoder()
    tokens: list[str | None] = [None] * vocab_size
    types = [int(gguf.TokenType.UNUSED)] * vocab_size

    def place(text: str, i: int, kind: int) -> None:
        if not 0 <= i < vocab_size:
            raise ExportError(f"{path}: token {text!r} has id {i}, outside the contract's vocab [0, {vocab_size}).")
        tokens[i], types[i] = text, kind

    for text, i in (model.get("vocab") or {}).items():
        if any(ch not in byte_of for ch in text):
            raise ExportError(f"{path}: vocab token {text!r} (id {i}) is not a byte-level token. {fix}")
        if len(text) > MAX_TOKEN_BYTES:  # one byte-level char = one byte
            raise ExportError(
                f"{path}: token {text!r} (id {i}) is {len(text)} bytes long; at most {MAX_TOKEN_BYTES} bytes are "
                f"allowed (lmforge trains with max_token_length={MAX_TOKEN_BYTES} so that llama.cpp detokenizes "
                f"and tokenizes it as HF does). Re-train the tokenizer with `lmforge train-tokenizer`."
            )
        place(text, int(i), int(gguf.TokenType.NORMAL))
    for added in tj.get("added_tokens") or []:
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        place(added["content"], int(added["id"]), int(kind))
    names = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]

    merges = []
    for m in model.get("merges") or []:
        pair = m.split(" ") if isinstance(m, str) else list(m)
        if len(pair) != 2 or any(" " in p for p in pair):
            raise ExportError(f"{path}: merge {m!r} is not a pair of byte-level tokens. {fix}")
        merges.append(f"{pair[0]} {pair[1]}")
    return GGUFVocab(names, types, merges)


# -- model ---------------------------------------------------------------------------------
def gguf_arch(model: ModelConfig) -> str:
    """"llama", or "qwen3" when model.qk_norm is on (llama.cpp's Llama-with-QK-norm).

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
    return "qwen3" if getattr(model, "qk_norm", False) else "llama"


def _permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """(n_heads*hd, dim) half-split rows -> interleaved rows per head (llama.cpp ROPE_TYPE_NORM);
    `LlamaModel.permute` in convert_hf_to_gguf.py."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(state: dict[str, torch.Tensor], model: ModelConfig, vocab_size: int,
                 arch: str) -> list[tuple[str, np.ndarray]]:
    """lmforge weights -> [(GGUF tensor name, float32 array)], in llama.cpp's order.

    Args:
        state: lmforge weights (`model_state`: a tied output weight is absent); embedding and
            output rows = the padded model vocab (sliced to `vocab_size` here).
        model: the model config (head counts for the rotary permutation, tie_embeddings).
        arch: "llama" (Q/K rows permuted) or "qwen3" (half-split RoPE kept; q/k norms mapped).
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
        gname = gguf.TENSOR_NAMES[kind].format(bid=bid) + ".weight"
        out.append((gname, np.ascontiguousarray(a)))
    names = {n for n, _ in out}
    need = ["token_embd.weight", "output_norm.weight"] + ([] if model.tie_embeddings else ["output.weight"])
    for missing in [n for n in need if n not in names]:
        raise ExportError(f"the checkpoint has no weight for GGUF tensor {missing!r}; the checkpoint is incomplete.")
    return out


def _encode(gguf, array: np.ndarray, name: str, dtype: str) -> tuple[np.ndarray, object]:
    """(data, raw_dtype or None) for one tensor in the requested `dtype` (norms: float32)."""
    Q = gguf.GGMLQuantizationType
    if array.ndim == 1 or dtype == "float32":
        return array.astype(np.float32), None
    if dtype == "float16":
        return array.astype(np.float16), None
    if dtype == "bfloat16":
        return gguf.quants.quantize(array, Q.BF16), Q.BF16
    # q8_0: blocks of 32 along each row; a row of another length stays float16 (as the converter does)
    if array.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0:
        return gguf.quants.quantize(array, Q.Q8_0), Q.Q8_0
    return array.astype(np.float16), None


def write_gguf(out: str | Path, model: ModelConfig, contract: Contract, state: dict[str, torch.Tensor],
               tokenizer_json: str | Path, dtype: str = "float32", name: str = "lmforge") -> Path:
    """Write the GGUF file `out` (directly; `export_gguf` adds the temp-file-and-rename).

    Args:
        model: the checkpoint's model config; contract: its contract (vocab, special ids).
        state: lmforge weights (see `gguf_tensors`).
        tokenizer_json: the checkpoint's tokenizer.json (checked by `gguf_vocab`).
        dtype: one of GGUF_DTYPES.
    Raises:
        ExportError: see `gguf_arch`, `gguf_vocab`, `gguf_tensors`; an unknown dtype.
    """
    gguf = require_gguf()
    if dtype not in GGUF_DTYPES:
        raise ExportError(f"--dtype {dtype!r}: GGUF export writes one of {', '.join(GGUF_DTYPES)}.")
    arch = gguf_arch(model)
    vocab = gguf_vocab(tokenizer_json, contract.vocab_size)
    tensors = gguf_tensors(state, model, contract.vocab_size, arch)
    file_type = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                 "bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_file_type(int(file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(model.max_seq_len)
    w.add_embedding_length(model.dim)
    w.add_block_count(model.n_layers)
    w.add_feed_forward_length(model.resolved_ffn_dim())
    w.add_head_count(model.n_heads)
    w.add_head_count_kv(model.n_kv_heads)
    w.add_key_length(model.head_dim)
    w.add_value_length(model.head_dim)
    w.add_rope_dimension_count(model.head_dim)
    w.add_rope_freq_base(float(model.rope_theta))
    w.add_layer_norm_rms_eps(float(model.norm_eps))
    w.add_vocab_size(contract.vocab_size)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(contract.bos_id)
    w.add_eos_token_id(contract.eos_id)
    w.add_eot_token_id(contract.im_end_id)
    w.add_pad_token_id(contract.pad_id)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(contract.chat_template or CHAT_TEMPLATE)

    for tname, array in tensors:
        data, raw = _encode(gguf, array, tname, dtype)
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
                   name=path.parent.name or "lmforge")
    return out


__all__ = ["GGUF_DTYPES", "GGUFVocab", "export_gguf", "gguf_arch", "gguf_tensors", "gguf_vocab", "require_gguf",
           "write_gguf"]
