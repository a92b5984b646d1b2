"""GGUF out (`lmforge export --format gguf`): one file that llama.cpp, Ollama and LM Studio run.

The file is written with the `gguf` package (PyPI; maintained inside llama.cpp as gguf-py);
this module only maps lmforge's names, hyper-parameters, tokenizer and tensors onto the keys
and tensor names llama.cpp reads. The mapping follows llama.cpp's own converter,
`convert_hf_to_gguf.py` (classes `TextModel`, `LlamaModel`, `Qwen2Model`/`Qwen3Model`,
`Gemma3Model`/`Gemma2Model`, `Olmo2Model`, and `_set_vocab_gpt2` / `get_vocab_base` for the
tokenizer), and the loader in `src/llama-model.cpp` / `src/llama-vocab.cpp`.

The architecture a model is written as and what llama.cpp hard-codes for it are
`export/llama_cpp.py` (`gguf_family`, `LLAMA_CPP_ARCHS`); the tokenizer's mapping and the
special-token keys are `export/gguf_vocab.py` (`gguf_vocab`, `tokenizer_keys`). This module
writes the file: its keys, its tensors and their storage.

What goes into the file:

    general.architecture       the family's (`llama_cpp.gguf_family`)
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
    tokenizer.ggml.model / .pre   what the tokenizer is (`gguf_vocab`); .tokens, .token_type, and
                               .merges ("gpt2") or .scores + .add_space_prefix ("llama")
    tokenizer.ggml.bos/eos/padding_token_id  from contract.json; eot_token_id = the end-of-turn
                               token (im_end) where it is not the EOS; unknown_token_id if any
    tokenizer.ggml.add_bos_token  whether documents start with the BOS (the contract); add_eos_token false
    tokenizer.chat_template    the contract's (lmforge's ChatML, or an imported model's own)

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

import re
from pathlib import Path

import numpy as np
import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export.options import EXPORT_DTYPES, ExportError, check_dtype_range, check_export_options
from lmforge.export.card import gguf_facts
from lmforge.export.families import FAMILIES, LLAMA_CPP_ARCHS, Family, by_gguf_arch
from lmforge.export.families.shared import fuse
from lmforge.export.gguf_vocab import gguf_vocab, tokenizer_keys
from lmforge.export.llama_cpp import gguf_family, gguf_name, gguf_tensor_names, require_gguf
from lmforge.fileio import check_user_file, user_file
from lmforge.loading import load_checkpoint
from lmforge.model.io import model_state
from lmforge.tokenizer import TOKENIZER_FILE

GGUF_DTYPES = EXPORT_DTYPES["gguf"]


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
    permuted where `Family.gguf_permute_qk` (llama rotates adjacent pairs); a family's fused
    weights (`Family.fused`: Phi-3's attn_qkv, ffn_up) are stacked from lmforge's parts.

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
    for name, t in fuse(state, family.fused).items():  # Phi-3's attn_qkv and ffn_up: parts stacked
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


def _add_model_keys(w, model: ModelConfig, rt, vocab_size: int) -> None:
    """The `{arch}.*` keys of the model: Llama's shape, and what the architecture reads of its own
    (`rt`: the family's `LlamaCppArch`): the window, the sliding RoPE base, soft-caps, Granite's scalars."""
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
    w.add_vocab_size(vocab_size)
    if rt.swa_pattern:  # llama.cpp decides which layers slide (gguf_family checked the model's are those)
        w.add_sliding_window(model.sliding_window)
    if rt.rope_theta_sliding:  # what llama.cpp's converter writes (its runtime hard-codes the same value)
        w.add_rope_freq_base_swa(float(model.rope_theta_sliding or model.rope_theta))
    if model.attn_softcap:
        w.add_attn_logit_softcapping(float(model.attn_softcap))
    if model.final_softcap:
        w.add_final_logit_softcapping(float(model.final_softcap))
    if rt.scales_from_file:  # granite: the four scalars, as llama.cpp's converter writes them
        w.add_embedding_scale(float(model.embed_scale))
        w.add_attention_scale(float(model.attn_scale or model.resolved_head_dim() ** -0.5))
        w.add_residual_scale(float(model.residual_scale))
        w.add_logit_scale(float(model.logit_scale))


def _add_tokenizer_keys(w, vocab, contract: Contract) -> None:
    """The `tokenizer.ggml.*` keys: the vocabulary as llama.cpp reads it (`gguf_vocab`) and the contract's ids."""
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
    vocab = gguf_vocab(tokenizer_json, contract.vocab_size, contract.pad_id)
    tensors = gguf_tensors(state, model, contract.vocab_size, family)
    file_type = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                 "bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]

    encoded = [(tname, *_encode(gguf, array, tname, dtype)) for tname, array in tensors]  # refused before a write
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(gguf_name(name, vocab.rstrip))  # llama.cpp strips after specials by the name (Phi-3's rule)
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
    _add_model_keys(w, model, rt, contract.vocab_size)

    _add_tokenizer_keys(w, vocab, contract)

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


__all__ = ["GGUF_DTYPES", "export_gguf", "gguf_tensors", "llama3_rope_factors", "write_gguf"]
