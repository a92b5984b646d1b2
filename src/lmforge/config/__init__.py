"""Typed configuration: dataclasses, TOML loading, dotted overrides, validation.

One `Config` is the source of truth for a run. It is loaded from a TOML recipe
(`configs/*.toml`), patched by repeatable `--set section.key=value` overrides,
validated before any work, and written back as `config.toml` into every output
folder. Reading is strict: an unknown section or key, or a value of the wrong
type, is a `ConfigError` naming the key (with a close-match suggestion).

Each field is declared once (lmforge.config.fields): its default, its range or choices, its
`--resume` rule, its own check and, in the docstring below it, its help. The sections live in
`core` ([tokenizer], [data], [model], [train]) and `tuning` ([sft], [dpo], [rl], [lora], [generate]);
the `Config` of all sections, the tables derived from the declarations and the checks in
`schema`; reading (TOML, --set, the overlay) in `load`. This package is the one import surface.
"""

from lmforge.config.schema import (SECTION_TYPES, BOUNDS, CHOICES, SECTIONS, TUNING_SECTIONS, Config, default_of,
                                   check_bounds, check_field, check_lora, check_parallel, check_rl, model_from_init,
                                   validate, validate_parallel, world_size_from_env)
from lmforge.config.core import (AUTO_MICRO_BATCH, MAX_SEQ_LEN, MAX_STEPS, MAX_TOKENS_PER_STEP, MAX_VOCAB,
                                 DataConfig, ModelConfig, TokenizerConfig, TrainConfig)
from lmforge.config.fields import ResumeRule, declared, resume_rules
from lmforge.config.fields import suggest
from lmforge.config.load import (CONFIG_FILE, OVERLAY_ENV, coerce, field_types, apply_overlay, apply_overrides,
                                 from_dict, load_config, overlay_differences)
from lmforge.config.tuning import (DPO_LOSS_CHOICES, LORA_REFUSED, LORA_TARGETS, MIN_MAX_CHARS, RL_LOSS_TYPES,
                                   RL_REWARDS, DPOConfig, LoRAConfig, RLConfig, SamplingConfig, SFTConfig,
                                   TuningConfig)

__all__ = [
    "AUTO_MICRO_BATCH", "BOUNDS", "CHOICES", "CONFIG_FILE", "DPO_LOSS_CHOICES", "LORA_REFUSED", "LORA_TARGETS",
    "MAX_SEQ_LEN", "MAX_STEPS", "RL_LOSS_TYPES", "RL_REWARDS", "RLConfig", "MAX_TOKENS_PER_STEP", "MAX_VOCAB", "MIN_MAX_CHARS", "OVERLAY_ENV", "SECTIONS",
    "TUNING_SECTIONS", "Config", "DPOConfig", "DataConfig", "LoRAConfig", "ModelConfig", "ResumeRule",
    "SFTConfig", "SamplingConfig", "TokenizerConfig", "TrainConfig", "TuningConfig", "SECTION_TYPES", "coerce",
    "default_of", "field_types", "apply_overlay", "apply_overrides", "check_bounds", "check_field", "check_lora",
    "check_parallel", "check_rl", "declared", "from_dict", "load_config", "model_from_init", "overlay_differences", "resume_rules", "suggest",
    "validate", "validate_parallel", "world_size_from_env",
]
