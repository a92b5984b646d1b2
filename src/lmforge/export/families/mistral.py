"""Mistral (MistralForCausalLM): Llama's layout with a sliding window in every layer (a window at
least the context never slides: full attention). llama.cpp reads its files as `llama`, without
the window (ggml-org/llama.cpp#3377), so a sliding Mistral has no GGUF form."""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export.families.record import LLAMA_SHAPE, Family
from lmforge.export.families.shared import (GGUF_COMMON, GGUF_PRE, HF_COMMON, HF_PRE, common_config, plain_rope,
                                            window_everywhere)

MODEL_TYPE, ARCHITECTURE = "mistral", "MistralForCausalLM"


def hf_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a MistralForCausalLM: Llama's layout with `sliding_window` keys in every
    layer (null: full attention; `shared.window_everywhere`).

    Raises:
        ExportError: some layers sliding and some full.
    """
    return {**common_config(model, contract, dtype, MODEL_TYPE, ARCHITECTURE), "head_dim": model.resolved_head_dim(),
            "hidden_act": "silu", **plain_rope(model), "sliding_window": window_everywhere(model, ARCHITECTURE)}


FAMILY = Family(
    MODEL_TYPE, ARCHITECTURE, HF_COMMON + HF_PRE, "llama", GGUF_COMMON + GGUF_PRE, gguf_permute_qk=True,
    fixed={**LLAMA_SHAPE, "qk_norm": False}, settable=("layer_types", "sliding_window", "rope_scaling"),
    note="Llama's layout with a sliding window in every layer",
    hf_config_out=hf_config, hf_defaults=dict(sliding_window=4096, max_position_embeddings=4096 * 32),
    hf_window_everywhere=True)
