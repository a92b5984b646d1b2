"""Gemma 2 (Gemma2ForCausalLM; llama.cpp `gemma2`): Gemma 3's layout without QK-norm, one RoPE
base, soft-capped attention scores and logits, alternating sliding layers. llama.cpp's gemma2 has
no output tensor (the head is always tied) and always soft-caps (50 and 30 when the keys are absent)."""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export.families import gemma
from lmforge.export.families.record import Family, HfIn, LlamaCppArch
from lmforge.export.families.shared import GGUF_COMMON, GGUF_SANDWICH, HF_COMMON, HF_SANDWICH, plain_rope

MODEL_TYPE, ARCHITECTURE = "gemma2", "Gemma2ForCausalLM"


def hf_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a Gemma2ForCausalLM: Gemma 3's layout without QK-norm, one RoPE base,
    soft-capped attention scores (`attn_logit_softcapping`) and logits (null: none)."""
    return {**gemma.gemma_config(model, contract, dtype, MODEL_TYPE, ARCHITECTURE),
            "attn_logit_softcapping": model.attn_softcap or None, **plain_rope(model)}


def layer_kinds(hf: HfIn, n_layers: int) -> list[str]:
    """config.json's layer_types when it has none: transformers' Gemma 2 alternates, sliding first."""
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]


FAMILY = Family(
    MODEL_TYPE, ARCHITECTURE, HF_COMMON + HF_SANDWICH, "gemma2",
    tuple(p for p in GGUF_COMMON if p[0] != "output.weight") + GGUF_SANDWICH,  # llama.cpp: always tied
    gguf_norm_shift=1.0,
    llama_cpp=LlamaCppArch(swa_pattern=2, embed_scale_sqrt_dim=True, attn_scale_dim_layers=46, attn_softcap=True,
                           final_softcap="always"),
    fixed=dict(norm_offset=1.0, norm_placement="sandwich", qk_norm=False, mlp_activation="gelu_tanh", qkv_bias=False),
    settable=("head_dim", "embed_scale", "attn_scale", "attn_softcap", "final_softcap", "layer_types",
              "sliding_window"),
    chat_template=gemma.GEMMA_CHAT_TEMPLATE, end_of_turn=gemma.END_OF_TURN,
    note="(1 + w) norms before and after attention and MLP, GeGLU, scaled embeddings, soft-capped "
         "attention scores and logits, alternating sliding layers",
    hf_config_out=hf_config,
    hf_defaults={**gemma.HF_DEFAULTS, "max_position_embeddings": 8192, "final_logit_softcapping": 30.0,
                 "attn_logit_softcapping": 50.0},
    hf_activation=gemma.ACTIVATION, hf_sliding_layer_types=True, hf_layer_kinds=layer_kinds,
    hf_mechanisms_in=lambda hf, dim: gemma.read_scales(hf, dim, applies_attn_softcap=True),
    gguf_in_config=gemma.gguf_in_config)
