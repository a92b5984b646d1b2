"""What the family records share: the weight-name tables (lmforge -> Hugging Face, lmforge ->
GGUF) that records combine, and the config.json keys of Llama's shape both ways (`common_config`,
`plain_rope`, the spellings `HF_LAYER_TYPES` and `GELU_TANH`)."""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract

# -- weight names: lmforge -> Hugging Face ------------------------------------------------------
HF_COMMON = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)
HF_QK_NORM = (
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
)
HF_QKV_BIAS = (
    ("layers.{i}.attention.wq.bias", "model.layers.{i}.self_attn.q_proj.bias"),
    ("layers.{i}.attention.wk.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    ("layers.{i}.attention.wv.bias", "model.layers.{i}.self_attn.v_proj.bias"),
)
#: Llama: pre-norms only; `post_attention_layernorm` is the norm before the MLP
HF_PRE = (
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
)
#: Gemma 2/3: four norms a layer; `post_attention_layernorm` is the norm after attention
HF_SANDWICH = (
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention_post_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.pre_feedforward_layernorm.weight"),
    ("layers.{i}.ffn_post_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
)
#: OLMo 2: norms after attention and after the MLP only
HF_POST = (
    ("layers.{i}.attention_post_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.ffn_post_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
)

# -- weight names: lmforge -> GGUF (gguf-py's TENSOR_NAMES) -----------------------------------
GGUF_COMMON = (
    ("tok_embeddings.weight", "token_embd.weight"),
    ("layers.{i}.attention.wq.weight", "blk.{i}.attn_q.weight"),
    ("layers.{i}.attention.wk.weight", "blk.{i}.attn_k.weight"),
    ("layers.{i}.attention.wv.weight", "blk.{i}.attn_v.weight"),
    ("layers.{i}.attention.wo.weight", "blk.{i}.attn_output.weight"),
    ("layers.{i}.feed_forward.w1.weight", "blk.{i}.ffn_gate.weight"),
    ("layers.{i}.feed_forward.w3.weight", "blk.{i}.ffn_up.weight"),
    ("layers.{i}.feed_forward.w2.weight", "blk.{i}.ffn_down.weight"),
    ("norm.weight", "output_norm.weight"),
    ("output.weight", "output.weight"),
)
GGUF_QK_NORM = (
    ("layers.{i}.attention.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    ("layers.{i}.attention.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
)
GGUF_QKV_BIAS = (
    ("layers.{i}.attention.wq.bias", "blk.{i}.attn_q.bias"),
    ("layers.{i}.attention.wk.bias", "blk.{i}.attn_k.bias"),
    ("layers.{i}.attention.wv.bias", "blk.{i}.attn_v.bias"),
)
GGUF_PRE = (
    ("layers.{i}.attention_norm.weight", "blk.{i}.attn_norm.weight"),
    ("layers.{i}.ffn_norm.weight", "blk.{i}.ffn_norm.weight"),
)
GGUF_SANDWICH = (  # llama.cpp's gemma2/gemma3 (gguf-py MODEL_TENSORS[GEMMA3])
    ("layers.{i}.attention_norm.weight", "blk.{i}.attn_norm.weight"),
    ("layers.{i}.attention_post_norm.weight", "blk.{i}.post_attention_norm.weight"),
    ("layers.{i}.ffn_norm.weight", "blk.{i}.ffn_norm.weight"),
    ("layers.{i}.ffn_post_norm.weight", "blk.{i}.post_ffw_norm.weight"),
)
GGUF_POST = (  # llama.cpp's olmo2
    ("layers.{i}.attention_post_norm.weight", "blk.{i}.post_attention_norm.weight"),
    ("layers.{i}.ffn_post_norm.weight", "blk.{i}.post_ffw_norm.weight"),
)

# -- fused weights (`record.Fused`): joined at export, split at import -----------------------------
def part_rows(model: ModelConfig, part: str) -> int:
    """The output rows of lmforge weight `part` ("layers.{i}.attention.wk.weight", ...) in `model`:
    wq H*hd, wk and wv KV*hd, w1 and w3 ffn_dim."""
    hd, leaf = model.resolved_head_dim(), part.split(".")[-2]
    return {"wq": model.n_heads * hd, "wk": model.n_kv_heads * hd, "wv": model.n_kv_heads * hd,
            "w1": model.resolved_ffn_dim(), "w3": model.resolved_ffn_dim()}[leaf]


def _layers(state: dict, template: str):
    """(layer index, name) of each layer's `template` ("{i}" the layer) present in `state`, in order."""
    i = 0
    while template.replace("{i}", str(i)) in state:
        yield i, template.replace("{i}", str(i))
        i += 1


def fuse(state: dict[str, torch.Tensor], fused: tuple) -> dict[str, torch.Tensor]:
    """lmforge weights -> the same with each `record.Fused` group's parts stacked into its fused name
    (rows in the parts' order: torch.cat along dim 0). No group: `state` itself."""
    if not fused:
        return state
    out = dict(state)
    for group in fused:
        for i, _ in list(_layers(out, group.parts[0])):
            out[group.name.replace("{i}", str(i))] = torch.cat(
                [out.pop(p.replace("{i}", str(i))) for p in group.parts]).contiguous()
    return out


def unfuse(state: dict[str, torch.Tensor], fused: tuple, model: ModelConfig, where: str = "the weights",
           theirs: dict | None = None) -> dict[str, torch.Tensor]:
    """The inverse of `fuse`: each fused weight split into its parts, each part's rows from `model`
    (`part_rows`). `theirs`: lmforge name -> the file's (a family's `hf_names`), for messages.

    Raises:
        ExportError: a fused weight whose rows are not the sum of its parts' (named, with both counts).
    """
    from lmforge.export.options import ExportError

    if not fused:
        return state
    out = dict(state)
    for group in fused:
        rows = [part_rows(model, p) for p in group.parts]
        for i, name in list(_layers(out, group.name)):
            t = out.pop(name)
            if t.dim() != 2 or t.shape[0] != sum(rows):
                name = (theirs or {}).get(group.name, group.name).replace("{i}", str(i))
                raise ExportError(f"{where}: {name} has shape {tuple(t.shape)}; "
                                  f"expected {sum(rows)} rows ({' + '.join(map(str, rows))}, the "
                                  f"{', '.join(p.split('.')[-2] for p in group.parts)} its config describes). The "
                                  f"config and the weights disagree; use the folder transformers saved.")
            for part, piece in zip(group.parts, t.split(rows)):
                out[part.replace("{i}", str(i))] = piece.contiguous()
    return out


# -- config.json: Llama's shape -----------------------------------------------------------------
#: lmforge's layer kinds <-> transformers' `layer_types` entries
HF_LAYER_TYPES = {"full": "full_attention", "sliding": "sliding_attention"}
#: transformers' name of GELU with the tanh approximation (Gemma's `hidden_activation`)
GELU_TANH = "gelu_pytorch_tanh"


def common_config(model: ModelConfig, contract: Contract, dtype: torch.dtype, model_type: str,
                  architecture: str) -> dict:
    """The keys every family's config.json shares (Llama's shape, the tokenizer's ids)."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
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


def plain_rope(model: ModelConfig) -> dict:
    """rope_theta and rope_scaling (null, or Llama 3.1's four numbers), as every transformers
    version reads them."""
    rope_scaling = None
    if model.rope_scaling == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": model.rope_factor,
                        "low_freq_factor": model.rope_low_freq_factor, "high_freq_factor": model.rope_high_freq_factor,
                        "original_max_position_embeddings": model.rope_original_max_seq_len}
    return {"rope_theta": model.rope_theta, "rope_scaling": rope_scaling}


def window_everywhere(model: ModelConfig, architecture: str) -> int | None:
    """config.json's `sliding_window` of a family whose transformers class slides one window in
    every layer or in none (Mistral, Phi-3: a `layer_types` key would make it another class):
    the window, or None (null: full attention).

    Raises:
        ExportError: some layers sliding and some full.
    """
    from lmforge.export.options import ExportError

    kinds = set(model.layer_types)
    if "sliding" in kinds and "full" in kinds:
        raise ExportError(f"model.layer_types = {model.layer_types}: {architecture} slides the window in every "
                          f"layer or in none (expected every entry \"sliding\", or every entry \"full\"); this model "
                          f"cannot be exported.")
    return model.sliding_window if "sliding" in kinds else None


__all__ = ["GELU_TANH", "GGUF_COMMON", "GGUF_POST", "GGUF_PRE", "GGUF_QKV_BIAS", "GGUF_QK_NORM", "GGUF_SANDWICH",
           "HF_COMMON", "HF_LAYER_TYPES", "HF_POST", "HF_PRE", "HF_QKV_BIAS", "HF_QK_NORM", "HF_SANDWICH",
           "common_config", "fuse", "part_rows", "plain_rope", "unfuse",
           "window_everywhere"]
