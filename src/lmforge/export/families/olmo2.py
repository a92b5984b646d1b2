"""OLMo 2 (Olmo2ForCausalLM; llama.cpp `olmo2`): norms after attention and after the MLP only,
QK-norm over the whole q and k projections."""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export.families.record import LLAMA_SHAPE, Family, LlamaCppArch
from lmforge.export.families.shared import (GGUF_COMMON, GGUF_POST, GGUF_QK_NORM, HF_COMMON, HF_POST, HF_QK_NORM,
                                            common_config, plain_rope)

MODEL_TYPE, ARCHITECTURE = "olmo2", "Olmo2ForCausalLM"


def hf_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of an Olmo2ForCausalLM: norms after attention and after the MLP only, and
    QK-norm over the whole q and k projections (no head_dim key: hidden_size / heads)."""
    return {**common_config(model, contract, dtype, MODEL_TYPE, ARCHITECTURE), "hidden_act": "silu",
            **plain_rope(model)}


FAMILY = Family(
    MODEL_TYPE, ARCHITECTURE, HF_COMMON + HF_POST + HF_QK_NORM, "olmo2", GGUF_COMMON + GGUF_POST + GGUF_QK_NORM,
    llama_cpp=LlamaCppArch(),  # its sliding window (OLMo 3's, pattern 4) is not OLMo 2's
    fixed={**LLAMA_SHAPE, "norm_placement": "post", "qk_norm": True, "qk_norm_scope": "projection"},
    note="norms after attention and after the MLP only, QK-norm over the whole q and k projections",
    hf_config_out=hf_config, hf_defaults=dict(rms_norm_eps=1e-5), gguf_in_keys={"attention_bias": False})
