"""config.json in: the lmforge `ModelConfig` of a transformers config.json (`model_config_from_hf`)
and the family it names (`family_of_hf_config`), for `lmforge import-hf` (`export/hf_in.py`).

The reading shared by every family (Llama's shape, the head size, the layer kinds and window,
plain or Llama 3.1 RoPE) is here; what one family alone has is its record's (`export/families/`:
transformers' defaults for its config class, `hf_defaults`; its activation; the hooks for Gemma's
layer patterns, per-kind RoPE bases, scales and soft-caps). Anything lmforge's model cannot
represent exactly (Gemma 3's image-text model, MLP or output biases, RoPE scaling lmforge lacks,
another activation) is refused, naming the field.
"""

from __future__ import annotations

from lmforge.config import ModelConfig
from lmforge.config.fields import check_number
from lmforge.errors import ConfigError
from lmforge.export import families
from lmforge.export.families import FAMILIES, Family, HfIn
from lmforge.export.families.shared import HF_LAYER_TYPES
from lmforge.export.hf_rope_in import flag, number, rope_settings
from lmforge.export.options import ExportError
from lmforge.tokenizer import short_repr

_NAMES = ", ".join(f.architecture for f in FAMILIES.values())


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


def _family_of_config(cfg: dict, where: str, say) -> Family:
    """The family config.json names (model_type and architectures[0]).

    Raises:
        ExportError: a model a record refuses by name (Gemma 3's image-text model: `Family.hf_refuse`),
        a model_type lmforge does not import, or architectures naming another class.
    """
    for family in FAMILIES.values():
        if family.hf_refuse is not None:
            family.hf_refuse(cfg, where)
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures")
    if model_type not in FAMILIES:
        raise ExportError(
            f"{where}: model_type = {model_type!r}, architectures = {archs}; lmforge imports model_type "
            f"{' / '.join(repr(k) for k in FAMILIES)} ({_NAMES}). Other architectures differ "
            f"in ways lmforge's model does not represent.")
    family = FAMILIES[model_type]
    if archs is None or archs == []:
        say(f"config.json: architectures = {archs!r}; reading it as {family.architecture} (model_type {model_type!r})")
    elif archs != [family.architecture]:
        raise ExportError(f"{where}: architectures = {archs!r} with model_type {model_type!r}; expected "
                          f"[\"{family.architecture}\"]. lmforge imports the causal language models of "
                          f"{_NAMES} only.")
    return family


def family_of_hf_config(cfg: dict, where: str = "config.json") -> Family:
    """The family (`export.families.Family`) of a transformers config.json (see `model_config_from_hf`).

    Raises:
        ExportError: as `model_config_from_hf` does for the model_type and architectures.
    """
    if not isinstance(cfg, dict):
        raise ExportError(f"{where}: expected a JSON object (a transformers config), found {type(cfg).__name__}.")
    return _family_of_config(cfg, where, lambda _msg: None)


def _refuse_unrepresented(hf: HfIn) -> None:
    """Keys whose value lmforge's model of the family cannot compute: MLP biases, another
    activation, Qwen2's windowed layers, bidirectional attention, attention biases (but Qwen2's)."""
    family, cfg = hf.family, hf.cfg
    arch = family.architecture
    activation_key, activation, mlp = family.hf_activation
    refusals = [
        ("mlp_bias", False, "lmforge's MLP has no biases"),
        (activation_key, activation, f"lmforge's {arch} MLP is {mlp}"),
        ("use_sliding_window", False, f"transformers' {arch} then slides a window in the layers from max_window_layers "
                                      f"on, which lmforge's import does not map"),
        ("use_bidirectional_attention", False, "lmforge's attention is causal"),
    ]
    if family.hf_attention_bias_key:  # Qwen2 always has q/k/v biases (and no key for them)
        refusals.append(("attention_bias", False, "lmforge's attention has biases on q/k/v only in Qwen2's layout"))
    for key, want, why in refusals:
        if cfg.get(key) is not None and cfg[key] != want:  # a key left out (or null) is transformers' default
            raise ExportError(f"{hf.where}: {key} = {cfg[key]!r}, expected {want!r}: {why}; this model cannot be "
                              f"imported.")


def _shape(hf: HfIn) -> dict:
    """Llama's shape: dim, n_layers, n_heads, n_kv_heads, ffn_dim, max_seq_len (positive, heads
    divisible), their config.json keys noted in `hf.keys`."""
    where, cfg = hf.where, hf.cfg
    max_pos = hf.number("max_position_embeddings", int, 2048)
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
    hf.keys.update({"dim": ("hidden_size", cfg.get("hidden_size")), "n_layers": ("num_hidden_layers", n_layers),
                    "n_heads": ("num_attention_heads", n_heads), "n_kv_heads": ("num_key_value_heads", n_kv_heads),
                    "ffn_dim": ("intermediate_size", ffn_dim), "max_seq_len": ("max_position_embeddings", max_pos)})
    return dict(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn_dim, max_seq_len=max_pos)


def _head_dim(hf: HfIn, dim: int, n_heads: int) -> int:
    """The head size: config.json's head_dim (a family that derives it refuses another), or
    hidden_size / num_attention_heads when absent or null (transformers would build heads of
    size 0 from a 0). Sets `hf.mech["head_dim"]` when it is not the derived one."""
    where, arch = hf.where, hf.family.architecture
    head_dim = hf.get("head_dim")
    if head_dim is not None:
        head_dim = number(head_dim, "head_dim", int, where)
        if head_dim <= 0:
            raise ExportError(f"{where}: head_dim = {head_dim}: expected a positive head size, or null (or no key) for "
                              f"hidden_size / num_attention_heads = {dim // n_heads if dim % n_heads == 0 else 'n/a'}. "
                              f"Fix head_dim in config.json (or use the folder transformers saved).")
        if head_dim != dim // n_heads or dim % n_heads:
            if "head_dim" not in hf.family.settable:
                raise ExportError(
                    f"{where}: head_dim = {head_dim} but hidden_size / num_attention_heads = {dim // n_heads}; "
                    f"lmforge's {arch} derives head_dim = dim / n_heads (expected {dim // n_heads}), so this model "
                    f"cannot be imported.")
            hf.mech["head_dim"] = head_dim
            hf.keys["head_dim"] = ("head_dim", head_dim)
    elif dim % n_heads:
        raise ExportError(f"{where}: hidden_size = {dim} is not divisible by num_attention_heads = {n_heads} and there "
                          f"is no head_dim; transformers derives the head size as hidden_size / num_attention_heads. "
                          f"Fix config.json (or use the folder transformers saved).")
    return head_dim or dim // n_heads


def _layer_kinds(hf: HfIn, n_layers: int) -> list[str]:
    """ModelConfig.layer_types from config.json's `layer_types` (or the family's pattern without
    one: `Family.hf_layer_kinds`); [] when every layer is full.

    Raises:
        ExportError: not a list of n_layers "full_attention" / "sliding_attention"; a sliding
        layer in a family whose transformers class has none.
    """
    family, where = hf.family, hf.where
    types = hf.cfg.get("layer_types")
    if types is None and family.hf_layer_kinds is not None:
        types = family.hf_layer_kinds(hf, n_layers)
    if types is None:
        return []
    known = set(HF_LAYER_TYPES.values()) if family.hf_sliding_layer_types else {"full_attention"}
    if not isinstance(types, list) or len(types) != n_layers or any(t not in known for t in types):
        if family.hf_sliding_layer_types:
            want = f"a list of {n_layers} entries, each \"full_attention\" or \"sliding_attention\""
            raise ExportError(f"{where}: layer_types = {short_repr(types)}: expected {want} (num_hidden_layers = "
                              f"{n_layers}); this model cannot be imported.")
        raise ExportError(f"{where}: layer_types = {short_repr(types)}: lmforge's {family.architecture} has full "
                          f"attention in every layer (expected every entry \"full_attention\"); this model cannot be "
                          f"imported.")
    kinds = ["sliding" if t == "sliding_attention" else "full" for t in types]
    return kinds if "sliding" in kinds else []


def _window(hf: HfIn, n_layers: int, max_pos: int) -> None:
    """The layer kinds and the sliding window into `hf.mech` (a Mistral window below the context
    slides in every layer: `Family.hf_window_everywhere`, said in one line).

    Raises:
        ExportError: sliding layers without a window, a window under 1 key.
    """
    where = hf.where
    layer_types = _layer_kinds(hf, n_layers)
    window = hf.get("sliding_window")
    if hf.family.hf_window_everywhere and window is not None:
        window = number(window, "sliding_window", int, where)
        if window < max_pos:  # transformers' Mistral slides the window in every layer
            layer_types = ["sliding"] * n_layers
            hf.say(f"config.json: sliding_window = {window} < max_position_embeddings = {max_pos}: every layer attends "
                   f"to its last {window} keys (model.layer_types all \"sliding\")")
    if "sliding" in layer_types:
        if window is None:
            raise ExportError(f"{where}: layer_types has sliding_attention layers but sliding_window = null; expected "
                              f"the window (keys a sliding layer sees, its own included).")
        window = number(window, "sliding_window", int, where)
        if window < 1:
            raise ExportError(f"{where}: sliding_window = {window}: expected at least 1 key.")
        hf.mech.update(layer_types=layer_types, sliding_window=window)
        hf.keys["sliding_window"] = ("sliding_window", window)


def _rope(hf: HfIn) -> dict:
    """RoPE as ModelConfig keys: the family's own reading (`Family.hf_rope_in`), or plain / Llama
    3.1 RoPE, scaling refused where the family has none."""
    if hf.family.hf_rope_in is not None:
        return hf.family.hf_rope_in(hf)
    rope = rope_settings(hf.cfg, hf.where, hf.keys)
    if rope.get("rope_scaling", "none") != "none" and "rope_scaling" not in hf.family.settable:
        raise ExportError(f"{hf.where}: rope_type = {rope['rope_scaling']!r}: lmforge imports "
                          f"{hf.family.architecture} with plain RoPE (\"default\") only; this model cannot be imported.")
    return rope


def model_config_from_hf(cfg: dict, where: str, log=None) -> ModelConfig:
    """lmforge ModelConfig from a transformers `config.json` of a family lmforge imports
    (`export.families.FAMILIES`: Llama, Mistral, Qwen2, Qwen3, Gemma 3 text, Gemma 2, OLMo 2;
    each module there says what its family adds). The family's fixed mechanisms come from its
    record (`Family.fixed`); the model is checked to be one the family carries
    (`families.fits`), so it exports back as the same family. A key left out takes transformers'
    default for the family's config class (`Family.hf_defaults`).

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
    hf = HfIn(cfg, family, where, say)
    _refuse_unrepresented(hf)
    shape = _shape(hf)
    head_dim = _head_dim(hf, shape["dim"], shape["n_heads"])
    _window(hf, shape["n_layers"], shape["max_seq_len"])
    rope = _rope(hf)
    if family.hf_mechanisms_in is not None:
        family.hf_mechanisms_in(hf, shape["dim"])
    eps = hf.number("rms_norm_eps", float, 1e-6)
    hf.keys["norm_eps"] = ("rms_norm_eps", hf.get("rms_norm_eps", 1e-6))
    tie = hf.get("tie_word_embeddings", False)
    model = ModelConfig(**shape, norm_eps=eps, family=family.model_type,
                        tie_embeddings=False if tie is None else flag(tie, "tie_word_embeddings", where),
                        **{**family.fixed, **hf.mech, **rope})
    _check_ranges(model, hf.keys, where)
    if head_dim % 2:
        raise ExportError(f"{where}: head size {head_dim} is odd: rotary embeddings rotate pairs; this "
                          f"config.json does not describe a model transformers runs.")
    missing = families.fits(family, model)
    if missing:  # a guard: every value set above is one the family carries
        raise ExportError(f"{where}: lmforge's {family.architecture} cannot carry {', '.join(missing)}; this model "
                          f"cannot be imported.")
    return model


__all__ = ["family_of_hf_config", "model_config_from_hf"]
