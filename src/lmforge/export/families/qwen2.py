"""Qwen2 (Qwen2ForCausalLM; llama.cpp `qwen2`): Llama's layout with biases on q, k and v (always:
config.json has no key for them, nor for head_dim)."""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export.families.record import LLAMA_SHAPE, Family, LlamaCppArch
from lmforge.export.families.shared import (GGUF_COMMON, GGUF_PRE, GGUF_QKV_BIAS, HF_COMMON, HF_PRE, HF_QKV_BIAS,
                                            common_config, plain_rope)

MODEL_TYPE, ARCHITECTURE = "qwen2", "Qwen2ForCausalLM"


def hf_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a Qwen2ForCausalLM equal to a qkv_bias `model` (Llama's layout plus
    biases on q, k and v; Qwen2 has no key for them, nor for head_dim)."""
    cfg = {**common_config(model, contract, dtype, MODEL_TYPE, ARCHITECTURE), "hidden_act": "silu",
           **plain_rope(model), "use_sliding_window": False, "sliding_window": None, "max_window_layers": model.n_layers}
    del cfg["attention_bias"]
    return cfg


FAMILY = Family(
    MODEL_TYPE, ARCHITECTURE, HF_COMMON + HF_PRE + HF_QKV_BIAS, "qwen2", GGUF_COMMON + GGUF_PRE + GGUF_QKV_BIAS,
    llama_cpp=LlamaCppArch(), fixed={**LLAMA_SHAPE, "qk_norm": False, "qkv_bias": True}, settable=("rope_scaling",),
    note="Llama's layout with q/k/v biases",
    hf_config_out=hf_config, hf_attention_bias_key=False, gguf_in_keys={"use_sliding_window": False})
