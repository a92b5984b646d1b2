"""Phi-3 (Phi3ForCausalLM; llama.cpp `phi3`): Llama's computation with two weights stored fused —
`qkv_proj` = [q; k; v] and `gate_up_proj` = [gate; up] (the MLP is act(gate) * up of the two
halves) — split at import and joined at export (`Fused`; as torchtune's and llama.cpp's
converters do), and a sliding window in every layer or in none, as Mistral's. Phi-3's own
settings beyond Llama's are refused: partial rotary (Phi-4-mini) and LongRoPE (the 128k models)
by the shared RoPE reading, a head size other than hidden_size / num_attention_heads (llama.cpp's
phi3 slices q at n_embd). llama.cpp rotates NeoX-style halves (no q/k permutation) and disables
Phi-3's sliding window (ggml-org/llama.cpp#13676: it reads the key and attends to every key), so
a sliding Phi-3 has no GGUF form and a file's window is not one llama.cpp applies.

An imported Phi-3 computes as a Llama does; `model.family` (set by import) exports it back as Phi-3."""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export.families.record import LLAMA_SHAPE, Family, Fused, LlamaCppArch
from lmforge.export.families.shared import common_config, plain_rope, window_everywhere

MODEL_TYPE, ARCHITECTURE = "phi3", "Phi3ForCausalLM"

FUSED = (
    Fused("layers.{i}.attention.wqkv.weight",
          ("layers.{i}.attention.wq.weight", "layers.{i}.attention.wk.weight", "layers.{i}.attention.wv.weight")),
    Fused("layers.{i}.feed_forward.w13.weight", ("layers.{i}.feed_forward.w1.weight", "layers.{i}.feed_forward.w3.weight")),
)
HF_NAMES = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention.wqkv.weight", "model.layers.{i}.self_attn.qkv_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.feed_forward.w13.weight", "model.layers.{i}.mlp.gate_up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)
GGUF_NAMES = (  # gguf-py MODEL_TENSORS[PHI3]: attn_qkv, and ffn_up with 2 x ffn rows (no ffn_gate)
    ("tok_embeddings.weight", "token_embd.weight"),
    ("layers.{i}.attention.wqkv.weight", "blk.{i}.attn_qkv.weight"),
    ("layers.{i}.attention.wo.weight", "blk.{i}.attn_output.weight"),
    ("layers.{i}.feed_forward.w13.weight", "blk.{i}.ffn_up.weight"),
    ("layers.{i}.feed_forward.w2.weight", "blk.{i}.ffn_down.weight"),
    ("layers.{i}.attention_norm.weight", "blk.{i}.attn_norm.weight"),
    ("layers.{i}.ffn_norm.weight", "blk.{i}.ffn_norm.weight"),
    ("norm.weight", "output_norm.weight"),
    ("output.weight", "output.weight"),
)
#: Phi-3-mini-4k-instruct's chat template (its tokenizer_config.json), for a folder without one
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


def hf_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a Phi3ForCausalLM: Llama's keys, plain RoPE over whole heads, the window in
    every layer or null (`shared.window_everywhere`), no dropout.

    Raises:
        ExportError: some layers sliding and some full.
    """
    return {**common_config(model, contract, dtype, MODEL_TYPE, ARCHITECTURE), "hidden_act": "silu",
            **plain_rope(model), "sliding_window": window_everywhere(model, ARCHITECTURE),
            "original_max_position_embeddings": model.max_seq_len, "partial_rotary_factor": 1.0,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0}


FAMILY = Family(
    MODEL_TYPE, ARCHITECTURE, HF_NAMES, "phi3", GGUF_NAMES,
    llama_cpp=LlamaCppArch(window_ignored=True, no_swa_note=" (llama.cpp disables Phi-3's sliding window and attends "
                                                            "to every key: ggml-org/llama.cpp#13676)"),
    fixed={**LLAMA_SHAPE, "qk_norm": False}, settable=("layer_types", "sliding_window"),
    chat_template=CHAT_TEMPLATE, end_of_turn="<|end|>",
    note="Llama's computation with fused qkv_proj and gate_up_proj and a window in every layer",
    hf_config_out=hf_config,
    hf_defaults=dict(sliding_window=None, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False),
    hf_window_everywhere=True, gguf_in_keys={"sliding_window": None}, fused=FUSED)
