"""config.json out: the Hugging Face config of a model, in its family's keys (`hf_config`: one
builder per family, `llama_config`, `mistral_config`, `qwen2_config`, `qwen3_config`,
`olmo2_config`, `gemma3_config`, `gemma2_config`). `export/hf.py` writes it beside the weights;
`export/hf_config_in.py` reads one back and shares this module's names for what both directions
spell (`HF_LAYER_TYPES`, `GELU_TANH`, `FAMILIES`).

The family is `families.family_of(model)` (`export/families.py`); each builder writes every key
transformers' config class of the family reads, and refuses a value that class cannot hold.
"""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export import families
from lmforge.export.options import ExportError

#: lmforge's layer kinds <-> transformers' `layer_types` entries
HF_LAYER_TYPES = {"full": "full_attention", "sliding": "sliding_attention"}
#: transformers' name of GELU with the tanh approximation (Gemma's `hidden_activation`)
GELU_TANH = "gelu_pytorch_tanh"


def hf_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """The `config.json` of the Hugging Face model equal to `model` (vocab = the tokenizer's), in
    the family `families.family_of(model)` picks: LlamaForCausalLM, MistralForCausalLM (a window
    sliding in every layer), Qwen2ForCausalLM (q/k/v biases), Qwen3ForCausalLM (QK-norm per
    head), Gemma3ForCausalLM (model_type gemma3_text), Gemma2ForCausalLM, Olmo2ForCausalLM.
    Every key transformers' config class of the family reads is written.

    Raises:
        ExportError: no family carries the model's mechanisms (`family_of`), or its family's
        transformers class cannot hold a value it has (Mistral with some layers full and some
        sliding, a Gemma embedding scale other than sqrt(dim), RoPE scaling on Gemma) — naming
        the field.
    """
    family = families.family_of(model)
    return _CONFIGS[family.model_type](model, contract, dtype)


def _common_config(model: ModelConfig, contract: Contract, dtype: torch.dtype, family: str) -> dict:
    """The keys every family's config.json shares (Llama's shape, the tokenizer's ids)."""
    f = families.FAMILIES[family]
    return {
        "architectures": [f.architecture],
        "model_type": f.model_type,
        "hidden_size": model.dim,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "intermediate_size": model.resolved_ffn_dim(),
        "rms_norm_eps": model.norm_eps,
        "max_position_embeddings": model.max_seq_len,
        "vocab_size": contract.vocab_size,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": contract.bos_id,
        "eos_token_id": contract.eos_id,
        "pad_token_id": contract.pad_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _plain_rope(model: ModelConfig) -> dict:
    """rope_theta and rope_scaling (null, or Llama 3.1's four numbers), as every transformers
    version reads them."""
    rope_scaling = None
    if model.rope_scaling == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": model.rope_factor,
                        "low_freq_factor": model.rope_low_freq_factor, "high_freq_factor": model.rope_high_freq_factor,
                        "original_max_position_embeddings": model.rope_original_max_seq_len}
    return {"rope_theta": model.rope_theta, "rope_scaling": rope_scaling}


def llama_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a LlamaForCausalLM equal to `model` (Llama's layout)."""
    return {**_common_config(model, contract, dtype, "llama"), "head_dim": model.resolved_head_dim(),
            "hidden_act": "silu", **_plain_rope(model), "mlp_bias": False, "pretraining_tp": 1}


def mistral_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a MistralForCausalLM: Llama's layout with `sliding_window` keys in every
    layer (null: full attention). transformers' Mistral has no per-layer choice (a `layer_types`
    key would make it Ministral), so the model's layers must be all sliding or all full.

    Raises:
        ExportError: some layers sliding and some full.
    """
    kinds = set(model.layer_types)
    if "sliding" in kinds and "full" in kinds:
        raise ExportError(f"model.layer_types = {model.layer_types}: MistralForCausalLM slides the window in every "
                          f"layer or in none (expected every entry \"sliding\", or every entry \"full\"); this model "
                          f"cannot be exported.")
    window = model.sliding_window if "sliding" in kinds else None
    return {**_common_config(model, contract, dtype, "mistral"), "head_dim": model.resolved_head_dim(),
            "hidden_act": "silu", **_plain_rope(model), "sliding_window": window}


def qwen3_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a Qwen3ForCausalLM equal to a qk_norm `model` (llama.cpp: arch qwen3)."""
    return {**_common_config(model, contract, dtype, "qwen3"), "head_dim": model.resolved_head_dim(),
            "hidden_act": "silu", **_plain_rope(model), "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": model.n_layers}


def qwen2_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a Qwen2ForCausalLM equal to a qkv_bias `model` (Llama's layout plus
    biases on q, k and v; Qwen2 has no key for them, nor for head_dim)."""
    cfg = {**_common_config(model, contract, dtype, "qwen2"), "hidden_act": "silu", **_plain_rope(model),
           "use_sliding_window": False, "sliding_window": None, "max_window_layers": model.n_layers}
    del cfg["attention_bias"]
    return cfg


def olmo2_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of an Olmo2ForCausalLM: norms after attention and after the MLP only, and
    QK-norm over the whole q and k projections (no head_dim key: hidden_size / heads)."""
    return {**_common_config(model, contract, dtype, "olmo2"), "hidden_act": "silu", **_plain_rope(model)}


def query_pre_attn_scalar(model: ModelConfig) -> float | int:
    """Gemma's `query_pre_attn_scalar` q with q ** -0.5 = the model's attention scale (an integer
    where one gives the scale exactly, as every Gemma config has; head_dim for the default)."""
    if not model.attn_scale:
        return model.resolved_head_dim()
    q = model.attn_scale ** -2
    return round(q) if round(q) > 0 and round(q) ** -0.5 == model.attn_scale else q


def _gemma_common(model: ModelConfig, contract: Contract, dtype: torch.dtype, family: str) -> dict:
    """The keys Gemma 2 and Gemma 3 share: head_dim, GeGLU, the attention scale, the layer kinds
    and window, the final soft-cap.

    Raises:
        ExportError: an embedding scale other than sqrt(hidden_size) (what transformers' Gemma
        multiplies by), or RoPE scaling.
    """
    if model.embed_scale != model.dim ** 0.5:
        raise ExportError(f"model.embed_scale = {model.embed_scale!r}: transformers' Gemma multiplies the embeddings "
                          f"by sqrt(hidden_size) = {model.dim ** 0.5!r} (expected that); this model cannot be exported "
                          f"as {families.FAMILIES[family].architecture}.")
    if model.rope_scaling != "none":
        raise ExportError(f"model.rope_scaling = {model.rope_scaling!r}: lmforge exports Gemma with plain RoPE only "
                          f"(expected \"none\"); this model cannot be exported.")
    kinds = model.layer_types or ["full"] * model.n_layers
    return {
        **_common_config(model, contract, dtype, family),
        "head_dim": model.resolved_head_dim(),
        "hidden_activation": GELU_TANH,
        "query_pre_attn_scalar": query_pre_attn_scalar(model),
        # no sliding layer: transformers still builds a sliding mask; a window as long as the context never slides
        "sliding_window": model.sliding_window if "sliding" in kinds else model.max_seq_len,
        "layer_types": [HF_LAYER_TYPES[k] for k in kinds],
        "final_logit_softcapping": model.final_softcap or None,
        "use_bidirectional_attention": False,
    }


def gemma3_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a Gemma3ForCausalLM (model_type gemma3_text): (1 + w) sandwich norms,
    QK-norm, GeGLU, sqrt(hidden) embedding scale, `query_pre_attn_scalar`, per-layer
    `layer_types`, RoPE per layer type (transformers 5's `rope_parameters`, and older versions'
    `rope_theta` + `rope_local_base_freq`). transformers' Gemma 3 applies no attention soft-cap."""
    sliding_theta = model.rope_theta_sliding or model.rope_theta
    return {
        **_gemma_common(model, contract, dtype, "gemma3_text"),
        "attn_logit_softcapping": None,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": model.rope_theta},
                            "sliding_attention": {"rope_type": "default", "rope_theta": sliding_theta}},
        "rope_theta": model.rope_theta,
        "rope_local_base_freq": sliding_theta,
    }


def gemma2_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a Gemma2ForCausalLM: Gemma 3's layout without QK-norm, one RoPE base,
    soft-capped attention scores (`attn_logit_softcapping`) and logits (null: none)."""
    return {**_gemma_common(model, contract, dtype, "gemma2"), "attn_logit_softcapping": model.attn_softcap or None,
            **_plain_rope(model)}


_CONFIGS = {"llama": llama_config, "mistral": mistral_config, "qwen2": qwen2_config, "qwen3": qwen3_config,
            "gemma3_text": gemma3_config, "gemma2": gemma2_config, "olmo2": olmo2_config}

#: The architectures import-hf reads and export writes: model_type -> architectures[0]
#: (`families.FAMILIES`, one record each).
FAMILIES = {name: f.architecture for name, f in families.FAMILIES.items()}


__all__ = ["FAMILIES", "GELU_TANH", "HF_LAYER_TYPES", "gemma2_config", "gemma3_config", "hf_config", "llama_config",
           "mistral_config", "olmo2_config", "qwen2_config", "qwen3_config", "query_pre_attn_scalar"]
