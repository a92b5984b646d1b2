"""RoPE in config.json, read for `lmforge import-hf`: rope_theta and Llama 3.1's scaling
(`rope_settings`), Gemma 3's per-layer-kind bases (`gemma3_rope`), and the typed reading of a
number or a flag under the key the user wrote (`number`, `flag`), which `hf_config_in` shares."""

from __future__ import annotations

import math

from lmforge.export.options import ExportError
from lmforge.tokenizer import short_repr


#: rope_type values that mean plain RoPE (transformers writes "default"; older configs nothing).
PLAIN_ROPE = (None, "default")


def rope_settings(cfg: dict, where: str, keys: dict | None = None) -> dict:
    """The RoPE settings of a config as ModelConfig keys: rope_theta and, for Llama 3.1's
    scaling, rope_scaling = "llama3" and its four numbers. Reads transformers >= 5's
    `rope_parameters` and older `rope_theta` + `rope_scaling` (null, or rope_type / type
    "default" for plain RoPE).

    `keys` (when given) gets, per ModelConfig field set, the config.json key it came from and
    the value written there (for `hf_config_in`'s range checks).

    Raises:
        ExportError: another scaling (linear, dynamic, yarn, longrope, ...), partial rotation.
    """
    keys = {} if keys is None else keys
    source, rope = "rope_parameters", {}
    for key in ("rope_parameters", "rope_scaling"):  # both may be present: a scaling in either counts
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ExportError(f"{where}: {key} = {value!r}: expected an object or null.")
        if not rope or value.get("rope_type", value.get("type")) not in PLAIN_ROPE:
            source, rope = key, {**rope, **value} if key == "rope_scaling" else value
    kind = rope.get("rope_type", rope.get("type"))
    theta_key = f"{source}.rope_theta" if "rope_theta" in rope else "rope_theta"
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    out: dict = {"rope_theta": number(theta, theta_key, float, where)}
    keys["rope_theta"] = (theta_key, theta)
    for key in ("partial_rotary_factor",):
        value = cfg.get(key, rope.get(key))
        if value not in (None, 1, 1.0):
            raise ExportError(f"{where}: {key} = {value!r}, expected 1.0: lmforge rotates the whole head.")
    if rope.get("attention_factor") not in (None, 1, 1.0):
        raise ExportError(f"{where}: rope attention_factor = {rope['attention_factor']!r}, expected 1.0: lmforge "
                          f"does not scale attention; this model cannot be imported.")
    if kind in PLAIN_ROPE:
        return out
    if kind != "llama3":
        raise ExportError(f"{where}: {source} has rope_type = {kind!r}: lmforge implements plain RoPE (\"default\") and Llama "
                          f"3.1's \"llama3\" scaling only; this model cannot be imported.")
    out["rope_scaling"] = "llama3"
    for field, key, typ in (("rope_factor", "factor", float), ("rope_low_freq_factor", "low_freq_factor", float),
                            ("rope_high_freq_factor", "high_freq_factor", float),
                            ("rope_original_max_seq_len", "original_max_position_embeddings", int)):
        out[field] = number(rope.get(key), f"{source}.{key}", typ, where)
        keys[field] = (f"{source}.{key}", rope.get(key))
    if not out["rope_high_freq_factor"] > out["rope_low_freq_factor"]:
        raise ExportError(f"{where}: {source}.high_freq_factor = {rope.get('high_freq_factor')!r} and "
                          f"{source}.low_freq_factor = {rope.get('low_freq_factor')!r}: expected high_freq_factor "
                          f"above low_freq_factor (Llama 3.1: 4 and 1; the band between them is interpolated). Fix "
                          f"{source} in config.json.")
    return out


def number(value, key: str, typ: type, where: str):
    if value is None:
        raise ExportError(f"{where}: missing field {key!r}; a transformers config.json of this family has it.")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (typ is float or value == int(value))
    if not ok:
        raise ExportError(f"{where}: {key} = {value!r}: expected {'an integer' if typ is int else 'a number'}. Fix "
                          f"{key} in config.json (or use the folder transformers saved).")
    return typ(value)


def flag(value, key: str, where: str) -> bool:
    """A JSON true / false, refused otherwise (a string "false" is not false)."""
    if not isinstance(value, bool):
        raise ExportError(f"{where}: {key} = {value!r}: expected true or false (a JSON boolean, not a string or a "
                          f"number). Fix {key} in config.json (or use the folder transformers saved).")
    return value


def gemma3_rope(cfg: dict, where: str, keys: dict | None = None) -> dict:
    """Gemma 3's RoPE as ModelConfig keys: rope_theta (full layers) and rope_theta_sliding, from
    transformers 5's `rope_parameters` keyed by layer type, or older `rope_theta` +
    `rope_local_base_freq` (+ `rope_scaling`, which transformers applies to the full layers).

    Raises:
        ExportError: any scaling (rope_type other than "default", linear included), partial
        rotation or an attention factor, naming the entry; `rope_parameters` not keyed by layer type.
    """
    params = cfg.get("rope_parameters")
    entries: dict = {}
    if isinstance(params, dict) and set(params) & {"full_attention", "sliding_attention"}:
        full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        entries = {"rope_parameters.full_attention": full, "rope_parameters.sliding_attention": sliding}
    elif params is None or params == {}:
        full, sliding = {}, {}
    else:
        raise ExportError(f"{where}: rope_parameters = {short_repr(params)}: expected a Gemma 3 entry per layer "
                          f"type ({{\"full_attention\": {{...}}, \"sliding_attention\": {{...}}}}) or null; this "
                          f"config.json is not one transformers writes for Gemma3ForCausalLM.")
    if cfg.get("rope_scaling") is not None:
        entries["rope_scaling"] = cfg["rope_scaling"]
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise ExportError(f"{where}: {name} = {entry!r}: expected an object.")
        kind = entry.get("rope_type", entry.get("type"))
        if kind not in PLAIN_ROPE:
            raise ExportError(
                f"{where}: {name}.rope_type = {kind!r}: lmforge imports Gemma with plain RoPE (\"default\") only "
                f"(linear scaling of the global layers, as the 4B and larger models have, is not implemented); "
                f"this model cannot be imported.")
        for key, want in (("partial_rotary_factor", 1.0), ("attention_factor", 1.0)):
            if entry.get(key) not in (None, 1, 1.0):
                raise ExportError(f"{where}: {name}.{key} = {entry[key]!r}, expected {want}: lmforge rotates the whole "
                                  f"head unscaled; this model cannot be imported.")
    if cfg.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ExportError(f"{where}: partial_rotary_factor = {cfg['partial_rotary_factor']!r}, expected 1.0: lmforge "
                          f"rotates the whole head.")
    keys = {} if keys is None else keys
    theta_key = "rope_parameters.full_attention.rope_theta" if "rope_theta" in full else "rope_theta"
    local_key = "rope_parameters.sliding_attention.rope_theta" if "rope_theta" in sliding else "rope_local_base_freq"
    theta = full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local = sliding.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    out = {"rope_theta": number(theta, theta_key, float, where),
           "rope_theta_sliding": number(local, local_key, float, where)}
    if not out["rope_theta_sliding"] > 1:
        raise ExportError(f"{where}: {local_key} = {local!r}: expected a RoPE base above 1, as rope_theta (Gemma 3: "
                          f"10000; a base <= 1 gives no spread of rotations). Fix {local_key} in config.json.")
    keys.update(rope_theta=(theta_key, theta), rope_theta_sliding=(local_key, local))
    return out


__all__ = ["PLAIN_ROPE", "flag", "gemma3_rope", "number", "rope_settings"]
