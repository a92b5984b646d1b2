"""config.json out: the Hugging Face config of a model, in its family's keys (`hf_config`).
`export/hf.py` writes it beside the weights; `export/hf_config_in.py` reads one back.

The family is `families.family_of(model)`; its record's builder (`Family.hf_config_out`, in the
family's module under `export/families/`) writes every key transformers' config class of the
family reads, and refuses a value that class cannot hold.
"""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export import families


def hf_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """The `config.json` of the Hugging Face model equal to `model` (vocab = the tokenizer's), in
    the family `families.family_of(model)` picks (LlamaForCausalLM, MistralForCausalLM,
    Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, Gemma2ForCausalLM, Olmo2ForCausalLM:
    `families.FAMILIES`). Every key transformers' config class of the family reads is written.

    Raises:
        ExportError: no family carries the model's mechanisms (`family_of`), or its family's
        transformers class cannot hold a value it has (Mistral with some layers full and some
        sliding, a Gemma embedding scale other than sqrt(dim), RoPE scaling on Gemma) — naming
        the field.
    """
    family = families.family_of(model)
    return family.hf_config_out(model, contract, dtype)


__all__ = ["hf_config"]
