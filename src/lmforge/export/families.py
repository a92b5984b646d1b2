"""The model families lmforge imports and exports, one declarative record each: everything
family-specific lives here, at the edge (the model itself knows only mechanisms: the fields of
`ModelConfig`, never a family's name).

A `Family` says:
- its names on Hugging Face (`model_type`, `architecture`) and in llama.cpp (`gguf_arch`);
- its weight names both ways (`hf_names`, `gguf_names`: lmforge name -> theirs; "{i}" the
  layer). `post_attention_layernorm` is Llama's norm *before* the MLP but Gemma's and OLMo 2's
  norm *after* attention: every name map is the family's own;
- the mechanisms it fixes (`fixed`: ModelConfig field -> value) and those its config.json may
  set (`settable`); `family_of` picks the family of a model by them, both for export and for
  refusing what no family represents;
- llama.cpp's storage rules (`gguf_norm_shift`: Gemma's GGUF norms hold 1 + w; `gguf_permute_qk`:
  the `llama` architecture rotates adjacent pairs, so q/k rows are permuted);
- its chat template and end of turn for a model whose files carry none (the common Gemma 3 270M
  GGUF; a transformers folder saved without one): `chat_template_of` hands them to the tokenizer
  import that `import-hf` and `import-gguf` (through import-hf) share, so both doors give a model the
  same chat format; a family without one gets lmforge's ChatML.

Adding a family is one record here plus its tests (docs/where-changes-go.md); a mechanism no
family has yet is one `ModelConfig` field with its one code site in lmforge/model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmforge.config import ModelConfig
from lmforge.tokenizer import FamilyTemplate

# -- weight names: lmforge -> Hugging Face ------------------------------------------------------
_HF_COMMON = (
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
_HF_QK_NORM = (
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
)
_HF_QKV_BIAS = (
    ("layers.{i}.attention.wq.bias", "model.layers.{i}.self_attn.q_proj.bias"),
    ("layers.{i}.attention.wk.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    ("layers.{i}.attention.wv.bias", "model.layers.{i}.self_attn.v_proj.bias"),
)
#: Llama: pre-norms only; `post_attention_layernorm` is the norm before the MLP
_HF_PRE = (
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
)
#: Gemma 2/3: four norms a layer; `post_attention_layernorm` is the norm after attention
_HF_SANDWICH = (
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention_post_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.pre_feedforward_layernorm.weight"),
    ("layers.{i}.ffn_post_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
)
#: OLMo 2: norms after attention and after the MLP only
_HF_POST = (
    ("layers.{i}.attention_post_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.ffn_post_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
)

# -- weight names: lmforge -> GGUF (gguf-py's TENSOR_NAMES) -----------------------------------
_GGUF_COMMON = (
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
_GGUF_QK_NORM = (
    ("layers.{i}.attention.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    ("layers.{i}.attention.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
)
_GGUF_QKV_BIAS = (
    ("layers.{i}.attention.wq.bias", "blk.{i}.attn_q.bias"),
    ("layers.{i}.attention.wk.bias", "blk.{i}.attn_k.bias"),
    ("layers.{i}.attention.wv.bias", "blk.{i}.attn_v.bias"),
)
_GGUF_PRE = (
    ("layers.{i}.attention_norm.weight", "blk.{i}.attn_norm.weight"),
    ("layers.{i}.ffn_norm.weight", "blk.{i}.ffn_norm.weight"),
)
_GGUF_SANDWICH = (  # llama.cpp's gemma2/gemma3 (gguf-py MODEL_TENSORS[GEMMA3])
    ("layers.{i}.attention_norm.weight", "blk.{i}.attn_norm.weight"),
    ("layers.{i}.attention_post_norm.weight", "blk.{i}.post_attention_norm.weight"),
    ("layers.{i}.ffn_norm.weight", "blk.{i}.ffn_norm.weight"),
    ("layers.{i}.ffn_post_norm.weight", "blk.{i}.post_ffw_norm.weight"),
)
_GGUF_POST = (  # llama.cpp's olmo2
    ("layers.{i}.attention_post_norm.weight", "blk.{i}.post_attention_norm.weight"),
    ("layers.{i}.ffn_post_norm.weight", "blk.{i}.post_ffw_norm.weight"),
)

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


@dataclass(frozen=True)
class Family:
    """One model family at lmforge's edges (see the module docstring)."""

    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0]
    hf_names: tuple[tuple[str, str], ...]  # (lmforge name, HF name), "{i}" = layer index
    gguf_arch: str | None  # general.architecture in llama.cpp; None: no GGUF form
    gguf_names: tuple[tuple[str, str], ...] = ()
    gguf_norm_shift: float = 0.0  # GGUF stores every `*norm.weight` as w + shift (Gemma: 1)
    gguf_permute_qk: bool = False  # llama.cpp's `llama` rotates adjacent pairs: q/k rows permuted
    #: ModelConfig fields every model of the family has, with their values
    fixed: dict = field(default_factory=dict)
    #: ModelConfig fields (beyond the Llama shape) its config.json may set to any allowed value
    settable: tuple[str, ...] = ()
    chat_template: str | None = None  # for a model whose files carry none; None: lmforge's ChatML
    end_of_turn: str | None = None  # the token closing a chat turn, when chat_template is the family's
    note: str = ""  # what the family adds to Llama, for help texts and errors


_LLAMA_SHAPE = dict(norm_offset=0.0, norm_placement="pre", mlp_activation="silu", embed_scale=1.0,
                    attn_softcap=0.0, final_softcap=0.0, qkv_bias=False)

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", _HF_COMMON + _HF_PRE, "llama", _GGUF_COMMON + _GGUF_PRE,
           gguf_permute_qk=True, fixed={**_LLAMA_SHAPE, "qk_norm": False},
           settable=("rope_scaling",), note="Llama's layout"),
    Family("mistral", "MistralForCausalLM", _HF_COMMON + _HF_PRE, "llama", _GGUF_COMMON + _GGUF_PRE,
           gguf_permute_qk=True, fixed={**_LLAMA_SHAPE, "qk_norm": False},
           settable=("layer_types", "sliding_window", "rope_scaling"),
           note="Llama's layout with a sliding window in every layer"),
    Family("qwen2", "Qwen2ForCausalLM", _HF_COMMON + _HF_PRE + _HF_QKV_BIAS, "qwen2",
           _GGUF_COMMON + _GGUF_PRE + _GGUF_QKV_BIAS, fixed={**_LLAMA_SHAPE, "qk_norm": False, "qkv_bias": True},
           settable=("rope_scaling",), note="Llama's layout with q/k/v biases"),
    Family("qwen3", "Qwen3ForCausalLM", _HF_COMMON + _HF_PRE + _HF_QK_NORM, "qwen3",
           _GGUF_COMMON + _GGUF_PRE + _GGUF_QK_NORM,
           fixed={**_LLAMA_SHAPE, "qk_norm": True, "qk_norm_scope": "head"}, settable=("rope_scaling",),
           note="Llama's layout with QK-norm"),
    Family("gemma3_text", "Gemma3ForCausalLM", _HF_COMMON + _HF_SANDWICH + _HF_QK_NORM, "gemma3",
           _GGUF_COMMON + _GGUF_SANDWICH + _GGUF_QK_NORM, gguf_norm_shift=1.0,
           fixed=dict(norm_offset=1.0, norm_placement="sandwich", qk_norm=True, qk_norm_scope="head",
                      mlp_activation="gelu_tanh", qkv_bias=False, attn_softcap=0.0),
           settable=("head_dim", "embed_scale", "attn_scale", "final_softcap", "layer_types", "sliding_window",
                     "rope_theta_sliding", "rope_scaling"),
           chat_template=GEMMA_CHAT_TEMPLATE, end_of_turn="<end_of_turn>",
           note="(1 + w) norms before and after attention and MLP, QK-norm, GeGLU, scaled embeddings, "
                "sliding layers with their own RoPE base"),
    Family("gemma2", "Gemma2ForCausalLM", _HF_COMMON + _HF_SANDWICH, "gemma2",
           tuple(p for p in _GGUF_COMMON if p[0] != "output.weight") + _GGUF_SANDWICH,  # llama.cpp: always tied
           gguf_norm_shift=1.0,
           fixed=dict(norm_offset=1.0, norm_placement="sandwich", qk_norm=False, mlp_activation="gelu_tanh",
                      qkv_bias=False),
           settable=("head_dim", "embed_scale", "attn_scale", "attn_softcap", "final_softcap", "layer_types",
                     "sliding_window"),
           chat_template=GEMMA_CHAT_TEMPLATE, end_of_turn="<end_of_turn>",
           note="(1 + w) norms before and after attention and MLP, GeGLU, scaled embeddings, soft-capped "
                "attention scores and logits, alternating sliding layers"),
    Family("olmo2", "Olmo2ForCausalLM", _HF_COMMON + _HF_POST + _HF_QK_NORM, "olmo2",
           _GGUF_COMMON + _GGUF_POST + _GGUF_QK_NORM,
           fixed={**_LLAMA_SHAPE, "norm_placement": "post", "qk_norm": True, "qk_norm_scope": "projection"},
           note="norms after attention and after the MLP only, QK-norm over the whole q and k projections"),
)}

#: Mechanism fields a family record speaks of (the rest of ModelConfig is the shared Llama shape:
#: dim, n_layers, heads, ffn_dim, norm_eps, rope_theta, max_seq_len, tie_embeddings, attention).
MECHANISMS = ("head_dim", "norm_offset", "norm_placement", "qk_norm", "qk_norm_scope", "qkv_bias", "mlp_activation",
              "embed_scale", "attn_scale", "attn_softcap", "final_softcap", "layer_types", "sliding_window",
              "rope_theta_sliding", "nope_layers", "rope_scaling")


def _differs(model: ModelConfig, key: str) -> bool:
    """Whether `model` sets mechanism `key` away from ModelConfig's default."""
    default = ModelConfig()
    value, base = getattr(model, key), getattr(default, key)
    if key == "qk_norm_scope" and not model.qk_norm:
        return False
    if key == "layer_types":
        return "sliding" in value
    return value != base


def fits(family: Family, model: ModelConfig) -> list[str]:
    """The mechanisms of `model` that `family` cannot carry ([] = it represents the model)."""
    bad = [f"{k} = {getattr(model, k)!r}" for k, v in family.fixed.items() if getattr(model, k) != v]
    free = set(family.fixed) | set(family.settable)
    bad += [f"{k} = {getattr(model, k)!r}" for k in MECHANISMS if k not in free and _differs(model, k)]
    return bad


def family_of(model: ModelConfig) -> Family:
    """The family a model is exported as: the first of FAMILIES (Llama first) that carries every
    mechanism it sets.

    Raises:
        ExportError: no family represents the model, naming what each closest family lacks.
    """
    from lmforge.export.options import ExportError

    misses = {}
    for family in FAMILIES.values():
        bad = fits(family, model)
        if not bad:
            return family
        misses[family.model_type] = bad
    closest = sorted(misses.items(), key=lambda kv: len(kv[1]))[:2]
    raise ExportError("no model family lmforge exports carries this model's mechanisms: "
                      + "; ".join(f"{name} lacks {', '.join(bad)}" for name, bad in closest)
                      + ". Export a model built from an imported family's config, or change [model].")


def chat_template_of(family: Family | None) -> FamilyTemplate | None:
    """What `family`'s record says of chat, for a model whose files carry no chat template: its
    template and end of turn (`template` None: the record has none), named by its architecture.
    `import_hf` passes it to `tokenizer.import_tokenizer` (import-gguf imports through import_hf),
    which takes the template (no token added) or, lacking one, lmforge's ChatML, and says which in
    one line. None: no family (lmforge's ChatML)."""
    if family is None:
        return None
    return FamilyTemplate(family.architecture, family.chat_template,
                          family.end_of_turn if family.chat_template is not None else None)


def by_architecture(architecture: str) -> Family | None:
    """The family whose config.json `architectures[0]` is `architecture` (None: none)."""
    return next((f for f in FAMILIES.values() if f.architecture == architecture), None)


def by_gguf_arch(arch: str) -> list[Family]:
    """The families llama.cpp's `general.architecture` = `arch` stands for (llama: Llama and Mistral)."""
    return [f for f in FAMILIES.values() if f.gguf_arch == arch]


__all__ = ["FAMILIES", "Family", "GEMMA_CHAT_TEMPLATE", "MECHANISMS", "by_architecture", "by_gguf_arch",
           "chat_template_of", "family_of", "fits"]
