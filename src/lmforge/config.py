"""Typed configuration: dataclasses, TOML loading, dotted overrides, validation.

One `Config` is the source of truth for a run. It is loaded from a TOML recipe
(`configs/*.toml`), patched by repeatable `--set section.key=value` overrides,
validated before any work, and written back as `config.toml` into every output
folder. Reading is strict: an unknown section or key, or a value of the wrong
type, is a `ConfigError` naming the key (with a close-match suggestion).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from lmforge.errors import ConfigError, os_advice
from lmforge.fileio import path_from_text, path_text, write_text

#: The resolved config, written into every output folder and checkpoint.
CONFIG_FILE = "config.toml"
#: The most tokens one optimizer step may take on one data-parallel rank (micro-batch x accumulation
#: x seq_len; the global batch x seq_len for an automatic micro-batch).
MAX_TOKENS_PER_STEP = 1 << 30
#: sft.max_chars / dpo.max_chars: 0 (no limit) or at least this many characters of prompt + body.
MIN_MAX_CHARS = 100
#: The largest tokenizer vocabulary lmforge trains or accepts (Gemma's is 256K; the BPE
#: trainer aborts the process on sizes near 2^31).
MAX_VOCAB = 1 << 22


@dataclass
class TokenizerConfig:
    vocab_size: int = 4096
    """Tokenizer vocabulary size, special tokens included (4096: best bits per byte per CPU
    minute for the default model, bench/RESULTS.md)."""
    dir: str = "runs/tokenizer"
    """Folder of the trained tokenizer (tokenizer.json, tokenizer_config.json, contract.json)."""
    max_train_bytes: int = 0
    """Train the BPE on at most this many bytes of text (0 = all)."""
    eos_token: str = ""
    """import-tokenizer / import-hf: the token that ends a document, for a tokenizer whose
    eos_token ends a chat turn and whose vocabulary has no known document terminator ("" =
    derived: the declared eos_token, or <|endoftext|>, <|end_of_text|>, </s>, <eos>)."""


@dataclass
class DataConfig:
    source: str = "stdlib"
    """"stdlib" (the running interpreter's standard library), or a path to a folder
    of .txt/.md/.py files, a JSONL file with a `text` field, or a Parquet file."""
    dir: str = "runs/data"
    """Folder of the prepared shards ({split}.bin, {split}.idx, contract.json)."""
    seq_len: int = 256
    """Tokens per training row."""
    document_masking: bool = True
    """Attend only within a document (block-diagonal causal mask) and reset positions."""
    val_fraction: float = 0.02
    """Fraction of documents (by module / file / record hash) held out for validation."""
    include_tests: bool = False
    """stdlib only: keep `test`/`tests` folders (excluded by default)."""
    on_bad_utf8: str = "skip"
    """A file that is not UTF-8: "skip" (counted and reported) or "error"."""


@dataclass
class ModelConfig:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 0
    """0 = derived from the tokenizer's contract (always, in practice). A value set by
    hand must be at least the tokenizer's vocab size; it is rounded up to a multiple of 64."""
    ffn_dim: int = 0
    """0 = derived: 8/3 * dim rounded up to a multiple of 64 (Llama's SwiGLU rule)."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qk_norm: bool = True
    """RMSNorm over each head's q and k before the rotary embedding (Qwen3's layout; exported
    as Qwen3ForCausalLM)."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2's layout; imported models only)."""
    rope_scaling: str = "none"
    """"none" (plain RoPE) or "llama3" (Llama 3.1's frequency scaling, the four rope_* keys
    below; imported models only)."""
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    """llama3 scaling: the context length the model was first trained for."""
    attention: str = "auto"
    """"auto" (flex on CUDA, sdpa elsewhere), "sdpa" or "flex"."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def resolved_ffn_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        return _round_up(int(8 * self.dim / 3), 64)


@dataclass
class TrainConfig:
    init: str = ""
    """Continued pretraining: a checkpoint to start from (its [model] and weights; its
    tokenizer must be tokenizer.dir's). Empty: from random weights (train.zero_init)."""
    steps: int = 600
    micro_batch_size: int = 16
    """Rows per micro-batch; "auto" (stored as 0, AUTO_MICRO_BATCH): the largest that fits this
    machine's available memory, with train.global_batch_size kept by the accumulation
    (lmforge.train.plan.auto_micro_batch; the resolved numbers go into the run's config.toml)."""
    grad_accum_steps: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.0
    """The schedule decays to lr * min_lr_ratio."""
    warmup_steps: int = 50
    schedule: str = "wsd"
    """"cosine" (warmup + cosine) or "wsd" (warmup-stable-decay)."""
    decay_fraction: float = 0.5
    """wsd only: the fraction of steps spent in the final linear decay."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    zero_init: bool = True
    """Pretraining starts the residual projections (attention wo, MLP w2) and an untied output
    head at zero (modded-nanogpt). An initialisation only: the model is the same architecture;
    `Transformer(config)` itself stays randomly initialised."""
    optimizer: str = "muon"
    """"adamw", or "muon": Muon for the 2-D matrices of the blocks and AdamW for the
    embedding, the head and the norms (lmforge.train.optim.MuonAdamW)."""
    muon_lr_scale: float = 1.0
    """muon only: the blocks' matrices step with lr * muon_lr_scale (the update is scaled to
    AdamW's RMS, so 1.0 reuses the AdamW learning rate)."""
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    """muon only: Newton-Schulz iterations per update."""
    embed_lr_scale: float = 1.0
    """muon only: the embedding's AdamW lr is lr * embed_lr_scale."""
    head_lr_scale: float = 1.0
    """muon only: the output head's AdamW lr is lr * head_lr_scale."""
    seed: int = 1337
    precision: str = "auto"
    """"auto" (bf16 autocast where the device has bf16 units, else fp32), "bf16" or "fp32"."""
    data_parallel: str = "ddp"
    """"ddp" or "fsdp" (used when launched through torchrun with several ranks)."""
    context_parallel: int = 1
    """Context-parallel degree: ranks that split one sequence. The world size (ranks torchrun
    starts) = data-parallel degree x context_parallel. Only 1 is implemented yet."""
    global_batch_size: int = 0
    """Rows per optimizer step over all ranks (0 = derived: micro_batch_size x grad_accum_steps x
    data-parallel degree). Set it to pin the global batch: a launch on another number of ranks
    is then an error that says which grad_accum_steps keeps it."""
    compile: bool = False
    checkpoint_every: int = 0
    """Write a checkpoint every N steps (0 = only at the end)."""
    keep_last: int = 2
    """Keep the newest K checkpoints (0 = keep all)."""
    eval_every: int = 0
    """Validation loss every N steps (0 = only at the end)."""
    eval_tokens: int = 65536
    """Tokens of the validation split used by periodic validation (0 = all)."""
    log_every: int = 10
    time_limit_s: float = 0.0
    """Stop (with a checkpoint) after this many seconds of training (0 = no limit)."""
    time_budget_s: float = 0.0
    """Pretraining only: seconds of optimizer steps to plan the run for (0 = off: train.steps).
    At the start of a new run a few steps are timed on a throw-away copy (as `--dry-run` does)
    and train.steps becomes budget / the median step time, so the schedule's warm-up and decay
    fit the machine; the step count is written to the run's config.toml, and `--resume` keeps
    it (no new measurement), so a resumed run stays exact. Validation and checkpoints are not
    counted in the budget."""
    tensorboard: bool = False
    """Also write the metrics, the health warnings and the config as TensorBoard events into
    the run folder's `tensorboard/` (needs the tensorboard package: lmforge[tensorboard])."""


@dataclass
class TuningConfig:
    """The keys every fine-tuning section shares ([sft], [dpo], and those to come), declared once
    with their bounds (TUNING_BOUNDS) and resume rules (`train.resume.tuning_rules`): the
    checkpoint to start from, the data, and the [train] values the run takes from its section
    (`stages.tuning.TUNING_TRAIN_KEYS`: steps, micro_batch_size, grad_accum_steps, lr,
    warmup_steps; every other [train] key applies as it is)."""

    init: str = ""
    """Checkpoint folder to start from (a run folder or one of its step_NNNNNN folders)."""
    data: str = "stdlib"
    """"stdlib" (derived from the standard library) or a JSONL/Parquet file (see the section)."""
    steps: int = 150
    """Optimizer steps."""
    micro_batch_size: int = 8
    """Items (conversations, pairs) per micro-batch."""
    grad_accum_steps: int = 1
    lr: float = 1e-3
    warmup_steps: int = 10
    max_examples: int = 0
    """Train on at most this many items (0 = all), chosen by a stable hash."""
    val_examples: int = 0
    """Validate on at most this many held-out items (0 = all)."""
    max_chars: int = 900
    """stdlib only: leave out functions whose prompt + body exceed this many characters (0 = no limit)."""


@dataclass
class SFTConfig(TuningConfig):
    """The [sft] section: supervised fine-tuning of `init` (a pretraining run) on conversations:
    `data` is "stdlib" (functions of the standard library) or a JSONL/Parquet file of them."""

    max_examples: int = 2000
    val_examples: int = 200
    packing: bool = False
    """Pack conversations with document masking instead of right-padding one per row."""


@dataclass
class DPOConfig(TuningConfig):
    """The [dpo] section: direct preference optimisation (Rafailov et al. 2023, arXiv
    2305.18290) of `init` (usually an SFT run, also the reference model) on preference pairs
    (see lmforge.stages.dpo): `data` is "stdlib" (standard-library functions against a mutated
    copy) or a JSONL/Parquet file of pairs in TRL's explicit ({prompt, chosen, rejected}) or
    implicit ({chosen, rejected}) form; `micro_batch_size` counts pairs (two rows each)."""

    steps: int = 100
    lr: float = 1e-4
    """DPO's learning rate. The paper's 1e-6 (and TRL's default) is for billion-parameter models;
    on the speedrun's 5M-parameter SFT model 1e-5 moved nothing in 150 steps and 5e-4 tripled the
    drift of the SFT loss (bench/RESULTS.md, 2026-11-24)."""
    beta: float = 0.1
    """The pull towards the reference (paper default 0.1; IPO's tau)."""
    loss: str = "sigmoid"
    """"sigmoid" (DPO, eq. 7), "ipo" (Azar et al. 2023, arXiv 2310.12036), or without a reference
    model: "simpo" (Meng et al. 2024, arXiv 2405.14734: beta is SimPO's beta, e.g. 2) and "orpo"
    (Hong et al. 2024, arXiv 2403.07691: the SFT loss on the chosen reply + beta (ORPO's lambda,
    0.1) x the odds-ratio term)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (dpo.loss = "simpo" only)."""
    reference: str = "live"
    """"live": the reference's log-probabilities are computed at every step (LoRA: the same
    model with its adapters disabled; full fine-tuning: a frozen copy); "precomputed": once for
    every pair before training (no second model; the same numbers)."""


#: `dpo.loss`'s choices (lmforge.model.loss dispatches on them).
DPO_LOSS_CHOICES = ("sigmoid", "ipo", "simpo", "orpo")
#: Every text field with a fixed set of values, and its values; the tables that dispatch on them
#: (attention backends, dpo losses, optimizers, schedules) are held equal to these by
#: tests/test_config.py::test_every_dispatch_table_equals_its_fields_choices.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.attention": ("auto", "sdpa", "flex"),
    "model.rope_scaling": ("none", "llama3"),
    "data.on_bad_utf8": ("skip", "error"),
    "train.schedule": ("cosine", "wsd"),
    "train.optimizer": ("adamw", "muon"),
    "train.precision": ("auto", "bf16", "fp32"),
    "train.data_parallel": ("ddp", "fsdp"),
    "dpo.loss": DPO_LOSS_CHOICES,
    "dpo.reference": ("live", "precomputed"),
}
#: The fine-tuning sections (each a TuningConfig).
TUNING_SECTIONS = ("sft", "dpo")


#: The linear layers of the blocks LoRA can adapt (Meta's Llama names), and the default targets.
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
#: Linear maps read directly (the output head slices its weight; the embedding is a lookup, and a
#: tied head shares it): never LoRA targets.
LORA_REFUSED = ("output", "tok_embeddings")


@dataclass
class LoRAConfig:
    """The [lora] section: low-rank adapters (Hu et al. 2021, arXiv 2106.09685) on the blocks'
    linear layers, for `sft` (see lmforge.model.lora)."""

    rank: int = 0
    """Adapter rank r; 0 = off (full fine-tuning)."""
    alpha: float = 16.0
    """Scale numerator: the update is (alpha / rank) B A (alpha / sqrt(rank) with use_rslora).
    A fixed 16 (not 2 x rank), so that changing the rank does not silently change the
    learning rate of the update at rank 16 (scale 1)."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1) (PEFT's lora_dropout)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Which linear layers of every block take an adapter (any of wq wk wv wo w1 w2 w3)."""
    use_rslora: bool = False
    """Rank-stabilised scale alpha / sqrt(rank) (Kalajdzievski 2023, arXiv 2312.03732)."""


@dataclass
class SamplingConfig:
    """The [generate] section: how `generate`, `chat`, the speedrun's samples and the server
    sample (one config for all of them; command-line flags override single fields)."""

    max_new_tokens: int = 128
    temperature: float = 0.8
    top_k: int = 50
    """0 = no top-k filter."""
    top_p: float = 0.95
    """1.0 = no nucleus filter."""
    repetition_penalty: float = 1.0
    """1.0 = none; > 1 discourages tokens already in the prompt or the output."""
    greedy: bool = False
    """argmax decoding (also when temperature == 0)."""

    def override(self, **values) -> "SamplingConfig":
        """A copy with `values` set, skipping those that are None (command-line flags not
        given keep the config's value)."""
        return dataclasses.replace(self, **{k: v for k, v in values.items() if v is not None})

    def validate(self, prefix: str = "generate.", names: dict[str, str] | None = None) -> "SamplingConfig":
        """Raises ConfigError naming the field (`prefix` + its name, or `names[name]`:
        "generate.top_p" for the config; "top_p", "max_tokens" for a server request), the
        value and the valid range; the error's `field` attribute is the name shown."""
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, ">= 0"),
            ("top_k", self.top_k >= 0, ">= 0 (0 = off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("repetition_penalty", math.isfinite(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 100,
             "in [0.01, 100]"),
        ]
        for name, ok, want in checks:
            if not ok:
                shown = (names or {}).get(name, name)
                default = f" (default {getattr(SamplingConfig(), name)!r})" if prefix == "generate." else ""
                err = ConfigError(f"{prefix}{shown} = {getattr(self, name)!r}: expected a value {want}{default}.")
                err.field = f"{prefix}{shown}"
                raise err
        for name in ("max_new_tokens", "temperature", "top_k"):
            shown = (names or {}).get(name, name)
            check_bounds(f"generate.{name}", getattr(self, name),
                         shown=None if prefix == "generate." else f"{prefix}{shown}")
        return self


@dataclass
class Config:
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    generate: SamplingConfig = field(default_factory=SamplingConfig)
    set_keys: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """The "section.key" names given with --set on this command line (not a section: never
    saved), for checks that must tell a value typed now from a default or a recipe's."""

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name != "set_keys"}

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


#: train.micro_batch_size = "auto", as stored.
AUTO_MICRO_BATCH = 0

#: The most optimizer steps any count of steps may name (train.steps, warmup, checkpoint_every, ...):
#: a hundred million, far beyond any run, so a slipped digit is caught before any work.
MAX_STEPS = 10**8
#: The longest sequence a model or a row may have (16M tokens).
MAX_SEQ_LEN = 1 << 24

#: Every number of the config and its range: (low, high, low_open, high_open). `validate` checks
#: each (after the checks with their own messages, which keep their wording) and the error names
#: the field, the value, the range and the default. tests/robustness/test_bounds_readers.py
#: asserts that every int and float field of every section has a row here.
BOUNDS: dict[str, tuple[float, float, bool, bool]] = {
    "tokenizer.vocab_size": (1, MAX_VOCAB, False, False),
    "tokenizer.max_train_bytes": (0, 1 << 50, False, False),  # 1 PiB of text
    "data.seq_len": (1, MAX_SEQ_LEN, False, False),
    "data.val_fraction": (0.0, 1.0, False, True),
    "model.dim": (1, 1 << 16, False, False),  # Llama 3 405B: 16384
    "model.n_layers": (1, 1024, False, False),  # Llama 3 405B: 126
    "model.n_heads": (1, 1 << 12, False, False),
    "model.n_kv_heads": (1, 1 << 12, False, False),
    "model.vocab_size": (0, MAX_VOCAB, False, False),
    "model.ffn_dim": (0, 1 << 20, False, False),
    "model.norm_eps": (0.0, 1.0, True, False),
    "model.rope_theta": (1.0, 1e12, True, False),  # Llama 3: 5e5; long-context models: up to ~1e8; <= 1: no rotation spread
    "model.max_seq_len": (1, MAX_SEQ_LEN, False, False),
    "model.rope_factor": (1.0, 1e6, False, False),  # llama3 rope scaling stretches (Llama 3.1: 8); 1 = none
    "model.rope_low_freq_factor": (0.0, 1e6, True, False),  # Llama 3.1: 1
    "model.rope_high_freq_factor": (0.0, 1e6, True, False),  # Llama 3.1: 4
    "model.rope_original_max_seq_len": (1, MAX_SEQ_LEN, False, False),  # Llama 3.1: 8192
    "train.steps": (1, MAX_STEPS, False, False),
    "train.micro_batch_size": (0, 1 << 20, False, False),  # 0: "auto"
    "train.grad_accum_steps": (1, 1 << 16, False, False),
    "train.lr": (0.0, 10.0, True, False),
    "train.min_lr_ratio": (0.0, 1.0, False, False),
    "train.warmup_steps": (0, MAX_STEPS, False, False),
    "train.decay_fraction": (0.0, 1.0, True, False),
    "train.weight_decay": (0.0, 1.0, False, False),  # decoupled: each step multiplies by 1 - lr x weight_decay
    "train.beta1": (0.0, 1.0, False, True),
    "train.beta2": (0.0, 1.0, False, True),
    "train.grad_clip": (0.0, 1e6, False, False),  # 0 = off
    "train.muon_lr_scale": (0.0, 100.0, True, False),  # 0 would freeze the blocks' matrices while they take a step
    "train.muon_momentum": (0.0, 1.0, False, True),  # 1 would never forget a gradient
    "train.muon_ns_steps": (1, 100, False, False),
    "train.embed_lr_scale": (0.0, 100.0, True, False),
    "train.head_lr_scale": (0.0, 100.0, True, False),
    "train.seed": (0, 2**63, False, True),
    "train.context_parallel": (1, 1 << 12, False, False),
    "train.global_batch_size": (0, 1 << 30, False, False),
    "train.checkpoint_every": (0, MAX_STEPS, False, False),
    "train.keep_last": (0, 10**6, False, False),
    "train.eval_every": (0, MAX_STEPS, False, False),
    "train.eval_tokens": (0, 1 << 50, False, False),
    "train.log_every": (1, MAX_STEPS, False, False),
    "train.time_limit_s": (0.0, 1e8, False, False),  # about three years
    "train.time_budget_s": (0.0, 1e8, False, False),
    # [sft], [dpo]: TUNING_BOUNDS, added below
    "lora.rank": (0, 1 << 16, False, False),
    "lora.alpha": (0.0, 1e6, True, False),
    "lora.dropout": (0.0, 1.0, False, True),
    "dpo.beta": (0.0, 1000.0, True, False),
    "dpo.simpo_gamma": (0.0, 100.0, False, False),
    "generate.max_new_tokens": (1, MAX_SEQ_LEN, False, False),
    "generate.temperature": (0.0, 1000.0, False, False),
    "generate.top_k": (0, MAX_VOCAB, False, False),
    "generate.top_p": (0.0, 1.0, True, False),
    "generate.repetition_penalty": (0.01, 100.0, False, False),
}


#: The bounds of TuningConfig's numbers, for every fine-tuning section (TUNING_SECTIONS).
TUNING_BOUNDS: dict[str, tuple[float, float, bool, bool]] = {
    "steps": (1, MAX_STEPS, False, False),
    "micro_batch_size": (1, 1 << 20, False, False),
    "grad_accum_steps": (1, 1 << 16, False, False),
    "lr": (0.0, 10.0, True, False),
    "warmup_steps": (0, MAX_STEPS, False, False),
    "max_examples": (0, 1 << 40, False, False),
    "val_examples": (0, 1 << 40, False, False),
    "max_chars": (0, 1 << 40, False, False),
}
BOUNDS.update({f"{section}.{key}": bound for section in TUNING_SECTIONS for key, bound in TUNING_BOUNDS.items()})


def check_bounds(name: str, value: float, shown: str | None = None) -> None:
    """Raise ConfigError unless `value` lies in BOUNDS[name] (a "section.key" name); the
    message names the field, the value, the range and the default. `shown`: the name to show
    instead (a server request's field, e.g. "max_tokens"; no default then); the error's
    `field` attribute is the name shown."""
    low, high, low_open, high_open = BOUNDS[name]
    ok = math.isfinite(value) and (low < value if low_open else low <= value) and (
        value < high if high_open else value <= high)
    if not ok:
        section, key = name.split(".", 1)
        default = f" (default {_default(section, key)!r})" if shown is None else ""
        err = ConfigError(f"{shown or name} = {value!r}: expected {low} {'<' if low_open else '<='} value "
                          f"{'<' if high_open else '<='} {high}{default}.")
        err.field = shown or name
        raise err


def _round_up(n: int, multiple: int) -> int:
    return int(math.ceil(n / multiple) * multiple)


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "set_keys"}
_SECTION_TYPES = {
    "tokenizer": TokenizerConfig,
    "data": DataConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "sft": SFTConfig,
    "lora": LoRAConfig,
    "dpo": DPOConfig,
    "generate": SamplingConfig,
}


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    if close:
        return f" Did you mean {close[0]!r}?"
    return f" Known: {', '.join(sorted(options))}."


def _coerce(section: str, key: str, value: Any, typ: type, where: str) -> Any:
    """Check `value` against the dataclass field type (int/float/bool/str); floats must be
    finite (NaN and infinity pass `x <= 0` checks and then fail deep inside torch)."""
    name = f"{section}.{key}"
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if name == "train.micro_batch_size" and value == "auto":
            return AUTO_MICRO_BATCH
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{where}: {name} = {value!r}: expected a finite number (default "
                                  f"{_default(section, key)!r}).")
            return float(value)
    elif typ is str:
        if isinstance(value, str):
            value = path_from_text(value)  # a path config.toml keeps as bytes (Config.to_toml)
            bad = next((c for c in value if 0 < ord(c) < 32 or ord(c) == 127), None)  # NUL: the path check says it
            if bad is not None:
                raise ConfigError(f"{where}: {name} = {value!r} holds the control character {bad!r} (a line break, a "
                                  f"tab, ...): every text field of the config is one line. Give the value on one line "
                                  f"(default {_default(section, key)!r}).")
            return value
    elif typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ)
        if isinstance(value, list) and all(isinstance(v, item) for v in value):
            return list(value)
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise ConfigError(
        f"{where}: {name} = {shown} has type {type(value).__name__}, expected {getattr(typ, '__name__', typ)}. "
        f"Fix the value (for example {name}={_default(section, key)!r}, the default)."
    )


def _default(section: str, key: str) -> Any:
    return getattr(_SECTION_TYPES[section](), key)


def _field_types(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def from_dict(raw: dict[str, Any], where: str = "config") -> Config:
    """Build a Config from nested dicts, strictly (unknown keys are errors)."""
    cfg = Config()
    for section, values in raw.items():
        if section not in _SECTION_TYPES:
            raise ConfigError(
                f"{where}: unknown section [{section}].{_suggest(section, list(_SECTION_TYPES))}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: [{section}] must be a table of keys, got {values!r}.")
        obj = getattr(cfg, section)
        types = _field_types(type(obj))
        for key, value in values.items():
            if key not in types:
                raise ConfigError(
                    f"{where}: unknown key {section}.{key}.{_suggest(key, list(types))}"
                )
            setattr(obj, key, _coerce(section, key, value, types[key], where))
    return cfg


def _parse_override_value(text: str) -> Any:
    """`--set` values are TOML literals; a bare word is taken as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        raise ConfigError(f"--set value {text[:40]!r}...: nested too deeply to read (Python's recursion limit). "
                          f"Give a plain value.") from None


def apply_overrides(cfg: Config, overrides: list[str] | None) -> Config:
    """Apply `section.key=value` strings (the repeatable `--set` flag)."""
    raw = cfg.to_dict()
    names: list[str] = []
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(
                f"--set {item!r}: expected section.key=value, for example --set train.steps=100."
            )
        dotted, text = item.split("=", 1)
        section, key = dotted.strip().split(".", 1)
        bad = next((c for c in item if 0 < ord(c) < 32 or ord(c) == 127), None)  # NUL: the path check says it
        if bad is not None:
            raise ConfigError(f"--set {item!r}: holds the control character {bad!r} (a line break, a tab, ...); a "
                              f"--set value is one line, e.g. --set train.steps=100.")
        if section not in raw:
            raise ConfigError(
                f"--set {item!r}: unknown section {section!r}.{_suggest(section, list(raw))}"
            )
        if key not in raw[section]:
            raise ConfigError(
                f"--set {item!r}: unknown key {section}.{key}.{_suggest(key, list(raw[section]))}"
            )
        value = _parse_override_value(text.strip())
        typ = _field_types(type(getattr(cfg, section)))[key]
        if typ is str and isinstance(value, (list, dict)):
            kind = "a list" if isinstance(value, list) else "a table"
            raise ConfigError(f"--set {item!r}: {section}.{key} is a text field, and {text.strip()!r} is {kind}. Give "
                              f"one value (default {_default(section, key)!r}); quote it (\"...\") if the brackets are "
                              f"part of it.")
        if typ is str and not isinstance(value, str):
            value = text.strip()  # e.g. --set sft.init=123 names a folder "123"
        raw[section][key] = value
        names.append(f"{section}.{key}")
    out = from_dict(raw, where="--set")
    out.set_keys = tuple(dict.fromkeys((*cfg.set_keys, *names)))
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a TOML recipe (or the defaults when `path` is None), apply overrides, validate.

    Raises:
        ConfigError: missing file, TOML syntax error, unknown key, wrong type, bad shape.
    """
    if path is None:
        cfg = Config()
    else:
        path = Path(path)
        try:
            is_file = path.is_file()
        except OSError as exc:  # e.g. a name too long for the file system
            shown = str(path) if len(str(path)) <= 80 else str(path)[:80] + "..."
            raise ConfigError(f"config file {shown}: cannot be read ({exc.strerror}); {os_advice(exc)}.") from None
        if not is_file:
            gone = "is a link to nothing or a symbolic link loop" if path.is_symlink() else "does not exist"
            raise ConfigError(
                f"config file {path} {gone}. Pass an existing recipe, "
                f"for example --config configs/stdlib-tiny.toml."
            )
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}. Fix the syntax.") from None
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply to read (Python's recursion limit); a recipe is sections "
                              f"of plain keys. Fix the file.") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); a TOML file is UTF-8. "
                              f"Re-save it as UTF-8.") from None
        except OSError as exc:
            raise ConfigError(f"config file {path}: cannot be read ({exc.strerror}); {os_advice(exc)}.") from None
        cfg = from_dict(raw, where=str(path))
    cfg = apply_overrides(cfg, overrides)
    cfg = apply_overlay(cfg, os.environ.get(OVERLAY_ENV))
    return validate(cfg)


#: An environment variable naming a TOML file whose keys are applied after `--config` and
#: `--set`: how tests/test_readme.py runs the README's commands, as written, on a tiny model.
OVERLAY_ENV = "LMFORGE_CONFIG_OVERLAY"
_overlay_said: set[str] = set()


def apply_overlay(cfg: Config, path: str | None) -> Config:
    """`cfg` with the keys of the TOML file `path` (the `LMFORGE_CONFIG_OVERLAY` environment
    variable) replaced; None or "" changes nothing. One line on stderr names the file and its keys
    (once per process), so a run never takes them silently.

    Raises:
        ConfigError: the file is missing, not TOML, or holds an unknown key or a wrong type.
    """
    if not path:
        return cfg
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as exc:
        raise ConfigError(f"{OVERLAY_ENV}={path}: cannot be read as a TOML file ({type(exc).__name__}: {exc}). Point it at a TOML "
                          f"file or unset it.") from None
    merged = cfg.to_dict()
    keys = []
    for section, values in raw.items():
        if not isinstance(values, dict) or section not in merged:
            raise ConfigError(f"{OVERLAY_ENV}={path}: [{section}] is not a config section.{_suggest(section, list(merged))}")
        merged[section].update(values)
        keys += [f"{section}.{k}" for k in values]
    out = from_dict(merged, where=f"{OVERLAY_ENV}={path}")
    out.set_keys = cfg.set_keys
    if path not in _overlay_said:
        _overlay_said.add(path)
        print(f"config: {OVERLAY_ENV}={path} sets {', '.join(keys)} (over --config and --set)", file=sys.stderr)
    return out


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(
            f"{name} = {value!r} is not one of {', '.join(map(repr, options))}.{_suggest(value, list(options))}"
        )


def _positive(name: str, value: float, allow_zero: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        section, key = name.split(".", 1)
        raise ConfigError(f"{name} = {value!r}: expected a value {bound} (default {_default(section, key)!r}).")


def _in_range(name: str, value: float, low: float, high: float, high_open: bool = True) -> None:
    ok = math.isfinite(value) and low <= value and (value < high if high_open else value <= high)
    if not ok:
        section, key = name.split(".", 1)
        raise ConfigError(f"{name} = {value!r}: expected {low} <= value {'<' if high_open else '<='} {high} "
                          f"(default {_default(section, key)!r}).")


def validate(cfg: Config) -> Config:
    """Validate shapes and choices (P7): every error says what to change. The checks that
    depend on the number of ranks are `check_parallel`'s, run by the training start-up."""
    m, d, t = cfg.model, cfg.data, cfg.train
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len", "norm_eps", "rope_theta"):
        _positive(f"model.{name}", getattr(m, name))
    for name in ("vocab_size", "ffn_dim"):
        _positive(f"model.{name}", getattr(m, name), allow_zero=True)
    _positive("tokenizer.vocab_size", cfg.tokenizer.vocab_size)
    _positive("tokenizer.max_train_bytes", cfg.tokenizer.max_train_bytes, allow_zero=True)
    _in_range("train.seed", t.seed, 0, 2**63)
    _in_range("tokenizer.vocab_size", cfg.tokenizer.vocab_size, 1, MAX_VOCAB + 1)
    for name, value in (("data.source", d.source), ("data.dir", d.dir), ("tokenizer.dir", cfg.tokenizer.dir)):
        if not value.strip():
            section, key = name.split(".")
            raise ConfigError(f"{name} is empty: expected a path (default {_default(section, key)!r}).")
    _in_range("train.beta1", t.beta1, 0.0, 1.0)
    _in_range("train.beta2", t.beta2, 0.0, 1.0)
    _in_range("train.min_lr_ratio", t.min_lr_ratio, 0.0, 1.0, high_open=False)
    cfg.generate.validate()
    if m.dim % m.n_heads:
        raise ConfigError(
            f"model.dim = {m.dim} is not divisible by model.n_heads = {m.n_heads}. "
            f"Choose n_heads dividing dim (for example {_divisor_near(m.dim, m.n_heads)})."
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads = {m.n_heads} is not divisible by model.n_kv_heads = {m.n_kv_heads} "
            f"(grouped-query attention shares each KV head among n_heads / n_kv_heads query heads). "
            f"Choose n_kv_heads dividing n_heads (for example {_divisor_near(m.n_heads, m.n_kv_heads)})."
        )
    if m.head_dim % 2:
        raise ConfigError(
            f"model.dim / model.n_heads = {m.head_dim} is odd; rotary embeddings need an even head size."
        )
    if m.rope_scaling == "llama3":
        for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len"):
            _positive(f"model.{name}", getattr(m, name))
        if not m.rope_high_freq_factor > m.rope_low_freq_factor:
            raise ConfigError(f"model.rope_high_freq_factor = {m.rope_high_freq_factor} must exceed "
                              f"model.rope_low_freq_factor = {m.rope_low_freq_factor} (llama3 rope scaling).")
    if d.seq_len < 1:
        raise ConfigError(f"data.seq_len = {d.seq_len}: expected at least 1.")
    if d.seq_len > m.max_seq_len:
        raise ConfigError(
            f"data.seq_len = {d.seq_len} exceeds model.max_seq_len = {m.max_seq_len}. "
            f"Lower data.seq_len or raise model.max_seq_len."
        )
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction = {d.val_fraction}: expected 0 <= value < 1.")
    for name in ("steps", "grad_accum_steps"):
        _positive(f"train.{name}", getattr(t, name))
    _positive("train.micro_batch_size", t.micro_batch_size, allow_zero=True)
    if t.micro_batch_size == AUTO_MICRO_BATCH and t.global_batch_size == 0:
        raise ConfigError('train.micro_batch_size = "auto" (or 0) needs train.global_batch_size (the rows of one optimizer '
                          'step, over all ranks) to keep: set it, e.g. --set train.global_batch_size=16.')
    _positive("train.lr", t.lr)
    for name in ("warmup_steps", "checkpoint_every", "keep_last", "eval_every", "eval_tokens",
                 "weight_decay", "grad_clip", "time_limit_s", "time_budget_s", "min_lr_ratio"):
        _positive(f"train.{name}", getattr(t, name), allow_zero=True)
    if t.log_every < 1:
        raise ConfigError(f"train.log_every = {t.log_every}: expected at least 1.")
    if not 0.0 < t.decay_fraction <= 1.0:
        raise ConfigError(f"train.decay_fraction = {t.decay_fraction}: expected 0 < value <= 1.")
    _positive("train.context_parallel", t.context_parallel)
    _positive("train.global_batch_size", t.global_batch_size, allow_zero=True)
    if t.context_parallel > 1 and d.seq_len % (2 * t.context_parallel):
        unit = 2 * t.context_parallel
        raise ConfigError(
            f"data.seq_len = {d.seq_len} is not divisible by 2 x train.context_parallel = {unit}: each "
            f"context-parallel rank takes two equal chunks of the sequence (load-balanced causal attention). "
            f"Set data.seq_len to a multiple of {unit} (for example {max(unit, d.seq_len // unit * unit)}) "
            f"or lower train.context_parallel."
        )
    for name in ("steps", "micro_batch_size", "grad_accum_steps", "lr"):
        _positive(f"sft.{name}", getattr(cfg.sft, name))
    for name in ("warmup_steps", "max_examples", "val_examples", "max_chars"):
        _positive(f"sft.{name}", getattr(cfg.sft, name), allow_zero=True)
    g = cfg.generate
    _positive("generate.max_new_tokens", g.max_new_tokens)
    _positive("generate.temperature", g.temperature, allow_zero=True)
    _positive("generate.top_k", g.top_k, allow_zero=True)
    if not 0.0 < g.top_p <= 1.0:
        raise ConfigError(f"generate.top_p = {g.top_p}: expected 0 < value <= 1.")
    check_lora(cfg.lora)
    tokens = (t.global_batch_size if t.micro_batch_size == AUTO_MICRO_BATCH else
              t.micro_batch_size * t.grad_accum_steps) * d.seq_len
    if tokens > MAX_TOKENS_PER_STEP:
        what = (f"train.global_batch_size {t.global_batch_size:,}" if t.micro_batch_size == AUTO_MICRO_BATCH else
                f"train.micro_batch_size {t.micro_batch_size:,} x train.grad_accum_steps {t.grad_accum_steps:,}")
        raise ConfigError(f"{what} x data.seq_len {d.seq_len:,} = {tokens:,} tokens per optimizer step (per "
                          f"data-parallel rank), above {MAX_TOKENS_PER_STEP:,} (2^30; the largest published runs "
                          f"take about 16 million): one step would never end. Lower the batch.")
    for name in (f"{section}.max_chars" for section in TUNING_SECTIONS):
        value = getattr(getattr(cfg, name.split(".")[0]), "max_chars")
        if 0 < value < MIN_MAX_CHARS:
            raise ConfigError(f"{name} = {value}: the prompt's instruction alone is 40 characters, so a limit under "
                              f"{MIN_MAX_CHARS} leaves out every function. Set 0 (no limit) or at least "
                              f"{MIN_MAX_CHARS} (default {_default(*name.split('.'))!r}).")
    for name, options in CHOICES.items():  # every text field with a fixed set of values
        section, key = name.split(".", 1)
        _choice(name, getattr(getattr(cfg, section), key), options)
    for name in BOUNDS:  # every number, both ends (the checks above keep their own wording)
        section, key = name.split(".", 1)
        check_bounds(name, getattr(getattr(cfg, section), key))
    return cfg


def model_from_init(cfg: Config, init_model: ModelConfig, key: str, init: str | Path) -> Config:
    """`cfg` with the [model] section of the checkpoint it starts from (`key`: "train.init",
    "sft.init", "dpo.init" = `init`). A `--set model.X` typed on this command line that
    disagrees with the checkpoint is refused, never silently dropped; `model.attention` (how
    attention is computed, not what the weights are) is the one typed field that applies.

    Raises:
        ConfigError: naming the field, both values and the checkpoint.
    """
    model = init_model
    for name in cfg.set_keys:
        if not name.startswith("model."):
            continue
        field_name = name.split(".", 1)[1]
        typed, theirs = getattr(cfg.model, field_name), getattr(init_model, field_name)
        if field_name == "attention":
            model = dataclasses.replace(model, attention=typed)
        elif typed != theirs:
            raise ConfigError(f"{name} = {typed!r} (--set), but {key} = {str(init)!r} has {name} = {theirs!r}: a run "
                              f"from a checkpoint keeps its [model] section (its weights have that shape). Remove "
                              f"--set {name}, or start from random weights without {key}.")
    return dataclasses.replace(cfg, model=model).validate()


def check_lora(lo: LoRAConfig) -> None:
    """The [lora] targets: known linear layers of the blocks, each once; never the output
    head or the embedding (read directly, and tied to each other in tied models).

    Raises:
        ConfigError: naming the target, the valid ones, and what to do.
    """
    if not lo.targets:
        raise ConfigError(f"lora.targets is empty: expected some of {list(LORA_TARGETS)} (default: all of them).")
    for t in lo.targets:
        if t in LORA_REFUSED:
            raise ConfigError(f"lora.targets names {t!r}: the output head and the embedding are never adapted "
                              f"(they are read directly, and a tied head shares the embedding). Choose among "
                              f"{list(LORA_TARGETS)}.")
        if t not in LORA_TARGETS:
            raise ConfigError(f"lora.targets names {t!r}, not a linear layer of the blocks: expected some of "
                              f"{list(LORA_TARGETS)}.{_suggest(t, list(LORA_TARGETS))}")
    if len(set(lo.targets)) != len(lo.targets):
        raise ConfigError(f"lora.targets = {lo.targets}: a target appears twice; list each once.")


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
