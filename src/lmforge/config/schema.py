"""The `Config` of all sections, the tables derived from the fields' declarations (SECTIONS, BOUNDS,
CHOICES), and the checks before any work (P7): every field against its own declaration, then the
checks across fields (`validate`); those of one command's section (`check_lora`, `check_rl`); the
checks that need the number of ranks (`check_parallel`); a checkpoint's [model] against what was
typed (`model_from_init`)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from lmforge.config.core import (AUTO_MICRO_BATCH, MAX_TOKENS_PER_STEP, DataConfig, ModelConfig, TokenizerConfig,
                                 TrainConfig)
from lmforge.config.fields import Bound, check_number, declared, suggest
from lmforge.config.tuning import (DPOConfig, LoRAConfig, RLConfig, SamplingConfig, SFTConfig, TuningConfig,
                                   check_lora_targets)
from lmforge.errors import ConfigError
from lmforge.fileio import path_text, write_text


@dataclass
class Config:
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    generate: SamplingConfig = field(default_factory=SamplingConfig)
    set_keys: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """The "section.key" names given with --set on this command line (not a section: never
    saved), for checks that must tell a value typed now from a default or a recipe's."""
    overlay_keys: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """The "section.key" names the overlay (`LMFORGE_CONFIG_OVERLAY`, `overlay_path`) set on this
    command (not a section: never saved): the checks that refuse a --set refuse these too, naming
    the file."""
    overlay_path: str = field(default="", compare=False, repr=False)
    """The overlay file those keys came from ("" without one)."""

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in NOT_SECTIONS}

    def origin(self, name: str) -> str:
        """Where the value of `name` ("section.key") was given on this command, for a message:
        "LMFORGE_CONFIG_OVERLAY=FILE" when the overlay set it (it is applied last), "--set" when
        --set did, else ""."""
        if name in self.overlay_keys:
            return f"{OVERLAY_ENV}={self.overlay_path}"
        return "--set" if name in self.set_keys else ""

    def to_toml(self) -> str:
        """The config as TOML; a path whose bytes are not UTF-8 is kept through `fileio.path_text`
        (read back by `from_dict`)."""
        raw = {section: {k: path_text(v) if isinstance(v, str) else v for k, v in values.items()}
               for section, values in self.to_dict().items()}
        return tomli_w.dumps(raw)

    def save(self, path: str | Path) -> None:
        """Write the resolved config as TOML (atomically)."""
        write_text(path, self.to_toml())

    def validate(self) -> "Config":
        """Check shapes and choices before any work (P7). Returns self. (The parallel degrees,
        which need the world size, are checked by `check_parallel` at start-up.)"""
        validate(self)
        return self


#: The fields of `Config` that are not sections: what this command line typed, never saved.
NOT_SECTIONS = ("set_keys", "overlay_keys", "overlay_path")
#: The environment variable of the overlay (lmforge.config.load applies it).
OVERLAY_ENV = "LMFORGE_CONFIG_OVERLAY"
#: {section name: its class}, in the order of `Config`.
SECTIONS: dict[str, type] = {"tokenizer": TokenizerConfig, "data": DataConfig, "model": ModelConfig,
                             "train": TrainConfig, "sft": SFTConfig, "lora": LoRAConfig, "dpo": DPOConfig,
                             "rl": RLConfig,
                             "generate": SamplingConfig}
SECTION_TYPES = SECTIONS
#: The fine-tuning sections (each a TuningConfig).
TUNING_SECTIONS = tuple(s for s, cls in SECTION_TYPES.items() if issubclass(cls, TuningConfig))
#: Every number of the config and its range: (low, high, low_open, high_open), from the fields'
#: declarations. `validate` checks each; the error names the field, the value, the range and the
#: default. tests/robustness/test_bounds_readers.py asserts every int and float field has a row.
BOUNDS: dict[str, Bound] = {f"{s}.{k}": meta["bounds"] for s, cls in SECTION_TYPES.items()
                            for k, meta in declared(cls).items() if "bounds" in meta}
#: Every text field with a fixed set of values, and its values; the tables that dispatch on them
#: (attention backends, dpo losses, optimizers, schedules) are held equal to these by
#: tests/test_config.py::test_every_dispatch_table_equals_its_fields_choices.
CHOICES: dict[str, tuple[str, ...]] = {f"{s}.{k}": meta["choices"] for s, cls in SECTION_TYPES.items()
                                       for k, meta in declared(cls).items() if "choices" in meta}


def default_of(section: str, key: str) -> Any:
    return getattr(SECTION_TYPES[section](), key)


def check_bounds(name: str, value: float, shown: str | None = None) -> None:
    """Raise ConfigError unless `value` lies in BOUNDS[name] (a "section.key" name): see
    `fields.check_number`."""
    section, key = name.split(".", 1)
    check_number(SECTIONS[section], key, value, name, shown)


def check_field(cls: type, key: str, value: Any, name: str) -> None:
    """The field `key` of the section class `cls` (shown as `name`, "section.key") against its
    declaration (lmforge.config.fields): its range, its choices, not empty, its own check.

    Raises:
        ConfigError: naming the field, the value, what is expected and the default.
    """
    meta = cls.__dataclass_fields__[key].metadata
    if "bounds" in meta:
        check_number(cls, key, value, name)
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{name} = {value!r} is not one of {', '.join(map(repr, meta['choices']))}."
                          f"{suggest(value, list(meta['choices']))}")
    if meta.get("nonempty") and not value.strip():
        raise ConfigError(f"{name} is empty: expected a path (default {cls.__dataclass_fields__[key].default!r}).")
    if "check" in meta:
        meta["check"](name, value)


def _check_model_shape(m: ModelConfig) -> None:
    """The [model] fields against each other: heads divide dim, KV heads divide heads, an even head size."""
    if m.dim % m.n_heads and not m.head_dim:
        raise ConfigError(f"model.dim = {m.dim} is not divisible by model.n_heads = {m.n_heads}. Choose n_heads "
                          f"dividing dim (for example {_divisor_near(m.dim, m.n_heads)}).")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads = {m.n_heads} is not divisible by model.n_kv_heads = {m.n_kv_heads} "
                          f"(grouped-query attention shares each KV head among n_heads / n_kv_heads query heads). "
                          f"Choose n_kv_heads dividing n_heads (for example {_divisor_near(m.n_heads, m.n_kv_heads)}).")
    if m.resolved_head_dim() % 2:
        raise ConfigError(f"the head size (model.head_dim, or model.dim / model.n_heads) = {m.resolved_head_dim()} is "
                          f"odd; rotary embeddings need an even head size.")
    if m.layer_types and len(m.layer_types) != m.n_layers:
        raise ConfigError(f"model.layer_types has {len(m.layer_types)} entries for model.n_layers = {m.n_layers}: "
                          f"give one per layer, or [] (every layer full).")
    if "sliding" in m.layer_types and not m.sliding_window:
        raise ConfigError("model.layer_types has \"sliding\" layers but model.sliding_window = 0: set the window "
                          "(keys each sliding layer sees, its own included).")
    if m.sliding_window and "sliding" not in m.layer_types:
        raise ConfigError(f"model.sliding_window = {m.sliding_window} but model.layer_types = {m.layer_types!r} has no "
                          f"\"sliding\" layer, so the window would be read by no layer. Mark the layers that slide "
                          f"in model.layer_types, or set model.sliding_window = 0.")
    if m.rope_theta_sliding and not 1.0 < m.rope_theta_sliding:
        raise ConfigError(f"model.rope_theta_sliding = {m.rope_theta_sliding!r}: expected 0 (the sliding layers rotate "
                          f"as the full ones) or a RoPE base above 1, as model.rope_theta (a base <= 1 gives no spread "
                          f"of rotations).")
    if m.rope_theta_sliding and not m.own_sliding_rope():
        why = "has no \"sliding\" layer" if "sliding" not in m.layer_types else \
            "has \"sliding\" layers only among model.nope_layers, which skip RoPE"
        raise ConfigError(f"model.rope_theta_sliding = {m.rope_theta_sliding!r} but model.layer_types {why}, so no layer "
                          f"would rotate with it. Mark the layers that slide in model.layer_types, or set "
                          f"model.rope_theta_sliding = 0.")
    if m.nope_layers and max(m.nope_layers) >= m.n_layers:
        raise ConfigError(f"model.nope_layers = {m.nope_layers} names a layer past model.n_layers = {m.n_layers} "
                          f"(layers count from 0).")
    if m.rope_scaling == "llama3" and not m.rope_high_freq_factor > m.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor = {m.rope_high_freq_factor} must exceed "
                          f"model.rope_low_freq_factor = {m.rope_low_freq_factor} (llama3 rope scaling).")


def validate(cfg: Config) -> Config:
    """Validate shapes and choices (P7): every field by its declaration, then the checks across
    fields; every error says what to change. The checks that depend on the number of ranks are
    `check_parallel`'s, run by the training start-up."""
    cfg.generate.validate()  # the server's wording, shared
    for section, cls in SECTION_TYPES.items():
        for key in declared(cls):
            check_field(cls, key, getattr(getattr(cfg, section), key), f"{section}.{key}")
    _check_model_shape(cfg.model)
    m, d, t = cfg.model, cfg.data, cfg.train
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len = {d.seq_len} exceeds model.max_seq_len = {m.max_seq_len}. "
                          f"Lower data.seq_len or raise model.max_seq_len.")
    if d.sources and d.source != default_of("data", "source"):
        raise ConfigError(f"data.source = {d.source!r} and data.sources ({len(d.sources)} sources) are both set: a "
                          f"mixture reads data.sources only. Add {d.source!r} to data.sources (with its weight), or "
                          f"remove data.sources to prepare data.source alone.")
    if t.micro_batch_size == AUTO_MICRO_BATCH and t.global_batch_size == 0:
        raise ConfigError('train.micro_batch_size = "auto" (or 0) needs train.global_batch_size (the rows of one optimizer '
                          'step, over all ranks) to keep: set it, e.g. --set train.global_batch_size=16.')
    if t.context_parallel > 1 and d.seq_len % (2 * t.context_parallel):
        unit = 2 * t.context_parallel
        raise ConfigError(f"data.seq_len = {d.seq_len} is not divisible by 2 x train.context_parallel = {unit}: each "
                          f"context-parallel rank takes two equal chunks of the sequence (load-balanced causal "
                          f"attention). Set data.seq_len to a multiple of {unit} (for example "
                          f"{max(unit, d.seq_len // unit * unit)}) or lower train.context_parallel.")
    auto = t.micro_batch_size == AUTO_MICRO_BATCH
    tokens = (t.global_batch_size if auto else t.micro_batch_size * t.grad_accum_steps) * d.seq_len
    if tokens > MAX_TOKENS_PER_STEP:
        what = (f"train.global_batch_size {t.global_batch_size:,}" if auto else
                f"train.micro_batch_size {t.micro_batch_size:,} x train.grad_accum_steps {t.grad_accum_steps:,}")
        raise ConfigError(f"{what} x data.seq_len {d.seq_len:,} = {tokens:,} tokens per optimizer step (per "
                          f"data-parallel rank), above {MAX_TOKENS_PER_STEP:,} (2^30; the largest published runs "
                          f"take about 16 million): one step would never end. Lower the batch.")
    return cfg
def model_from_init(cfg: Config, init_model: ModelConfig, key: str, init: str | Path) -> Config:
    """`cfg` with the [model] section of the checkpoint it starts from (`key`: "train.init",
    "sft.init", "dpo.init" = `init`). A `--set model.X` typed on this command line, or a
    model.X of the overlay (`LMFORGE_CONFIG_OVERLAY`), that disagrees with the checkpoint is
    refused, never silently dropped; `model.attention` (how
    attention is computed, not what the weights are) is the one typed field that applies.

    Raises:
        ConfigError: naming the field, both values and the checkpoint.
    """
    model = init_model
    for name in dict.fromkeys((*cfg.set_keys, *cfg.overlay_keys)):
        if not name.startswith("model."):
            continue
        field_name = name.split(".", 1)[1]
        typed, theirs = getattr(cfg.model, field_name), getattr(init_model, field_name)
        if field_name == "attention":
            model = dataclasses.replace(model, attention=typed)
        elif typed != theirs:
            origin = cfg.origin(name)
            remove = f"--set {name}" if origin == "--set" else f"{name} from {origin}"
            raise ConfigError(f"{name} = {typed!r} ({origin}), but {key} = {str(init)!r} has {name} = {theirs!r}: a "
                              f"run from a checkpoint keeps its [model] section (its weights have that shape). Remove "
                              f"{remove}, or start from random weights without {key}.")
    return dataclasses.replace(cfg, model=model).validate()


def check_lora(lo: LoRAConfig) -> None:
    """The [lora] targets: known linear layers of the blocks, each once; never the output head or the
    embedding (`tuning.check_lora_targets`).

    Raises:
        ConfigError: naming the target, the valid ones, and what to do.
    """
    check_lora_targets("lora.targets", lo.targets)


def check_rl(cfg: Config) -> Config:
    """The [rl] section against the sections an `lmforge rl` run reads with it, before any work (the
    other commands leave [rl] alone, so `validate` does not ask this of them): a checkpoint to
    start from, no LoRA dropout (the loss must differentiate the distribution the completions
    were sampled from), and room for a prompt beside the completion in data.seq_len. Returns cfg.

    Raises:
        ConfigError: naming the field, its value and what to change.
    """
    rl, lo, seq_len = cfg.rl, cfg.lora, cfg.data.seq_len
    if not rl.init:
        raise ConfigError("rl.init is empty: set the checkpoint to train, e.g. --set rl.init=runs/sft (an SFT run "
                          "folder or one of its step_NNNNNN folders).")
    if lo.rank > 0 and lo.dropout > 0:
        raise ConfigError(f"lora.dropout = {lo.dropout}: the loss must differentiate the distribution the "
                          f"completions were sampled from, and dropout makes training another one. Set "
                          f"lora.dropout = 0 for rl.")
    if rl.max_new_tokens >= seq_len:
        raise ConfigError(f"rl.max_new_tokens = {rl.max_new_tokens} leaves no room for a prompt in data.seq_len "
                          f"= {seq_len} (a row is the prompt and its completion). Lower rl.max_new_tokens or "
                          f"raise data.seq_len.")
    return cfg


def world_size_from_env() -> int:
    """The number of ranks torchrun started (env WORLD_SIZE; 1 without torchrun).

    Raises:
        ConfigError: WORLD_SIZE is set but not a positive integer.
    """
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        world = 0
    if world < 1:
        raise ConfigError(f"environment variable WORLD_SIZE = {raw!r}: expected a positive integer "
                          f"(torchrun sets it). Unset it to run one process.")
    return world


def check_parallel(cfg: Config, world_size: int) -> Config:
    """The one check of the parallel degrees against the number of ranks, run once at start-up
    (`lmforge.train.distributed.init_distributed`) before any process group or any work:
    `validate_parallel`, then what a valid configuration asks that lmforge does not run yet.

    Raises:
        ConfigError: see `validate_parallel`; train.context_parallel > 1 (not implemented).
    """
    validate_parallel(cfg, world_size)
    cp = cfg.train.context_parallel
    if cp > 1:
        raise ConfigError(
            f"train.context_parallel = {cp}: the configuration is valid, but context parallelism is not "
            f"implemented yet (torch's context-parallel API needs CUDA). Set train.context_parallel = 1; "
            f"every rank then does data parallelism (world size = data-parallel degree)."
        )
    return cfg


def validate_parallel(cfg: Config, world_size: int) -> Config:
    """The checks that depend on the number of ranks, run at start-up before any work.

    world size = data-parallel degree x train.context_parallel; when train.global_batch_size
    is set it must be a multiple of micro_batch_size x data-parallel degree and equal
    micro_batch_size x grad_accum_steps x data-parallel degree.

    Raises:
        ConfigError: naming the keys, the values seen and the values that would work.
    """
    t = cfg.train
    cp = t.context_parallel
    if world_size < 1:
        raise ConfigError(f"world size = {world_size}: expected at least 1 rank.")
    if world_size % cp:
        fits = [x for x in range(1, world_size + 1) if world_size % x == 0]
        raise ConfigError(
            f"world size {world_size} (WORLD_SIZE, the ranks torchrun starts) is not divisible by "
            f"train.context_parallel = {cp}: world size = data-parallel degree x context-parallel degree. "
            f"Launch a multiple of {cp} ranks (torchrun --nproc-per-node {cp * max(1, world_size // cp)}) "
            f"or set train.context_parallel to one of {fits}."
        )
    dp = world_size // cp
    g = t.global_batch_size
    if t.micro_batch_size == AUTO_MICRO_BATCH:  # resolved at start-up (train.plan.auto_micro_batch)
        if g % dp:
            raise ConfigError(f"train.global_batch_size = {g} is not divisible by the {dp} data-parallel rank(s); "
                              f'train.micro_batch_size = "auto" splits it evenly. Set a multiple of {dp}.')
        return cfg
    if g:
        unit = t.micro_batch_size * dp
        if g % unit:
            raise ConfigError(
                f"train.global_batch_size = {g} is not divisible by train.micro_batch_size x data-parallel "
                f"degree = {t.micro_batch_size} x {dp} = {unit} (world size {world_size} / "
                f"train.context_parallel {cp}). Set train.global_batch_size to a multiple of {unit} "
                f"(for example {max(unit, g // unit * unit)}), or change train.micro_batch_size or the "
                f"number of ranks."
            )
        if g != unit * t.grad_accum_steps:
            raise ConfigError(
                f"train.global_batch_size = {g}, but train.micro_batch_size x train.grad_accum_steps x "
                f"data-parallel degree = {t.micro_batch_size} x {t.grad_accum_steps} x {dp} = "
                f"{unit * t.grad_accum_steps}. Set train.grad_accum_steps = {g // unit} to keep the global "
                f"batch on {world_size} rank(s), or set train.global_batch_size = 0."
            )
    return cfg


def _divisor_near(n: int, k: int) -> int:
    divisors = [x for x in range(1, n + 1) if n % x == 0]
    return min(divisors, key=lambda x: abs(x - k))
