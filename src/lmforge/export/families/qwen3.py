"""Qwen3 (Qwen3ForCausalLM; llama.cpp `qwen3`): Llama's layout with QK-norm per head."""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export.families.record import LLAMA_SHAPE, Family, LlamaCppArch
from lmforge.export.families.shared import (GGUF_COMMON, GGUF_PRE, GGUF_QK_NORM, HF_COMMON, HF_PRE, HF_QK_NORM,
                                            common_config, plain_rope)

MODEL_TYPE, ARCHITECTURE = "qwen3", "Qwen3ForCausalLM"


def hf_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a Qwen3ForCausalLM equal to a qk_norm `model` (llama.cpp: arch qwen3)."""
    return {**common_config(model, contract, dtype, MODEL_TYPE, ARCHITECTURE), "head_dim": model.resolved_head_dim(),
            "hidden_act": "silu", **plain_rope(model), "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": model.n_layers}


FAMILY = Family(
    MODEL_TYPE, ARCHITECTURE, HF_COMMON + HF_PRE + HF_QK_NORM, "qwen3", GGUF_COMMON + GGUF_PRE + GGUF_QK_NORM,
    llama_cpp=LlamaCppArch(), fixed={**LLAMA_SHAPE, "qk_norm": True, "qk_norm_scope": "head"},
    settable=("rope_scaling",), note="Llama's layout with QK-norm",
    hf_config_out=hf_config, gguf_in_keys={"attention_bias": False})
