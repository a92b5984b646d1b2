"""The sections of the stages that start from a checkpoint ([sft], [dpo], [rl] on one TuningConfig),
of LoRA, and of sampling ([generate]). Declared as in lmforge.config.core."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lmforge.config.core import ACCUM, MAX_SEQ_LEN, MAX_STEPS, MAX_VOCAB, OPTIMIZERS, SCHEDULE, SCHEDULES
from lmforge.config.fields import BOTH, DPO, HERE, RL, SFT, ResumeRule, again, allowed, choice, flag, items, num, \
    per_section, refused, suggest, text, check_number
from lmforge.errors import ConfigError

#: sft.max_chars / dpo.max_chars: 0 (no limit) or at least this many characters of prompt + body.
MIN_MAX_CHARS = 100
#: `dpo.loss`'s choices (lmforge.model.loss dispatches on them).
DPO_LOSS_CHOICES = ("sigmoid", "ipo", "simpo", "orpo")
#: The linear layers of the blocks LoRA can adapt (Meta's Llama names), and the default targets.
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
#: Linear maps read directly (the output head slices its weight; the embedding is a lookup, and a
#: tied head shares it): never LoRA targets.
LORA_REFUSED = ("output", "tok_embeddings")


def _check_max_chars(name: str, value: int) -> None:
    if 0 < value < MIN_MAX_CHARS:
        raise ConfigError(f"{name} = {value}: the prompt's instruction alone is 40 characters, so a limit under "
                          f"{MIN_MAX_CHARS} leaves out every function. Set 0 (no limit) or at least {MIN_MAX_CHARS} "
                          f"(default {getattr(TuningConfig(), 'max_chars')!r}).")


@per_section
def _stdlib_data(cfg, section: str) -> bool:
    return getattr(cfg, section).data == "stdlib"


def _tune(why: str, **flags) -> ResumeRule:
    return refused(HERE, why, "{no}", **flags)


@dataclass
class TuningConfig:
    """The keys every fine-tuning section shares ([sft], [dpo], and those to come), declared once
    with their bounds and resume rules (a subclass's WORDS put its rules in its own words): the
    checkpoint to start from, the data, and the [train] values the run takes from its section
    (`stages.tuning.TUNING_TRAIN_KEYS`: steps, micro_batch_size, grad_accum_steps, lr,
    warmup_steps, optimizer, schedule, compile; every other [train] key applies as it is). Each
    section's defaults are the settings its measured results came from (README, bench/RESULTS.md):
    the benchmarks run the command's own configuration and change only the seed and the time."""

    init: str = text("", _tune("the {init}; compared as a resolved path by stages/tuning.py (check_same_init), before "
                               "the model is loaded", elsewhere=True))
    """Checkpoint folder to start from (a run folder or one of its step_NNNNNN folders)."""
    data: str = text("stdlib", _tune("{items} trained on", path=True))
    """"stdlib" (derived from the standard library) or a JSONL/Parquet file (see the section)."""
    steps: int = num(150, 1, MAX_STEPS, _tune(SCHEDULE, schedule=True))
    """Optimizer steps."""
    micro_batch_size: int = num(8, 1, 1 << 20, _tune("the {batch_items} of every micro-batch and the order of the "
                                                     "loss sum"))
    """Items (conversations, pairs) per micro-batch."""
    grad_accum_steps: int = num(1, 1, 1 << 16, _tune(ACCUM, per_rank=True))
    lr: float = num(1e-3, 0.0, 10.0, _tune(SCHEDULE, schedule=True), low_open=True)
    warmup_steps: int = num(10, 0, MAX_STEPS, _tune(SCHEDULE, schedule=True))
    optimizer: str = choice("muon", OPTIMIZERS, _tune("another optimizer has another state"))
    """The stage's optimizer, as train.optimizer (not inherited from [train]: a tuning stage's
    learning rate is measured with its own optimizer)."""
    schedule: str = choice("wsd", SCHEDULES, _tune(SCHEDULE, schedule=True))
    """The stage's learning-rate schedule, as train.schedule (train.min_lr_ratio and
    train.decay_fraction apply as they are)."""
    compile: bool = flag(False, _tune("compiled kernels fuse and reorder float operations: the steps differ in the "
                                      "last bits"))
    """torch.compile the model for this stage (pretraining's is train.compile). Off by default: a
    fine-tuning run is short, and on the 2-core CPU the compile's one-time 34-39 s is more than it
    saves over the speedrun's 150 SFT steps (bench/RESULTS.md, "Packed SFT")."""
    max_examples: int = num(0, 0, 1 << 40, _tune("which {one} are trained on"))
    """Train on at most this many items (0 = all), chosen by a stable hash."""
    val_examples: int = num(0, 0, 1 << 40, allowed("the held-out {one} validated on ({val_rows})"))
    """Validate on at most this many held-out items (0 = all)."""
    max_chars: int = num(900, 0, 1 << 40, refused(
        HERE, "which standard-library functions are trained on", "{no}; {SECTION} on a file does not read it",
        when=_stdlib_data), check=_check_max_chars)
    """stdlib only: leave out functions whose prompt + body exceed this many characters (0 = no limit)."""


@dataclass
class SFTConfig(TuningConfig):
    """The [sft] section: supervised fine-tuning of `init` (a pretraining run) on conversations:
    `data` is "stdlib" (functions of the standard library) or a JSONL/Parquet file of them."""

    WORDS = dict(items="the conversations", one="conversations", batch_items="rows", init="checkpoint fine-tuned",
                 val_rows="val_loss rows and sft_val.jsonl only", no="the other stages do not read [sft]")
    micro_batch_size: int = again(TuningConfig, "micro_batch_size", 4)
    """Rows per micro-batch: 4 packed rows hold about the 8 conversations of 8 padded ones."""
    max_examples: int = again(TuningConfig, "max_examples", 2000)
    val_examples: int = again(TuningConfig, "val_examples", 200)
    packing: bool = flag(True, refused(SFT, "how conversations are laid out in rows (and their attention)",
                                       "the other stages do not read [sft]"))
    """Pack conversations into rows with document masking and per-conversation positions (exact:
    each conversation sees only itself, as alone in a row; TRL's padding-free packing), instead of
    right-padding one per row (false). Packed rows hold about twice the conversations of padded
    ones on the speedrun's data (padding 4.8% against 53.3%), so a packed micro-batch of 4 rows
    trains on as many conversations as a padded one of 8 (bench/RESULTS.md, "Packed SFT")."""


_NO_DPO = "the other stages do not read [dpo]"
_DPO_LOSS = refused(DPO, "the loss of every step, the steps taken included", _NO_DPO)


@dataclass
class DPOConfig(TuningConfig):
    """The [dpo] section: direct preference optimisation (Rafailov et al. 2023, arXiv
    2305.18290) of `init` (usually an SFT run, also the reference model) on preference pairs
    (see lmforge.stages.dpo): `data` is "stdlib" (standard-library functions against a mutated
    copy) or a JSONL/Parquet file of pairs in TRL's explicit ({prompt, chosen, rejected}) or
    implicit ({chosen, rejected}) form; `micro_batch_size` counts pairs (two rows each)."""

    WORDS = dict(items="the pairs", one="pairs", batch_items="pairs", init="checkpoint tuned and the reference",
                 val_rows="val_* rows only", no=_NO_DPO)
    steps: int = again(TuningConfig, "steps", 100)
    optimizer: str = again(TuningConfig, "optimizer", "adamw")
    """AdamW: DPO's figures (bench/bench_dpo.py) and its learning rate were measured with it."""
    schedule: str = again(TuningConfig, "schedule", "cosine")
    lr: float = again(TuningConfig, "lr", 1e-4)
    """DPO's learning rate. The paper's 1e-6 (and TRL's default) is for billion-parameter models;
    on the speedrun's 5M-parameter SFT model 1e-5 moved nothing in 150 steps and 5e-4 tripled the
    drift of the SFT loss (bench/RESULTS.md, 2026-11-24)."""
    beta: float = num(0.1, 0.0, 1000.0, _DPO_LOSS, low_open=True)
    """The pull towards the reference (paper default 0.1; IPO's tau)."""
    loss: str = choice("sigmoid", DPO_LOSS_CHOICES, _DPO_LOSS)
    """"sigmoid" (DPO, eq. 7), "ipo" (Azar et al. 2023, arXiv 2310.12036), or without a reference
    model: "simpo" (Meng et al. 2024, arXiv 2405.14734: beta is SimPO's beta, e.g. 2) and "orpo"
    (Hong et al. 2024, arXiv 2403.07691: the SFT loss on the chosen reply + beta (ORPO's lambda,
    0.1) x the odds-ratio term)."""
    simpo_gamma: float = num(0.5, 0.0, 100.0, _DPO_LOSS)
    """SimPO's target reward margin gamma (dpo.loss = "simpo" only)."""
    reference: str = choice("live", ("live", "precomputed"), refused(
        DPO, "the reference's log-probabilities: computed live and precomputed they agree within float tolerance, "
        "not bit for bit", _NO_DPO))
    """"live": the reference's log-probabilities are computed at every step (LoRA: the same
    model with its adapters disabled; full fine-tuning: a frozen copy); "precomputed": once for
    every pair before training (no second model; the same numbers)."""
    packing: bool = flag(True, refused(DPO, "how pairs are laid out in rows (the float sums of every step)", _NO_DPO))
    """Pack the sides of a micro-batch's pairs into as few rows as fit, each side its own
    attention segment with positions from 0 (exact: each side sees only itself, as alone in a
    row), instead of right-padding each side in a row of its own (false). A micro-batch holds
    the same pairs either way (`micro_batch_size` still counts pairs): the loss and the step are
    the same up to float rounding, the padding is gone (bench/RESULTS.md, "Packed DPO")."""


#: `rl.loss_type`'s choices: how the summed policy-gradient term is normalised (lmforge.train.rl).
RL_LOSS_TYPES = ("dr_grpo", "dapo", "grpo")
#: The rewards lmforge ships (the table lmforge.scorers.rewards.REWARDS, which holds the same names);
#: `rl.rewards` may also name "package.module:function".
RL_REWARDS = ("static", "doctests", "behaviour", "parses")
_NO_RL = "the other stages do not read [rl]"
_RL_LOSS = refused(RL, "the loss of every step, the steps taken included", _NO_RL)
_RL_ROLLOUT = refused(RL, "the rollouts of every step (what is sampled and how it is scored)", _NO_RL)


def _check_rewards(name: str, rewards: list[str]) -> None:
    if not rewards:
        raise ConfigError(f"{name} is empty: name at least one reward ({', '.join(RL_REWARDS)}, or "
                          f"\"package.module:function\").")
    for r in rewards:
        if r not in RL_REWARDS and (":" not in r or not all(part.strip() for part in r.split(":", 1))):
            raise ConfigError(f"{name} names {r!r}: expected one of {list(RL_REWARDS)} or \"package.module:function\" "
                              f"(a function of your own, TRL's calling convention).{suggest(r, list(RL_REWARDS))}")
    if len(set(rewards)) != len(rewards):
        raise ConfigError(f"{name} = {rewards}: a reward appears twice; list each once.")


@dataclass
class RLConfig(TuningConfig):
    """The [rl] section: reinforcement learning with verifiable rewards (a group-relative policy
    gradient: GRPO, Shao et al. 2024, arXiv 2402.03300, with Dr. GRPO's normalisation, Liu et al.
    2025, arXiv 2503.20783) of `init` (usually an SFT run) on prompts: `data` is "stdlib"
    (standard-library functions to write, scored by `rewards`) or a JSONL/Parquet file of
    {prompt | messages, any extra fields}; `micro_batch_size` counts prompts (group_size rows
    each). See lmforge.train.rl and lmforge.stages.rl; its checks against [lora] and [data] before a
    run: `config.check_rl`."""

    WORDS = dict(items="the prompts", one="prompts", batch_items="prompts", init="checkpoint tuned",
                 val_rows="val_* rows only", no=_NO_RL)
    steps: int = again(TuningConfig, "steps", 60)
    micro_batch_size: int = again(TuningConfig, "micro_batch_size", 4)
    lr: float = again(TuningConfig, "lr", 3e-5)
    """RL's learning rate. On the speedrun's SFT model (AdamW, static reward) 1e-4 lifted the held-out
    figure as far in 1 minute but cost 10% on the SFT loss; 3e-5 cost 2.5% in 2 minutes
    (bench/bench_rl.py, bench/RESULTS.md 2026-11-26). LoRA needs more: rank 16 at 3e-5 moved nothing
    in 60 steps, 2e-4 lifted the held-out figure 43% -> 64% at +1.0% on the SFT loss, 5e-4 to 100%
    at +27% (bench/RESULTS.md 2026-11-27)."""
    optimizer: str = again(TuningConfig, "optimizer", "adamw")
    """AdamW at a constant rate: the settings RL's figures are measured with. Muon and wsd from [train]
    at AdamW's 3e-5 (what the command took before) left the held-out parse rate at 33% after 60
    steps; AdamW at a constant rate reached 97% (3 seeds, bench/RESULTS.md 2026-11-27)."""
    schedule: str = again(TuningConfig, "schedule", "constant")
    warmup_steps: int = again(TuningConfig, "warmup_steps", 0)
    max_examples: int = again(TuningConfig, "max_examples", 2000)
    val_examples: int = again(TuningConfig, "val_examples", 64)
    group_size: int = num(8, 2, 1024, _RL_ROLLOUT)
    """G: completions sampled per prompt; the advantage is each one's reward minus its group's mean."""
    temperature: float = num(1.0, 0.0, 10.0, _RL_ROLLOUT, low_open=True)
    """Sampling temperature of the rollouts; the loss differentiates the same tempered distribution
    (no top-k, top-p or repetition penalty: they would make the sampled distribution another one)."""
    max_new_tokens: int = num(96, 1, 1 << 16, _RL_ROLLOUT)
    """The token budget of a completion; one cut off by it scores 0 (and is counted)."""
    rewards: list[str] = items(RL_REWARDS[:1], _RL_ROLLOUT, check=_check_rewards)
    """The reward functions, averaged over those that apply: "static" (parses under its signature,
    ends its turn, not trivial, every name resolves), "doctests" (its docstring examples pass, in
    lmforge.sandbox; applies to top-level functions), "behaviour" (returns what the real function
    returns on generated inputs, in lmforge.sandbox; applies to top-level functions callable with
    plain values), "parses" (parses under its signature and ends its turn: a format reward), or
    "package.module:function" (yours: called as TRL calls one, f(completions=[...], prompts=[...],
    **the prompt records' other fields) -> a number in [0, 1], or None, per completion)."""
    loss_type: str = choice("dr_grpo", RL_LOSS_TYPES, _RL_LOSS)
    """How the summed term is normalised: "dr_grpo" (by rows x max_new_tokens, a constant: no
    length bias), "dapo" (by the completion tokens of the step, Yu et al. 2025, arXiv 2503.14476)
    or "grpo" (each completion's mean over its tokens, then the mean over completions)."""
    beta: float = num(0.0, 0.0, 100.0, _RL_LOSS)
    """Weight of the k3 KL estimate to `init` (its adapters disabled under LoRA; a frozen copy
    otherwise); 0 = none, and no reference model is built."""
    reward_timeout_s: float = num(5.0, 0.1, 600.0, _RL_ROLLOUT)
    """Seconds a reward may take per completion: a sandboxed one (doctests, behaviour) is a TIMEOUT
    past it (scored 0); a call of a reward of yours on R completions may take R x this, after which
    the run stops (exit 2) naming it (the reward's own process is killed: nothing it does with
    signals or exceptions escapes the limit)."""
    packing: bool = flag(True, refused(RL, "how rollouts are laid out in rows (the float sums of every step)", _NO_RL))
    """Pack a micro-batch's rollouts (prompt + completion) into as few rows as fit, each its own
    attention segment with positions from 0 (exact: each sees only itself, as alone in a row),
    for the policy's and the reference's forward, instead of one rollout a right-padded row
    (false). The same rollouts, loss and step up to float rounding; the log's `padding` says
    the share of row slots that held none (bench/RESULTS.md, "Packed RL rollouts")."""


def check_lora_targets(name: str, targets: list[str]) -> None:
    """The [lora] targets: known linear layers of the blocks, each once; never the output
    head or the embedding (read directly, and tied to each other in tied models).

    Raises:
        ConfigError: naming the target, the valid ones, and what to do.
    """
    if not targets:
        raise ConfigError(f"{name} is empty: expected some of {list(LORA_TARGETS)} (default: all of them).")
    for t in targets:
        if t in LORA_REFUSED:
            raise ConfigError(f"{name} names {t!r}: the output head and the embedding are never adapted "
                              f"(they are read directly, and a tied head shares the embedding). Choose among "
                              f"{list(LORA_TARGETS)}.")
        if t not in LORA_TARGETS:
            raise ConfigError(f"{name} names {t!r}, not a linear layer of the blocks: expected some of "
                              f"{list(LORA_TARGETS)}.{suggest(t, list(LORA_TARGETS))}")
    if len(set(targets)) != len(targets):
        raise ConfigError(f"{name} = {targets}: a target appears twice; list each once.")


_LORA = refused(BOTH, "the adapters trained (their shapes, their scale, which layers carry them) and the parameters "
                "the optimizer state belongs to")


@dataclass
class LoRAConfig:
    """The [lora] section: low-rank adapters (Hu et al. 2021, arXiv 2106.09685) on the blocks'
    linear layers, for `sft` (see lmforge.model.lora)."""

    rank: int = num(0, 0, 1 << 16, _LORA)
    """Adapter rank r; 0 = off (full fine-tuning)."""
    alpha: float = num(16.0, 0.0, 1e6, _LORA, low_open=True)
    """Scale numerator: the update is (alpha / rank) B A (alpha / sqrt(rank) with use_rslora).
    A fixed 16 (not 2 x rank), so that changing the rank does not silently change the
    learning rate of the update at rank 16 (scale 1)."""
    dropout: float = num(0.0, 0.0, 1.0, _LORA, high_open=True)
    """Dropout on the adapter's input, in [0, 1) (PEFT's lora_dropout)."""
    targets: list[str] = items(LORA_TARGETS, _LORA, check=check_lora_targets)
    """Which linear layers of every block take an adapter (any of wq wk wv wo w1 w2 w3)."""
    use_rslora: bool = flag(False, _LORA)
    """Rank-stabilised scale alpha / sqrt(rank) (Kalajdzievski 2023, arXiv 2312.03732)."""


_SAMPLING = allowed("sampling only (generate, chat, serve, the speedrun's samples)")


@dataclass
class SamplingConfig:
    """The [generate] section: how `generate`, `chat`, the speedrun's samples and the server
    sample (one config for all of them; command-line flags override single fields)."""

    max_new_tokens: int = num(128, 1, MAX_SEQ_LEN, _SAMPLING)
    temperature: float = num(0.8, 0.0, 1000.0, _SAMPLING)
    top_k: int = num(50, 0, MAX_VOCAB, _SAMPLING)
    """0 = no top-k filter."""
    top_p: float = num(0.95, 0.0, 1.0, _SAMPLING, low_open=True)
    """1.0 = no nucleus filter."""
    repetition_penalty: float = num(1.0, 0.01, 100.0, _SAMPLING)
    """1.0 = none; > 1 discourages tokens already in the prompt or the output."""
    greedy: bool = flag(False, _SAMPLING)
    """argmax decoding (also when temperature == 0)."""
    compile: bool = flag(False, _SAMPLING)
    """torch.compile the decode step (`lmforge.model.decode.compiled_decode_step`) of `generate`,
    `chat` and reinforcement learning's rollouts, after a one-time compile of 8-25 s (inductor's
    cache warm: seconds). On the 2-core CPU (2026-11-27, the speedrun's model, fp32) it pays at
    batch 1 only: a step 0.46 against 0.72 ms eager on oneDNN's matmuls; at batch 8 1.78 against 1.06 ms and at 32
    3.99 against 2.30 ms, where the eager step runs oneDNN's prepacked matmuls; an RL rollout of
    32 rows took 0.69 s a step compiled against 0.47 s eager (bench/RESULTS.md). Off by default.
    The server keeps its eager batch-invariant step. Needs a C++ compiler on a CPU (without one:
    eager, said once)."""

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
            check_number(SamplingConfig, name, getattr(self, name), f"generate.{name}",
                         shown=None if prefix == "generate." else f"{prefix}{shown}")
        return self
