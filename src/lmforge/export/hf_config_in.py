"""config.json in: the lmforge `ModelConfig` of a transformers config.json (`model_config_from_hf`)
and the family it names (`family_of_hf_config`), for `lmforge import-hf` (`export/hf_in.py`).

Per family: Llama, Mistral, Qwen2, Qwen3, Gemma 3 text, Gemma 2 and OLMo 2 (the records of
`export/families.py`); a key left out takes transformers' default for the family's config class
(`_HF_DEFAULTS`). Anything lmforge's model cannot represent exactly (Gemma 3's image-text model,
MLP or output biases, RoPE scaling lmforge lacks, another activation) is refused, naming the
field. The way out is `export/hf_config_out.py`, whose names for what both directions spell
(`HF_LAYER_TYPES`, `GELU_TANH`, `FAMILIES`) this module reads.
"""

from __future__ import annotations

from lmforge.config import ModelConfig
from lmforge.config.fields import check_number
from lmforge.errors import ConfigError
from lmforge.export import families as families_mod
from lmforge.export.hf_config_out import FAMILIES, GELU_TANH, HF_LAYER_TYPES
from lmforge.export.hf_rope_in import flag, gemma3_rope, number, rope_settings
from lmforge.export.options import ExportError
from lmforge.tokenizer import short_repr


def _check_ranges(model: ModelConfig, keys: dict, where: str) -> None:
    """Each ModelConfig field read from config.json within the range lmforge's [model] allows,
    refused under the config.json key the value came from (`keys`: field -> (key, value written,
    how the field derives from it, or "" when it is that value))."""
    for field, entry in keys.items():
        key, raw, how = (*entry, "")[:3]
        value = getattr(model, field)
        try:
            check_number(ModelConfig, field, value, f"model.{field}")
        except ConfigError:
            low, high, low_open, high_open = ModelConfig.__dataclass_fields__[field].metadata["bounds"]
            span = f"{low:g} {'<' if low_open else '<='} value {'<' if high_open else '<='} {high:g}"
            seen = f"{key} = {raw!r}" + (f" makes lmforge's model.{field} = {how} = {value!r}" if how else "")
            raise ExportError(f"{where}: {seen}: expected {span}" + ("" if how else f" (lmforge's model.{field})")
                              + f"; lmforge cannot hold this model. Fix {key} in config.json (or use the folder "
                              f"transformers saved).") from None


#: Where a config.json leaves a key out, transformers' config class of the family supplies it;
#: the defaults that differ from the Llama ones used below (key -> value).
_HF_DEFAULTS = {
    "gemma3_text": dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, tie_word_embeddings=True,
                        max_position_embeddings=131072, final_logit_softcapping=None,
                        attn_logit_softcapping=None),
    "gemma2": dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, tie_word_embeddings=True,
                   max_position_embeddings=8192, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "olmo2": dict(rms_norm_eps=1e-5),
    "mistral": dict(sliding_window=4096, max_position_embeddings=4096 * 32),
}
GEMMA = ("gemma3_text", "gemma2")


def _get(cfg: dict, family: str, key: str, default=None):
    """config.json's `key`, or transformers' default for `family` (`_HF_DEFAULTS`), or `default`."""
    return cfg[key] if key in cfg else _HF_DEFAULTS.get(family, {}).get(key, default)


def _refuse_multimodal(cfg: dict, where: str) -> None:
    """Gemma 3's image-text model (model_type gemma3, Gemma3ForConditionalGeneration) is refused
    with the way to its text model."""
    archs = cfg.get("architectures")
    multimodal = cfg.get("model_type") == "gemma3" or (
        isinstance(archs, list) and "Gemma3ForConditionalGeneration" in archs)
    if multimodal:
        raise ExportError(
            f"{where}: model_type = {cfg.get('model_type')!r}, architectures = {archs}: Gemma 3's image-text model "
            f"(expected model_type \"gemma3_text\", architectures [\"Gemma3ForCausalLM\"]). lmforge imports Gemma 3's "
            f"text model only: import the text model: Gemma3ForCausalLM (a text-only checkpoint such as "
            f"gemma-3-270m or gemma-3-1b, or the text model saved from this one with transformers).")


def _layer_kinds(cfg: dict, family: str, n_layers: int, where: str, say) -> list[str]:
    """ModelConfig.layer_types from config.json's `layer_types` (or, for Gemma, the pattern
    transformers derives without one: Gemma 3's `sliding_window_pattern`, default 6, and Gemma 2's
    alternation); [] when every layer is full.

    Raises:
        ExportError: not a list of n_layers "full_attention" / "sliding_attention"; a sliding
        layer in a family whose transformers class has none.
    """
    types = cfg.get("layer_types")
    if types is None and family == "gemma3_text":
        key = "sliding_window_pattern" if "sliding_window_pattern" in cfg else "_sliding_window_pattern"
        pattern = number(cfg.get(key, 6), key, int, where)
        if pattern < 1:
            raise ExportError(f"{where}: {key} = {pattern}: expected a positive layer count.")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        say(f"config.json: no layer_types; {key} = {pattern} makes layers "
            f"{[i for i, t in enumerate(types) if t == 'full_attention']} full and the others sliding "
            f"(as transformers derives them)")
    elif types is None and family == "gemma2":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    if types is None:
        return []
    known = set(HF_LAYER_TYPES.values()) if family in GEMMA else {"full_attention"}
    if not isinstance(types, list) or len(types) != n_layers or any(t not in known for t in types):
        if family in GEMMA:
            want = f"a list of {n_layers} entries, each \"full_attention\" or \"sliding_attention\""
            raise ExportError(f"{where}: layer_types = {short_repr(types)}: expected {want} (num_hidden_layers = "
                              f"{n_layers}); this model cannot be imported.")
        raise ExportError(f"{where}: layer_types = {short_repr(types)}: lmforge's {FAMILIES[family]} has full "
                          f"attention in every layer (expected every entry \"full_attention\"); this model cannot be "
                          f"imported.")
    kinds = ["sliding" if t == "sliding_attention" else "full" for t in types]
    return kinds if "sliding" in kinds else []


def _family_of_config(cfg: dict, where: str, say) -> families_mod.Family:
    """The family config.json names (model_type and architectures[0]).

    Raises:
        ExportError: Gemma 3's image-text model, a model_type lmforge does not import, or
        architectures naming another class.
    """
    _refuse_multimodal(cfg, where)
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures")
    if model_type not in FAMILIES:
        raise ExportError(
            f"{where}: model_type = {model_type!r}, architectures = {archs}; lmforge imports model_type "
            f"{' / '.join(repr(k) for k in FAMILIES)} ({', '.join(FAMILIES.values())}). Other architectures differ "
            f"in ways lmforge's model does not represent.")
    family = families_mod.FAMILIES[model_type]
    if archs is None or archs == []:
        say(f"config.json: architectures = {archs!r}; reading it as {family.architecture} (model_type {model_type!r})")
    elif archs != [family.architecture]:
        raise ExportError(f"{where}: architectures = {archs!r} with model_type {model_type!r}; expected "
                          f"[\"{family.architecture}\"]. lmforge imports the causal language models of "
                          f"{', '.join(FAMILIES.values())} only.")
    return family


def family_of_hf_config(cfg: dict, where: str = "config.json") -> families_mod.Family:
    """The family (`export.families.Family`) of a transformers config.json (see `model_config_from_hf`).

    Raises:
        ExportError: as `model_config_from_hf` does for the model_type and architectures.
    """
    if not isinstance(cfg, dict):
        raise ExportError(f"{where}: expected a JSON object (a transformers config), found {type(cfg).__name__}.")
    return _family_of_config(cfg, where, lambda _msg: None)


def model_config_from_hf(cfg: dict, where: str, log=None) -> ModelConfig:
    """lmforge ModelConfig from a transformers `config.json` of a family lmforge imports
    (`export.families.FAMILIES`): Llama (tied or untied head, plain or Llama 3.1-scaled RoPE),
    Mistral (a sliding window in every layer: `layer_types` all "sliding"; a window at least
    max_position_embeddings never slides and is full attention), Qwen2 (q/k/v biases ->
    `qkv_bias`), Qwen3 (QK-norm per head), Gemma 3 text (model_type gemma3_text: (1 + w)
    sandwich norms, QK-norm, GeGLU, sqrt(hidden) embedding scale, `query_pre_attn_scalar`,
    sliding and full layers with their own RoPE bases, an optional final soft-cap), Gemma 2
    (the same without QK-norm, one RoPE base, attention and final soft-caps) and OLMo 2 (norms
    after attention and MLP only, QK-norm over the whole projections). The family's fixed
    mechanisms come from its record (`Family.fixed`); the model is checked to be one the family
    carries (`families.fits`), so it exports back as the same family. A key left out takes
    transformers' default for the family's config class.

    Args:
        log: called with one line per conversion stated (an empty `architectures` read by
            model_type, Gemma 3 layer kinds derived from a pattern, an attention soft-cap
            transformers' Gemma 3 does not apply, a Mistral window that slides).
    Raises:
        ExportError: not a JSON object, Gemma 3's image-text model, another architecture, MLP or
        o_proj biases, another activation, RoPE scaling lmforge lacks (any on Gemma), sliding
        layers in a family without them, a head size the family derives otherwise, a missing
        field or one of the wrong type — each naming the field, the value and what is expected.
    """
    say = log or (lambda _msg: None)
    if not isinstance(cfg, dict):
        raise ExportError(f"{where}: expected a JSON object (a transformers config), found {type(cfg).__name__}.")
    family = _family_of_config(cfg, where, say)
    name, arch = family.model_type, family.architecture
    if name in GEMMA:
        activation_key, activation, mlp = "hidden_activation", GELU_TANH, "GeGLU (GELU, tanh approximation)"
    else:
        activation_key, activation, mlp = "hidden_act", "silu", "SwiGLU (silu)"
    refusals = [
        ("mlp_bias", False, "lmforge's MLP has no biases"),
        (activation_key, activation, f"lmforge's {arch} MLP is {mlp}"),
        ("use_sliding_window", False, f"transformers' {arch} then slides a window in the layers from max_window_layers "
                                      f"on, which lmforge's import does not map"),
        ("use_bidirectional_attention", False, "lmforge's attention is causal"),
    ]
    if name != "qwen2":  # Qwen2 always has q/k/v biases (and no key for them)
        refusals.append(("attention_bias", False, "lmforge's attention has biases on q/k/v only in Qwen2's layout"))
    for key, want, why in refusals:
        if cfg.get(key) is not None and cfg[key] != want:  # a key left out (or null) is transformers' default
            raise ExportError(f"{where}: {key} = {cfg[key]!r}, expected {want!r}: {why}; this model cannot be "
                              f"imported.")
    max_pos = number(_get(cfg, name, "max_position_embeddings", 2048), "max_position_embeddings", int, where)
    dim, n_heads = number(cfg.get("hidden_size"), "hidden_size", int, where), \
        number(cfg.get("num_attention_heads"), "num_attention_heads", int, where)
    n_layers = number(cfg.get("num_hidden_layers"), "num_hidden_layers", int, where)
    n_kv_heads = number(cfg.get("num_key_value_heads", n_heads), "num_key_value_heads", int, where)
    ffn_dim = number(cfg.get("intermediate_size"), "intermediate_size", int, where)
    sizes = {"hidden_size": dim, "num_attention_heads": n_heads, "num_hidden_layers": n_layers,
             "num_key_value_heads": n_kv_heads, "intermediate_size": ffn_dim, "max_position_embeddings": max_pos}
    bad = [f"{k} = {v}" for k, v in sizes.items() if v <= 0]
    if bad:
        raise ExportError(f"{where}: {', '.join(bad)}: expected positive sizes; this config.json does not describe a "
                          f"model. Fix it (or use the folder transformers saved).")
    if n_heads % n_kv_heads:
        raise ExportError(f"{where}: num_attention_heads = {n_heads} is not divisible by num_key_value_heads = "
                          f"{n_kv_heads} (grouped-query attention shares each key/value head among "
                          f"num_attention_heads / num_key_value_heads query heads); this config.json does not describe "
                          f"a model. Fix it (or use the folder transformers saved).")
    # config.json's key and value of each ModelConfig field, for the range check (_check_ranges)
    keys: dict = {"dim": ("hidden_size", cfg.get("hidden_size")), "n_layers": ("num_hidden_layers", n_layers),
                  "n_heads": ("num_attention_heads", n_heads), "n_kv_heads": ("num_key_value_heads", n_kv_heads),
                  "ffn_dim": ("intermediate_size", ffn_dim), "max_seq_len": ("max_position_embeddings", max_pos)}
    mech: dict = {}
    # -- head size: explicit in Gemma (256 in every small model), derived elsewhere; only absent or
    # null derives it (transformers would build heads of size 0 from a 0)
    head_dim = _get(cfg, name, "head_dim")
    if head_dim is not None:
        head_dim = number(head_dim, "head_dim", int, where)
        if head_dim <= 0:
            raise ExportError(f"{where}: head_dim = {head_dim}: expected a positive head size, or null (or no key) for "
                              f"hidden_size / num_attention_heads = {dim // n_heads if dim % n_heads == 0 else 'n/a'}. "
                              f"Fix head_dim in config.json (or use the folder transformers saved).")
        if head_dim != dim // n_heads or dim % n_heads:
            if "head_dim" not in family.settable:
                raise ExportError(
                    f"{where}: head_dim = {head_dim} but hidden_size / num_attention_heads = {dim // n_heads}; "
                    f"lmforge's {arch} derives head_dim = dim / n_heads (expected {dim // n_heads}), so this model "
                    f"cannot be imported.")
            mech["head_dim"] = head_dim
            keys["head_dim"] = ("head_dim", head_dim)
    elif dim % n_heads:
        raise ExportError(f"{where}: hidden_size = {dim} is not divisible by num_attention_heads = {n_heads} and there "
                          f"is no head_dim; transformers derives the head size as hidden_size / num_attention_heads. "
                          f"Fix config.json (or use the folder transformers saved).")
    resolved_head_dim = head_dim or dim // n_heads
    # -- layer kinds and the window
    layer_types = _layer_kinds(cfg, name, n_layers, where, say)
    window = _get(cfg, name, "sliding_window")
    if name == "mistral" and window is not None:
        window = number(window, "sliding_window", int, where)
        if window < max_pos:  # transformers' Mistral slides the window in every layer
            layer_types = ["sliding"] * n_layers
            say(f"config.json: sliding_window = {window} < max_position_embeddings = {max_pos}: every layer attends "
                f"to its last {window} keys (model.layer_types all \"sliding\")")
    if "sliding" in layer_types:
        if window is None:
            raise ExportError(f"{where}: layer_types has sliding_attention layers but sliding_window = null; expected "
                              f"the window (keys a sliding layer sees, its own included).")
        window = number(window, "sliding_window", int, where)
        if window < 1:
            raise ExportError(f"{where}: sliding_window = {window}: expected at least 1 key.")
        mech.update(layer_types=layer_types, sliding_window=window)
        keys["sliding_window"] = ("sliding_window", window)
    # -- RoPE
    if name == "gemma3_text":
        rope = gemma3_rope(cfg, where, keys)
        if "sliding" not in layer_types or rope["rope_theta_sliding"] == rope["rope_theta"]:
            rope["rope_theta_sliding"] = 0.0  # the full layers' base
            keys.pop("rope_theta_sliding")
    else:
        rope = rope_settings(cfg, where, keys)
        if rope.get("rope_scaling", "none") != "none" and "rope_scaling" not in family.settable:
            raise ExportError(f"{where}: rope_type = {rope['rope_scaling']!r}: lmforge imports {arch} with plain RoPE "
                              f"(\"default\") only; this model cannot be imported.")
    # -- Gemma's scales and soft-caps
    if name in GEMMA:
        scalar = number(_get(cfg, name, "query_pre_attn_scalar"), "query_pre_attn_scalar", float, where)
        if scalar <= 0:
            raise ExportError(f"{where}: query_pre_attn_scalar = {scalar}: expected a positive number.")
        mech["embed_scale"] = dim ** 0.5  # transformers: hidden_size ** 0.5
        mech["attn_scale"] = scalar ** -0.5  # transformers: query_pre_attn_scalar ** -0.5
        keys.update(embed_scale=("hidden_size", dim, "hidden_size ** 0.5"),
                    attn_scale=("query_pre_attn_scalar", _get(cfg, name, "query_pre_attn_scalar"),
                                "query_pre_attn_scalar ** -0.5"))
        caps = {}
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = _get(cfg, name, key)
            caps[key] = 0.0 if value is None else number(value, key, float, where)
            if caps[key] < 0:
                raise ExportError(f"{where}: {key} = {value}: expected a positive number or null.")
        if name == "gemma3_text" and caps["attn_logit_softcapping"]:
            say(f"config.json: attn_logit_softcapping = {caps['attn_logit_softcapping']} is not applied by "
                f"transformers' Gemma 3 (its attention never passes it on); imported without an attention soft-cap, "
                f"as transformers computes")
        else:
            mech["attn_softcap"] = caps["attn_logit_softcapping"]
            keys["attn_softcap"] = ("attn_logit_softcapping", _get(cfg, name, "attn_logit_softcapping"))
        mech["final_softcap"] = caps["final_logit_softcapping"]
        keys["final_softcap"] = ("final_logit_softcapping", _get(cfg, name, "final_logit_softcapping"))
    eps = number(_get(cfg, name, "rms_norm_eps", 1e-6), "rms_norm_eps", float, where)
    keys["norm_eps"] = ("rms_norm_eps", _get(cfg, name, "rms_norm_eps", 1e-6))
    tie = _get(cfg, name, "tie_word_embeddings", False)
    model = ModelConfig(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn_dim, norm_eps=eps,
        max_seq_len=max_pos, tie_embeddings=False if tie is None else flag(tie, "tie_word_embeddings", where),
        **{**family.fixed, **mech, **rope},
    )
    _check_ranges(model, keys, where)
    if resolved_head_dim % 2:
        raise ExportError(f"{where}: head size {resolved_head_dim} is odd: rotary embeddings rotate pairs; this "
                          f"config.json does not describe a model transformers runs.")
    missing = families_mod.fits(family, model)
    if missing:  # a guard: every value set above is one the family carries
        raise ExportError(f"{where}: lmforge's {arch} cannot carry {', '.join(missing)}; this model cannot be "
                          f"imported.")
    return model


__all__ = ["family_of_hf_config", "model_config_from_hf"]
