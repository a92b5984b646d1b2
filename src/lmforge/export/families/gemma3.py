"""Gemma 3, text (Gemma3ForCausalLM, model_type gemma3_text; llama.cpp `gemma3`): (1 + w) norms
before and after attention and MLP, QK-norm, GeGLU, sqrt(hidden) embedding scale,
`query_pre_attn_scalar`, sliding and full layers with their own RoPE bases, an optional final
soft-cap. Gemma 3's image-text model (Gemma3ForConditionalGeneration) is refused with the way to
its text model. llama.cpp makes layer il sliding iff il % 6 < 5 and rotates those with base 10000."""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export.families import gemma
from lmforge.export.families.record import Family, HfIn, LlamaCppArch
from lmforge.export.families.shared import GGUF_COMMON, GGUF_QK_NORM, GGUF_SANDWICH, HF_COMMON, HF_QK_NORM, HF_SANDWICH
from lmforge.export.hf_rope_in import gemma3_rope
from lmforge.export.options import ExportError

MODEL_TYPE, ARCHITECTURE = "gemma3_text", "Gemma3ForCausalLM"


def hf_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a Gemma3ForCausalLM (model_type gemma3_text): (1 + w) sandwich norms,
    QK-norm, GeGLU, sqrt(hidden) embedding scale, `query_pre_attn_scalar`, per-layer
    `layer_types`, RoPE per layer type (transformers 5's `rope_parameters`, and older versions'
    `rope_theta` + `rope_local_base_freq`). transformers' Gemma 3 applies no attention soft-cap."""
    sliding_theta = model.rope_theta_sliding or model.rope_theta
    return {
        **gemma.gemma_config(model, contract, dtype, MODEL_TYPE, ARCHITECTURE),
        "attn_logit_softcapping": None,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": model.rope_theta},
                            "sliding_attention": {"rope_type": "default", "rope_theta": sliding_theta}},
        "rope_theta": model.rope_theta,
        "rope_local_base_freq": sliding_theta,
    }


def refuse_image_text(cfg: dict, where: str) -> None:
    """Gemma 3's image-text model (model_type gemma3, Gemma3ForConditionalGeneration) is refused
    with the way to its text model."""
    archs = cfg.get("architectures")
    multimodal = cfg.get("model_type") == "gemma3" or (
        isinstance(archs, list) and "Gemma3ForConditionalGeneration" in archs)
    if multimodal:
        raise ExportError(
            f"{where}: model_type = {cfg.get('model_type')!r}, architectures = {archs}: Gemma 3's image-text model "
            f"(expected model_type \"gemma3_text\", architectures [\"Gemma3ForCausalLM\"]). lmforge imports Gemma 3's "
            f"text model only: import the text model: Gemma3ForCausalLM (a text-only checkpoint such as "
            f"gemma-3-270m or gemma-3-1b, or the text model saved from this one with transformers).")


def layer_kinds(hf: HfIn, n_layers: int) -> list[str]:
    """config.json's layer_types when it has none: transformers' pattern from
    `sliding_window_pattern` (default 6: every 6th layer full), said in one line."""
    key = "sliding_window_pattern" if "sliding_window_pattern" in hf.cfg else "_sliding_window_pattern"
    pattern = hf.number(key, int, 6)
    if pattern < 1:
        raise ExportError(f"{hf.where}: {key} = {pattern}: expected a positive layer count.")
    types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    hf.say(f"config.json: no layer_types; {key} = {pattern} makes layers "
           f"{[i for i, t in enumerate(types) if t == 'full_attention']} full and the others sliding "
           f"(as transformers derives them)")
    return types


def rope_in(hf: HfIn) -> dict:
    """RoPE per layer kind (`hf_rope_in.gemma3_rope`); a sliding base equal to the full layers' (or
    no sliding layer) is stored as 0, "the full layers' base"."""
    rope = gemma3_rope(hf.cfg, hf.where, hf.keys)
    if "sliding" not in hf.mech.get("layer_types", []) or rope["rope_theta_sliding"] == rope["rope_theta"]:
        rope["rope_theta_sliding"] = 0.0
        hf.keys.pop("rope_theta_sliding")
    return rope


FAMILY = Family(
    MODEL_TYPE, ARCHITECTURE, HF_COMMON + HF_SANDWICH + HF_QK_NORM, "gemma3", GGUF_COMMON + GGUF_SANDWICH + GGUF_QK_NORM,
    gguf_norm_shift=1.0,
    llama_cpp=LlamaCppArch(swa_pattern=6, rope_theta_sliding=10000.0, embed_scale_sqrt_dim=True,
                           attn_scale_dim_layers=62, final_softcap="without_swa", window_required=True),
    fixed=dict(norm_offset=1.0, norm_placement="sandwich", qk_norm=True, qk_norm_scope="head", mlp_activation="gelu_tanh",
               qkv_bias=False, attn_softcap=0.0),
    settable=("head_dim", "embed_scale", "attn_scale", "final_softcap", "layer_types", "sliding_window",
              "rope_theta_sliding", "rope_scaling"),
    chat_template=gemma.GEMMA_CHAT_TEMPLATE, end_of_turn=gemma.END_OF_TURN,
    note="(1 + w) norms before and after attention and MLP, QK-norm, GeGLU, scaled embeddings, "
         "sliding layers with their own RoPE base",
    hf_config_out=hf_config,
    hf_defaults={**gemma.HF_DEFAULTS, "max_position_embeddings": 131072, "final_logit_softcapping": None,
                 "attn_logit_softcapping": None},
    hf_activation=gemma.ACTIVATION, hf_sliding_layer_types=True, hf_refuse=refuse_image_text,
    hf_layer_kinds=layer_kinds, hf_rope_in=rope_in,
    hf_mechanisms_in=lambda hf, dim: gemma.read_scales(hf, dim, applies_attn_softcap=False),
    gguf_in_config=gemma.gguf_in_config)
