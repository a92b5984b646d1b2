"""What Gemma 2 and Gemma 3 share at lmforge's edges (their records are `gemma2.py` and
`gemma3.py`): Google's chat template, the config.json keys both write and read (GeGLU, the
embedding scale sqrt(hidden_size), `query_pre_attn_scalar`, per-layer `layer_types`, the
soft-caps), and the config.json of a GGUF file of llama.cpp's gemma2/gemma3, in which llama.cpp's
runtime decides the layer pattern, the query scale and the soft-caps (`LlamaCppArch`)."""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract
from lmforge.export.families.record import HfIn
from lmforge.export.families.shared import GELU_TANH, HF_LAYER_TYPES, common_config
from lmforge.export.options import ExportError

#: Gemma's chat template (the one Google ships with Gemma 2/3 instruction models, text only): a
#: BOS, the system message folded into the first user turn, the assistant's role named "model",
#: each turn closed by <end_of_turn>.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
END_OF_TURN = "<end_of_turn>"
#: config.json's activation key and value, and what lmforge's Gemma MLP is
ACTIVATION = ("hidden_activation", GELU_TANH, "GeGLU (GELU, tanh approximation)")
#: transformers' defaults both config classes share
HF_DEFAULTS = dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, tie_word_embeddings=True)


def query_pre_attn_scalar(model: ModelConfig) -> float | int:
    """Gemma's `query_pre_attn_scalar` q with q ** -0.5 = the model's attention scale (an integer
    where one gives the scale exactly, as every Gemma config has; head_dim for the default)."""
    if not model.attn_scale:
        return model.resolved_head_dim()
    q = model.attn_scale ** -2
    return round(q) if round(q) > 0 and round(q) ** -0.5 == model.attn_scale else q


def gemma_config(model: ModelConfig, contract: Contract, dtype: torch.dtype, model_type: str,
                 architecture: str) -> dict:
    """The config.json keys Gemma 2 and Gemma 3 share: head_dim, GeGLU, the attention scale, the
    layer kinds and window, the final soft-cap.

    Raises:
        ExportError: an embedding scale other than sqrt(hidden_size) (what transformers' Gemma
        multiplies by), or RoPE scaling.
    """
    if model.embed_scale != model.dim ** 0.5:
        raise ExportError(f"model.embed_scale = {model.embed_scale!r}: transformers' Gemma multiplies the embeddings "
                          f"by sqrt(hidden_size) = {model.dim ** 0.5!r} (expected that); this model cannot be exported "
                          f"as {architecture}.")
    if model.rope_scaling != "none":
        raise ExportError(f"model.rope_scaling = {model.rope_scaling!r}: lmforge exports Gemma with plain RoPE only "
                          f"(expected \"none\"); this model cannot be exported.")
    kinds = model.layer_types or ["full"] * model.n_layers
    return {
        **common_config(model, contract, dtype, model_type, architecture),
        "head_dim": model.resolved_head_dim(),
        "hidden_activation": GELU_TANH,
        "query_pre_attn_scalar": query_pre_attn_scalar(model),
        # no sliding layer: transformers still builds a sliding mask; a window as long as the context never slides
        "sliding_window": model.sliding_window if "sliding" in kinds else model.max_seq_len,
        "layer_types": [HF_LAYER_TYPES[k] for k in kinds],
        "final_logit_softcapping": model.final_softcap or None,
        "use_bidirectional_attention": False,
    }


def read_scales(hf: HfIn, dim: int, applies_attn_softcap: bool) -> None:
    """Gemma's embedding scale (sqrt(hidden_size)), attention scale (query_pre_attn_scalar ** -0.5)
    and soft-caps into `hf.mech`, as transformers computes them (`applies_attn_softcap` False:
    transformers' Gemma 3 never passes attn_logit_softcapping on; said in one line).

    Raises:
        ExportError: a non-positive query_pre_attn_scalar, a negative soft-cap.
    """
    scalar = hf.number("query_pre_attn_scalar", float)
    if scalar <= 0:
        raise ExportError(f"{hf.where}: query_pre_attn_scalar = {scalar}: expected a positive number.")
    hf.mech["embed_scale"] = dim ** 0.5  # transformers: hidden_size ** 0.5
    hf.mech["attn_scale"] = scalar ** -0.5  # transformers: query_pre_attn_scalar ** -0.5
    hf.keys.update(embed_scale=("hidden_size", dim, "hidden_size ** 0.5"),
                   attn_scale=("query_pre_attn_scalar", hf.get("query_pre_attn_scalar"), "query_pre_attn_scalar ** -0.5"))
    caps = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = hf.get(key)
        caps[key] = 0.0 if value is None else hf.number(key, float)
        if caps[key] < 0:
            raise ExportError(f"{hf.where}: {key} = {value}: expected a positive number or null.")
    if not applies_attn_softcap and caps["attn_logit_softcapping"]:
        hf.say(f"config.json: attn_logit_softcapping = {caps['attn_logit_softcapping']} is not applied by "
               f"transformers' Gemma 3 (its attention never passes it on); imported without an attention soft-cap, "
               f"as transformers computes")
    else:
        hf.mech["attn_softcap"] = caps["attn_logit_softcapping"]
        hf.keys["attn_softcap"] = ("attn_logit_softcapping", hf.get("attn_logit_softcapping"))
    hf.mech["final_softcap"] = caps["final_logit_softcapping"]
    hf.keys["final_softcap"] = ("final_logit_softcapping", hf.get("final_logit_softcapping"))


def gguf_in_config(family, kv: dict, path, real, size, shape: dict, config: dict, theta: float) -> dict:
    """config.json of a GGUF file of llama.cpp's gemma3/gemma2: what llama.cpp computes, whatever
    else the file says (its layer pattern, sliding RoPE base, query scale and soft-caps:
    `Family.llama_cpp`), added to the shared keys in `config` (`theta`: the file's rope.freq_base).

    Raises:
        ExportError: no sliding window where llama.cpp requires one; a sliding RoPE base, an
        attention or final soft-cap llama.cpp does not apply (the file does not say which model it is).
    """
    arch, rt = family.gguf_arch, family.llama_cpp
    n_layers = shape["n_layers"]
    if rt.window_required and not kv.get(f"{arch}.attention.sliding_window"):
        raise ExportError(f"{path}: no {arch}.attention.sliding_window (or 0): every Gemma 3 has sliding layers "
                          f"(expected the window, as llama.cpp's convert_hf_to_gguf.py writes it; older llama.cpp "
                          f"builds refuse such a file too). Re-convert the model with it.")
    window = size("attention.sliding_window", 4096)  # gemma2's default in llama.cpp
    kinds = ["sliding_attention" if s else "full_attention" for s in rt.sliding(n_layers)]
    swa_theta = real("rope.freq_base_swa", None) if f"{arch}.rope.freq_base_swa" in kv else None
    want_swa = rt.rope_theta_sliding or theta
    if swa_theta is not None and swa_theta != want_swa:
        raise ExportError(f"{path}: {arch}.rope.freq_base_swa = {swa_theta!r}: llama.cpp's {arch} rotates the sliding "
                          f"layers with base {want_swa!r} whatever this key says (expected {want_swa!r}), so the file "
                          f"does not say which model it is. Import the model's Hugging Face folder instead.")
    attn_cap = real("attn_logit_softcapping", None, "attn_softcap") if f"{arch}.attn_logit_softcapping" in kv else None
    final_cap = real("final_logit_softcapping", None, "final_softcap") if f"{arch}.final_logit_softcapping" in kv \
        else None
    if not rt.attn_softcap and attn_cap:
        raise ExportError(f"{path}: {arch}.attn_logit_softcapping = {attn_cap!r}: llama.cpp's {arch} never soft-caps "
                          f"attention scores (expected none). Import the model's Hugging Face folder instead.")
    if rt.final_softcap == "without_swa" and final_cap:
        raise ExportError(f"{path}: {arch}.final_logit_softcapping = {final_cap!r}: llama.cpp's {arch} drops the final "
                          f"soft-cap in its graph with sliding layers (expected none). Import the model's Hugging Face "
                          f"folder instead.")
    scale = rt.attn_scale(shape["dim"], shape["n_heads"], n_layers, shape["head_dim"])
    config.update(
        hidden_activation=GELU_TANH,
        # llama.cpp scales queries by 1/sqrt(head_dim) (1/sqrt(dim / heads) at the 27B's depth), never
        # by the model's own query_pre_attn_scalar, which the file does not keep
        query_pre_attn_scalar=round(scale ** -2), sliding_window=window, layer_types=kinds,
        attention_bias=False, use_bidirectional_attention=False,
        final_logit_softcapping=float(final_cap if final_cap is not None else 30.0) if rt.final_softcap == "always"
        else None,
        attn_logit_softcapping=float(attn_cap if attn_cap is not None else 50.0) if rt.attn_softcap else None)
    if rt.rope_theta_sliding:  # per layer type: transformers 5's rope_parameters and older versions' keys
        config.update(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": theta},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": want_swa}},
                      rope_theta=theta, rope_local_base_freq=want_swa)
    else:
        config.update(rope_theta=theta, rope_scaling=None)
    return config


__all__ = ["ACTIVATION", "END_OF_TURN", "GEMMA_CHAT_TEMPLATE", "HF_DEFAULTS", "gemma_config",
           "gguf_in_config", "query_pre_attn_scalar", "read_scales"]
