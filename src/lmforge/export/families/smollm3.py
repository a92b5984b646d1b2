"""SmolLM3 (SmolLM3ForCausalLM; llama.cpp `smollm3`): Llama's layout in which some layers skip the
rotary embedding (NoPE; config.json's `no_rope_layers`, 1 = RoPE, 0 = none; by default every
`no_rope_layer_interval`-th layer, 4). llama.cpp's smollm3 hard-codes the NoPE layers as every
4th (il % 4 == 3), so another pattern has no GGUF form."""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export.families.record import LLAMA_SHAPE, Family, HfIn, LlamaCppArch
from lmforge.export.families.shared import GGUF_COMMON, GGUF_PRE, HF_COMMON, HF_PRE, common_config, plain_rope
from lmforge.export.options import ExportError
from lmforge.tokenizer import short_repr

MODEL_TYPE, ARCHITECTURE = "smollm3", "SmolLM3ForCausalLM"


def hf_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a SmolLM3ForCausalLM: Llama's layout with `no_rope_layers` (0 where the
    model's `nope_layers` skip RoPE)."""
    return {**common_config(model, contract, dtype, MODEL_TYPE, ARCHITECTURE), "hidden_act": "silu",
            **plain_rope(model), "mlp_bias": False, "use_sliding_window": False, "sliding_window": None,
            "no_rope_layers": [0 if i in model.nope_layers else 1 for i in range(model.n_layers)],
            "layer_types": ["full_attention"] * model.n_layers}


def nope_layers_in(hf: HfIn, dim: int) -> None:
    """`nope_layers` from config.json's `no_rope_layers` (or, without it, every
    `no_rope_layer_interval`-th layer, as transformers derives them).

    Raises:
        ExportError: no_rope_layers not a list of 0/1 with an entry per layer; an interval under 1.
    """
    n_layers = hf.number("num_hidden_layers", int)
    flags = hf.cfg.get("no_rope_layers")
    if flags is None:
        interval = hf.number("no_rope_layer_interval", int, 4)
        if interval < 1:
            raise ExportError(f"{hf.where}: no_rope_layer_interval = {interval}: expected a positive layer count.")
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not isinstance(flags, list) or len(flags) < n_layers or any(f not in (0, 1) or isinstance(f, float)
                                                                    for f in flags):
        raise ExportError(f"{hf.where}: no_rope_layers = {short_repr(flags)}: expected a list of at least "
                          f"num_hidden_layers = {n_layers} entries, each 1 (the layer rotates q and k) or 0 (NoPE).")
    hf.mech["nope_layers"] = [i for i in range(n_layers) if not flags[i]]


FAMILY = Family(
    MODEL_TYPE, ARCHITECTURE, HF_COMMON + HF_PRE, "smollm3", GGUF_COMMON + GGUF_PRE,
    gguf_permute_qk=True,  # llama.cpp's converter: SmolLM3Model(LlamaModel), q/k rows permuted as Llama's
    llama_cpp=LlamaCppArch(nope_step=4),
    fixed={**LLAMA_SHAPE, "qk_norm": False}, settable=("nope_layers",),
    note="Llama's layout with layers that skip RoPE (NoPE)",
    hf_config_out=hf_config,
    hf_defaults=dict(max_position_embeddings=32768, tie_word_embeddings=True),
    hf_mechanisms_in=nope_layers_in, gguf_in_keys={"attention_bias": False, "mlp_bias": False})
