"""Llama (LlamaForCausalLM; llama.cpp `llama`): lmforge's own layout, tied or untied head, plain
or Llama 3.1-scaled RoPE. llama.cpp rotates adjacent pairs, so q/k rows are permuted in GGUF,
and reads Llama 3.1's scaling as the `rope_freqs` tensor."""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export.families.record import LLAMA_SHAPE, Family, LlamaCppArch
from lmforge.export.families.shared import GGUF_COMMON, GGUF_PRE, HF_COMMON, HF_PRE, common_config, plain_rope

MODEL_TYPE, ARCHITECTURE = "llama", "LlamaForCausalLM"


def hf_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a LlamaForCausalLM equal to `model` (Llama's layout)."""
    return {**common_config(model, contract, dtype, MODEL_TYPE, ARCHITECTURE), "head_dim": model.resolved_head_dim(),
            "hidden_act": "silu", **plain_rope(model), "mlp_bias": False, "pretraining_tp": 1}


FAMILY = Family(
    MODEL_TYPE, ARCHITECTURE, HF_COMMON + HF_PRE, "llama", GGUF_COMMON + GGUF_PRE, gguf_permute_qk=True,
    llama_cpp=LlamaCppArch(rope_freqs=True,
                           no_swa_note=" (llama.cpp never implemented Mistral's sliding window: ggml-org/llama.cpp#3377)"),
    fixed={**LLAMA_SHAPE, "qk_norm": False}, settable=("rope_scaling",), note="Llama's layout",
    hf_config_out=hf_config, gguf_in_keys={"attention_bias": False, "mlp_bias": False})
