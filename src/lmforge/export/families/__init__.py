"""The model families lmforge imports and exports, one module each (`llama.py`, `mistral.py`,
`qwen2.py`, `qwen3.py`, `gemma3.py`, `gemma2.py`, `olmo2.py`, `smollm3.py`, `granite.py`, `phi3.py`; Gemma's shared pieces in
`gemma.py`): everything family-specific lives in its module, at the edge (the model itself knows
only mechanisms: the fields of `ModelConfig`, never a family's name). Import and export code asks
a record (`Family`, `record.py`) and never tests a family's name.

A family's module says:
- its names on Hugging Face (`model_type`, `architecture`) and in llama.cpp (`gguf_arch`);
- its weight names both ways (`hf_names`, `gguf_names`: lmforge name -> theirs; "{i}" the
  layer; the tables records combine are in `shared.py`). `post_attention_layernorm` is Llama's
  norm *before* the MLP but Gemma's and OLMo 2's norm *after* attention: every name map is the
  family's own;
- the mechanisms it fixes (`fixed`: ModelConfig field -> value) and those its config.json may
  set (`settable`); `family_of` picks the family of a model by them, both for export and for
  refusing what no family represents;
- its config.json both ways: the builder (`hf_config_out`), transformers' defaults of its config
  class (`hf_defaults`), and the hooks that read what only it has (`hf_layer_kinds`,
  `hf_rope_in`, `hf_mechanisms_in`, `hf_refuse`; the shared reading is `hf_config_in`);
- llama.cpp: what its runtime hard-codes for the architecture (`llama_cpp`: `LlamaCppArch`), the
  storage rules (`gguf_norm_shift`: Gemma's GGUF norms hold 1 + w; `gguf_permute_qk`: the
  `llama` architecture rotates adjacent pairs, so q/k rows are permuted), and the config.json
  of a file read back (`gguf_in_keys`, `gguf_in_config`);
- its chat template and end of turn for a model whose files carry none (the common Gemma 3 270M
  GGUF; a transformers folder saved without one): `chat_template_of` hands them to the tokenizer
  import that `import-hf` and `import-gguf` (through import-hf) share, so both doors give a model the
  same chat format; a family without one gets lmforge's ChatML.

Adding a family is one module here, its line in `FAMILIES` below, and its tests
(docs/where-changes-go.md); a mechanism no family has yet is one `ModelConfig` field with its one
code site in lmforge/model.
"""

from __future__ import annotations

from lmforge.config import ModelConfig
from lmforge.export.families import gemma2, gemma3, granite, llama, mistral, olmo2, phi3, qwen2, qwen3, smollm3
from lmforge.export.families.gemma import GEMMA_CHAT_TEMPLATE
from lmforge.export.families.record import MECHANISMS, Family, Fused, HfIn, LlamaCppArch
from lmforge.tokenizer import FamilyTemplate

#: model_type -> record; the order is `family_of`'s (Llama first: a model two families carry is
#: exported as the first)
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma3.FAMILY, gemma2.FAMILY, olmo2.FAMILY,
    smollm3.FAMILY, granite.FAMILY, phi3.FAMILY)}

#: llama.cpp's runtime, by `general.architecture` (the first record of each architecture says it;
#: every `Family.gguf_arch` has an entry)
LLAMA_CPP_ARCHS: dict[str, LlamaCppArch] = {}
for _family in FAMILIES.values():
    if _family.gguf_arch and _family.llama_cpp is not None:
        LLAMA_CPP_ARCHS.setdefault(_family.gguf_arch, _family.llama_cpp)


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
    """The family a model is exported as: the one `model.family` names (import-hf and import-gguf
    set it to the family imported), or, when it names none, the first of FAMILIES (Llama first)
    that carries every mechanism the model sets.

    Raises:
        ExportError: `model.family` names no family, or one that cannot carry the model's
        mechanisms (named); no family represents the model, naming what each closest family lacks.
    """
    from lmforge.export.options import ExportError

    if model.family:
        family = FAMILIES.get(model.family)
        if family is None:
            raise ExportError(f"model.family = {model.family!r}: expected one of {', '.join(map(repr, FAMILIES))}, or "
                              f"\"\" for the first family that carries the model's mechanisms. Fix [model] family in "
                              f"the checkpoint's config.toml.")
        bad = fits(family, model)
        if bad:
            raise ExportError(f"model.family = {model.family!r}: {family.architecture} cannot carry this model's "
                              f"{', '.join(bad)}. Set [model] family = \"\" in the checkpoint's config.toml to export "
                              f"it as the first family that does.")
        return family
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


__all__ = ["FAMILIES", "Family", "Fused", "GEMMA_CHAT_TEMPLATE", "HfIn", "LLAMA_CPP_ARCHS", "LlamaCppArch", "MECHANISMS",
           "by_architecture", "by_gguf_arch", "chat_template_of", "family_of", "fits"]
