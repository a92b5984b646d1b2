"""Granite (GraniteForCausalLM; llama.cpp `granite`): Llama's layout with four scalars — the
embeddings multiplied by `embedding_multiplier`, attention scores scaled by
`attention_multiplier` (instead of 1/sqrt(head_dim)), each sublayer's output multiplied by
`residual_multiplier` before the residual add, the logits divided by `logits_scaling` — as
lmforge's `embed_scale`, `attn_scale`, `residual_scale` and `logit_scale`. llama.cpp reads the four
from the file (`granite.embedding_scale`, `attention.scale`, `residual_scale`, `logit_scale`) and
rotates adjacent pairs, so q/k rows are permuted as Llama's."""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export.families.record import LLAMA_SHAPE, Family, HfIn, LlamaCppArch
from lmforge.export.families.shared import GGUF_COMMON, GGUF_PRE, HF_COMMON, HF_PRE, common_config, plain_rope
from lmforge.export.options import ExportError

MODEL_TYPE, ARCHITECTURE = "granite", "GraniteForCausalLM"
#: config.json key -> (lmforge's ModelConfig field, how the field derives from the key)
SCALARS = {"embedding_multiplier": ("embed_scale", ""), "attention_multiplier": ("attn_scale", ""),
           "residual_multiplier": ("residual_scale", ""), "logits_scaling": ("logit_scale", "")}
#: llama.cpp's key (after `{arch}.`) -> config.json key
GGUF_SCALARS = {"embedding_scale": "embedding_multiplier", "attention.scale": "attention_multiplier",
                "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}


def hf_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a GraniteForCausalLM: Llama's layout and the four scalars (the attention
    multiplier is the scale itself: 1/sqrt(head_dim) written out for lmforge's default)."""
    return {**common_config(model, contract, dtype, MODEL_TYPE, ARCHITECTURE), "hidden_act": "silu",
            **plain_rope(model), "mlp_bias": False, "embedding_multiplier": model.embed_scale,
            "attention_multiplier": model.attn_scale or model.resolved_head_dim() ** -0.5,
            "residual_multiplier": model.residual_scale, "logits_scaling": model.logit_scale}


def scalars_in(hf: HfIn, dim: int) -> None:
    """The four scalars into `hf.mech` (transformers' Granite defaults: 1.0 each; an attention
    multiplier of 1 is a scale of 1, not 1/sqrt(head_dim)).

    Raises:
        ExportError: a scalar that is not a positive number (named).
    """
    for key, (field, how) in SCALARS.items():
        value = hf.number(key, float, 1.0)
        if not value > 0:
            raise ExportError(f"{hf.where}: {key} = {value!r}: expected a positive number (Granite's default: 1.0).")
        hf.mech[field] = value
        hf.keys[field] = (key, hf.get(key, 1.0), how)


def gguf_in_scalars(kv: dict, arch: str, real, head_dim: int) -> dict:
    """The four scalars of a GGUF file of llama.cpp's granite as config.json keys (llama.cpp: an
    absent or 0 one is 1, the attention scale 1/sqrt(head_dim))."""
    out = {}
    for key, hf_key in GGUF_SCALARS.items():
        value = real(key, 0.0) if f"{arch}.{key}" in kv else 0.0
        out[hf_key] = value or (head_dim ** -0.5 if key == "attention.scale" else 1.0)
    return out


FAMILY = Family(
    MODEL_TYPE, ARCHITECTURE, HF_COMMON + HF_PRE, "granite", GGUF_COMMON + GGUF_PRE,
    gguf_permute_qk=True,  # llama.cpp's converter: GraniteModel(LlamaModel), q/k rows permuted as Llama's
    llama_cpp=LlamaCppArch(scales_from_file=True),
    fixed={**{k: v for k, v in LLAMA_SHAPE.items() if k != "embed_scale"}, "qk_norm": False},
    settable=("embed_scale", "attn_scale", "residual_scale", "logit_scale"),
    note="Llama's layout with embedding, attention, residual and logit scalars",
    hf_config_out=hf_config, hf_mechanisms_in=scalars_in,
    gguf_in_keys={"attention_bias": False, "mlp_bias": False}, gguf_in_extra=gguf_in_scalars)
