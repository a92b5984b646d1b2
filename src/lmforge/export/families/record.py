"""The `Family` record and what it says of llama.cpp (`LlamaCppArch`), the mechanisms a record
speaks of (`MECHANISMS`), and `HfIn`, a config.json being read (what a family's reading hooks
are given). One family's record is one module beside this one (`export/families/llama.py`, ...);
`export/families/__init__.py` lists them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from lmforge.export.hf_rope_in import number

#: Mechanism fields a family record speaks of (the rest of ModelConfig is the shared Llama shape:
#: dim, n_layers, heads, ffn_dim, norm_eps, rope_theta, max_seq_len, tie_embeddings, attention).
MECHANISMS = ("head_dim", "norm_offset", "norm_placement", "qk_norm", "qk_norm_scope", "qkv_bias", "mlp_activation",
              "embed_scale", "attn_scale", "attn_softcap", "final_softcap", "layer_types", "sliding_window",
              "rope_theta_sliding", "nope_layers", "rope_scaling", "residual_scale", "logit_scale")

#: The mechanisms of Llama's layout, which most families fix
LLAMA_SHAPE = dict(norm_offset=0.0, norm_placement="pre", mlp_activation="silu", embed_scale=1.0,
                   attn_softcap=0.0, final_softcap=0.0, qkv_bias=False)


@dataclass(frozen=True)
class LlamaCppArch:
    """What llama.cpp's runtime hard-codes for one `general.architecture`, beyond the keys it
    reads (`llama_model::load_hparams` in src/llama-model.cpp, the graphs in src/models/). A
    family record names its architecture (`Family.gguf_arch`) and carries this, so that export
    refuses what it cannot hold (`llama_cpp.gguf_family`) and import (`gguf_in`) writes back what
    a file computes.

    swa_pattern: `set_swa_pattern(p)`: layer il attends through the sliding window iff
        il % p < p - 1, whatever the file says; 0: no sliding-window attention at all.
    rope_theta_sliding: the sliding layers' RoPE base, hard-coded (gemma3: 10000, whatever
        `rope.freq_base_swa` says); 0: the sliding layers use `rope.freq_base` (or `freq_base_swa`).
    embed_scale_sqrt_dim: token embeddings are multiplied by sqrtf(n_embd) (Gemma).
    attn_scale_dim_layers: the block count at which queries are scaled by 1/sqrt(n_embd / n_head)
        (integer division; Gemma 2 27B: 46, Gemma 3 27B: 62) instead of 1/sqrt(head_dim).
    attn_softcap: scores are always soft-capped (gemma2: `attn_logit_softcapping`, 50 when absent).
    final_softcap: "always" (gemma2: `final_logit_softcapping`, 30 when absent), "without_swa"
        (gemma3: only in its graph without sliding layers), "none".
    rope_freqs: Llama 3.1's RoPE scaling is read as the `rope_freqs` tensor (llama only).
    window_required: a file without `{arch}.attention.sliding_window` is refused (gemma3).
    scales_from_file: the embedding and attention scales are the file's keys (granite:
        `embedding_scale`, `attention.scale`, with `residual_scale` and `logit_scale`), not hard-coded.
    nope_step: layer il skips RoPE iff (il + 1) % nope_step == 0 (smollm3: 4, `n_no_rope_layer_step`);
        0: every layer rotates q and k.
    window_ignored: the file's `attention.sliding_window` is read and not applied: every layer
        attends to every key (phi3: "Phi SWA is currently disabled", ggml-org/llama.cpp#13676).
    no_swa_note: said when a sliding model is refused for an architecture without sliding windows.
    """

    swa_pattern: int = 0
    rope_theta_sliding: float = 0.0
    embed_scale_sqrt_dim: bool = False
    attn_scale_dim_layers: int = 0
    attn_softcap: bool = False
    final_softcap: str = "none"
    rope_freqs: bool = False
    window_required: bool = False
    no_swa_note: str = ""
    nope_step: int = 0
    scales_from_file: bool = False
    window_ignored: bool = False

    def nope_layers(self, n_layers: int) -> list[int]:
        """The layers llama.cpp runs without RoPE."""
        return [il for il in range(n_layers) if self.nope_step and (il + 1) % self.nope_step == 0]

    def sliding(self, n_layers: int) -> list[bool]:
        """Which of `n_layers` layers llama.cpp runs through the sliding window."""
        p = self.swa_pattern
        return [bool(p) and il % p < p - 1 for il in range(n_layers)]

    def attn_scale(self, dim: int, n_heads: int, n_layers: int, head_dim: int) -> float:
        """The scale llama.cpp multiplies queries by (`f_attention_scale`, or 1/sqrt(head_dim))."""
        if self.attn_scale_dim_layers and n_layers == self.attn_scale_dim_layers:
            return (dim // n_heads) ** -0.5
        return head_dim ** -0.5


@dataclass(frozen=True)
class Fused:
    """A weight a family stores as one tensor where lmforge keeps parts (Phi-3's `qkv_proj` =
    [wq; wk; wv] and `gate_up_proj` = [w1; w3], stacked along the output rows, as torchtune's and
    llama.cpp's converters do): `name` is the fused weight in lmforge's naming ("{i}" the layer;
    it appears in the family's `hf_names` / `gguf_names` like any other weight), `parts` the
    lmforge weights it stacks, in order. `shared.fuse` joins them at export, `shared.unfuse` splits
    them at import (each part's rows from the model config: `shared.part_rows`)."""

    name: str
    parts: tuple[str, ...]


@dataclass
class HfIn:
    """A transformers config.json being read into a ModelConfig (`hf_config_in.model_config_from_hf`):
    the JSON object, its family, the file's name for errors (`where`), `say` for one line per
    conversion stated, and what has been read: `mech` (ModelConfig field -> value) and `keys`
    (ModelConfig field -> (config.json key, value written[, how the field derives from it]), for
    the range checks that name the user's key)."""

    cfg: dict
    family: "Family"
    where: str
    say: Callable[[str], None]
    keys: dict = field(default_factory=dict)
    mech: dict = field(default_factory=dict)

    def get(self, key: str, default=None):
        """config.json's `key`, or transformers' default for the family (`Family.hf_defaults`), or `default`."""
        return self.cfg[key] if key in self.cfg else self.family.hf_defaults.get(key, default)

    def number(self, key: str, typ: type, default=None):
        """`get(key, default)` as an int or float (`typ`), refused naming the key otherwise."""
        return number(self.get(key, default), key, typ, self.where)


@dataclass(frozen=True)
class Family:
    """One model family at lmforge's edges (`export/families/__init__.py` says what each field is for).

    Hooks (None: the shared Llama reading or writing):
        hf_config_out(model, contract, dtype) -> dict: the config.json of the family's model.
        hf_refuse(cfg, where): raises for a config.json the family's name is close to but lmforge
            cannot import (Gemma 3's image-text model), before any family is picked.
        hf_layer_kinds(hf, n_layers) -> list | None: config.json's `layer_types` when the file has
            none (Gemma's patterns), in transformers' spelling.
        hf_rope_in(hf) -> dict: RoPE as ModelConfig keys (Gemma 3's per-layer-kind bases).
        hf_mechanisms_in(hf, dim): reads the family's own keys into `hf.mech` (Gemma's scales, soft-caps).
        gguf_in_config(family, kv, path, real, size, shape, config) -> dict: the config.json of a
            GGUF file of the architecture beyond the shared keys in `config` (Gemma's), in place of Llama's.
        gguf_in_extra(kv, arch, real, head_dim) -> dict: config.json keys a GGUF file of the architecture
            adds to Llama's (Granite's scalars).
    """

    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0]
    hf_names: tuple[tuple[str, str], ...]  # (lmforge name, HF name), "{i}" = layer index
    gguf_arch: str | None  # general.architecture in llama.cpp; None: no GGUF form
    gguf_names: tuple[tuple[str, str], ...] = ()
    gguf_norm_shift: float = 0.0  # GGUF stores every `*norm.weight` as w + shift (Gemma: 1)
    gguf_permute_qk: bool = False  # llama.cpp's `llama` rotates adjacent pairs: q/k rows permuted
    llama_cpp: LlamaCppArch | None = None  # what llama.cpp's runtime hard-codes for gguf_arch
    #: ModelConfig fields every model of the family has, with their values
    fixed: dict = field(default_factory=dict)
    #: ModelConfig fields (beyond the Llama shape) its config.json may set to any allowed value
    settable: tuple[str, ...] = ()
    chat_template: str | None = None  # for a model whose files carry none; None: lmforge's ChatML
    end_of_turn: str | None = None  # the token closing a chat turn, when chat_template is the family's
    note: str = ""  # what the family adds to Llama, for help texts and errors
    # -- config.json, both ways
    hf_config_out: Callable | None = None
    #: transformers' defaults of the family's config class that differ from Llama's (key -> value)
    hf_defaults: dict = field(default_factory=dict)
    #: (config.json key, value, what lmforge's MLP is): the activation the family's MLP must have
    hf_activation: tuple[str, str, str] = ("hidden_act", "silu", "SwiGLU (silu)")
    hf_attention_bias_key: bool = True  # config.json's attention_bias must be false (Qwen2: no such key)
    hf_sliding_layer_types: bool = False  # config.json's layer_types may name sliding layers
    hf_window_everywhere: bool = False  # a sliding_window below the context slides in every layer (Mistral)
    hf_refuse: Callable | None = None
    hf_layer_kinds: Callable | None = None
    hf_rope_in: Callable | None = None
    hf_mechanisms_in: Callable | None = None
    # -- GGUF in
    gguf_in_keys: dict = field(default_factory=dict)  # config.json keys of a GGUF file without sliding layers
    gguf_in_config: Callable | None = None
    gguf_in_extra: Callable | None = None
    # -- storage
    fused: tuple[Fused, ...] = ()  # weights the family's files (HF and GGUF) hold fused


__all__ = ["Family", "Fused", "HfIn", "LLAMA_SHAPE", "LlamaCppArch", "MECHANISMS"]
