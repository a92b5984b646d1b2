"""llama.cpp's architectures, as GGUF export and import see them: which `general.architecture` a
model is written as (`gguf_family`, `gguf_arch`), what llama.cpp's runtime hard-codes for each
(`families.LlamaCppArch`, one in each family's record, `families.LLAMA_CPP_ARCHS` by architecture;
`export/gguf_in.py` reads files back through the same records),
the tensor names each may load (`gguf_tensor_names`), and the `gguf` package (`require_gguf`).

Families. Which llama.cpp architecture a model is, its tensor names and storage rules come from
its family record (`export/families/`: `Family.gguf_arch`, `gguf_names`, `gguf_norm_shift`,
`gguf_permute_qk`, `llama_cpp`; `families.family_of` picks the record by the model's mechanisms):

    family (HF model_type)   general.architecture  what llama.cpp adds to Llama
    llama, mistral           llama     Q/K rows permuted; Llama 3.1 RoPE scaling as rope_freqs
    qwen2                    qwen2     q/k/v biases
    qwen3                    qwen3     QK-norm per head
    gemma3_text              gemma3    (1 + w) norms stored as 1 + w, 4 per layer, QK-norm, GeGLU,
                                       embeddings x sqrt(dim), 5 sliding : 1 full layers
    gemma2                   gemma2    the same norms (no QK-norm), alternating sliding layers,
                                       soft-capped attention scores and logits
    olmo2                    olmo2     norms after attention and MLP only, QK-norm over the projection
    smollm3                  smollm3   Q/K rows permuted; no RoPE in every 4th layer
    granite                  granite   Q/K rows permuted; the four scalars as the file's keys
    phi3                     phi3      fused attn_qkv and ffn_up; its sliding window never applied

The tokenizer, by the file's name: llama.cpp strips the whitespace after special tokens exactly when
general.name holds "phi3" / "phi-3" (`rstrip_rule`, `gguf_name`: Phi-3's tokenizer.json says so per
token; GGUF keeps no such flag).

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
"""

from __future__ import annotations

import dataclasses
import math
import re

from lmforge.config import ModelConfig
from lmforge.errors import require_package
from lmforge.export.families import LLAMA_CPP_ARCHS, MECHANISMS, Family, LlamaCppArch, family_of
from lmforge.export.options import ExportError

#: Model options of Llama's shape, which every family shares; the mechanisms (families.MECHANISMS)
#: are the family records' to allow. Any other field must sit at its default.
_LLAMA_FIELDS = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "norm_eps", "rope_theta",
                 "max_seq_len", "tie_embeddings", "attention", "qk_norm", "qkv_bias", "rope_scaling", "rope_factor",
                 "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len",
                 "family"}  # the family export writes (`families.family_of`), not a mechanism


def require_gguf():
    """The `gguf` package (maintained with llama.cpp).

    Raises:
        LmforgeError: gguf is not installed (`errors.require_package`).
    """
    return require_package("gguf", "gguf", "GGUF export")


_FIX = "Export with --format hf (transformers computes it), or change the model."


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _refuse_other_options(model: ModelConfig) -> None:
    """A model option outside Llama's shape and the families' mechanisms, set away from its
    default: no llama.cpp architecture has it. Qwen3's QK-norm with Qwen2's biases, RoPE scaling
    outside llama: no architecture lmforge writes computes them."""
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
                f"export/families/ only, and llama.cpp has no architecture with this option, so the file would "
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


def _check_layers(model: ModelConfig, rt: LlamaCppArch, where: str) -> list[bool]:
    """The model's sliding layers and their RoPE base against what the architecture hard-codes;
    returns which layers slide."""
    sliding = [model.is_sliding(i) for i in range(model.n_layers)]
    want = rt.sliding(model.n_layers)
    if not rt.swa_pattern and any(sliding):
        raise ExportError(
            f"config.toml model.layer_types = {_short(model.layer_types)} with model.sliding_window = "
            f"{model.sliding_window}: {where} has no sliding-window attention{rt.no_swa_note}, so every layer of the "
            f"file would attend to all earlier keys (expected every layer \"full\"). {_FIX}")
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
    return sliding


def _check_scales(model: ModelConfig, rt: LlamaCppArch, where: str) -> None:
    """The attention and embedding scales against the ones the architecture applies (any, where
    the file says them: granite)."""
    if rt.scales_from_file:
        return
    hd = model.resolved_head_dim()
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


def _check_softcaps(model: ModelConfig, rt: LlamaCppArch, where: str, sliding: list[bool]) -> None:
    """The attention and final soft-caps against the ones the architecture applies (always, never,
    or only without sliding layers)."""
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


def gguf_family(model: ModelConfig) -> Family:
    """The family record (`export/families/`) the model is written as, checked against what
    llama.cpp's runtime for its architecture computes (`Family.llama_cpp`, `LLAMA_CPP_ARCHS`).

    The family is the one `model.family` names (the family imported), or else `families.family_of`
    of the model without the fields llama.cpp decides for itself (layer kinds, window, sliding
    RoPE base, soft-caps, NoPE layers); those are then checked here against the architecture,
    each refusal naming the field.

    Raises:
        ExportError: a model option no family carries (named, with its value: `family_of`), or one
        llama.cpp cannot represent: sliding layers other than its hard-coded pattern (or any, for
        an architecture without sliding-window attention: llama, so Mistral, qwen2/3, olmo2); a
        sliding-layer RoPE base other than the one it hard-codes; an attention scale or embedding
        scale other than its own; a soft-cap it does not apply (or lacks one it always applies);
        NoPE layers; RoPE scaling outside llama; an untied head where the architecture has no
        output tensor (gemma2).
    """
    _refuse_other_options(model)
    hd = model.resolved_head_dim()
    plain = dataclasses.replace(  # what llama.cpp decides for itself is checked below, field by field
        model, layer_types=[], sliding_window=0, rope_theta_sliding=0.0, attn_softcap=0.0, final_softcap=0.0,
        head_dim=0 if model.head_dim * model.n_heads == model.dim else model.head_dim,
        attn_scale=0.0 if math.isclose(model.attn_scale, hd ** -0.5, rel_tol=1e-9) else model.attn_scale)
    try:  # NoPE layers pick a family that has them (SmolLM3); elsewhere they are refused below, named
        family = family_of(model if model.family else plain)
    except ExportError:
        if not model.nope_layers or model.family:
            raise
        family = family_of(dataclasses.replace(plain, nope_layers=[]))
    if family.gguf_arch is None or family.gguf_arch not in LLAMA_CPP_ARCHS:
        raise ExportError(f"model family {family.model_type!r} has no llama.cpp architecture lmforge writes. {_FIX}")
    arch, rt = family.gguf_arch, LLAMA_CPP_ARCHS[family.gguf_arch]
    where = f"llama.cpp's {arch} architecture"
    want_nope = rt.nope_layers(model.n_layers)
    if sorted(model.nope_layers) != want_nope:
        raise ExportError(f"config.toml model.nope_layers = {_short(model.nope_layers)}: {where} "
                          + (f"skips RoPE in every {rt.nope_step}th layer, whatever the file says (expected "
                             f"{_short(want_nope)})" if rt.nope_step else
                             "rotates q and k in every layer (only llama.cpp's smollm3 skips RoPE, in every 4th "
                             "layer)") + f", so the file would compute something else. {_FIX}")
    sliding = _check_layers(model, rt, where)
    _check_scales(model, rt, where)
    _check_softcaps(model, rt, where, sliding)
    if model.rope_scaling != "none" and not rt.rope_freqs:
        raise ExportError(f"config.toml model.rope_scaling = {model.rope_scaling!r}: llama.cpp reads Llama 3.1's RoPE "
                          f"scaling (rope_freqs) for its llama architecture only, not {arch}. {_FIX}")
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


#: llama.cpp strips the whitespace after special tokens iff the lowercased general.name holds
#: "phi-3" or "phi3" (llama-vocab.cpp, `llama_vocab::impl::load`: a rule for Phi-3's tokenizer, whose
#: specials have rstrip = true); the GGUF format has no per-token attribute for it.
_PHI3_NAME = re.compile(r"phi-?3", re.IGNORECASE)
#: the tokens that rule leaves alone, and one it strips after even when typed NORMAL
_RSTRIP_EXEMPT, _RSTRIP_ALWAYS = ("<unk>", "<s>", "<|endoftext|>"), "</s>"


def rstrip_rule(tokens: list[str], token_types: list[int]) -> set[int]:
    """The ids llama.cpp's Phi-3 rule strips the spaces after: every CONTROL, USER_DEFINED and UNKNOWN
    token (its `cache_special_tokens`) and "</s>", but "<unk>", "<s>" and "<|endoftext|>"."""
    gguf = require_gguf()
    T = gguf.TokenType
    kinds = (int(T.CONTROL), int(T.USER_DEFINED), int(T.UNKNOWN))
    return {i for i, (t, k) in enumerate(zip(tokens, token_types))
            if t not in _RSTRIP_EXEMPT and (int(k) in kinds or t == _RSTRIP_ALWAYS)}


def rstrip_by_name(name: str) -> bool:
    """Whether llama.cpp applies its Phi-3 rule to a file of general.name `name`."""
    return bool(_PHI3_NAME.search(name or ""))


def gguf_name(name: str, rstrip: bool) -> str:
    """general.name for a file whose tokenizer strips after its specials (`rstrip`) or not, so
    that llama.cpp's name rule agrees: "phi3" added where it strips, "phi-3"/"phi3" written
    "phi 3" where it does not (a run folder named after Phi-3 would otherwise change llama.cpp's
    tokenization)."""
    if rstrip:
        return name if rstrip_by_name(name) else f"{name} (phi3)"
    return _PHI3_NAME.sub(lambda m: m.group(0)[:3] + " 3", name)


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


__all__ = ["gguf_arch", "gguf_family", "gguf_name", "gguf_tensor_names", "require_gguf", "rstrip_by_name", "rstrip_rule"]
