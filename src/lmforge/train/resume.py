"""What `--resume` checks before it loads anything: resume is exact, or refused.

A run continued with `--resume` must equal the run that would have been trained from step 0
with the new config, bit for bit on CPU (tests/test_resume.py). Three checks, all before a
weight, an optimizer state or an RNG state is loaded and before any file is written:

- `check_resume_config`: the saved `config.toml` against the new config, field by field,
  through ONE table (`RESUME_RULES`): every field of every section is listed once, refused
  (another value cannot continue the run exactly, and the message names the field, both
  values and why) or allowed (with the reason it is safe). tests/test_resume_checks.py
  fails when a config field is added without a row here.
- `check_optimizer_state`: `optimizer.pt` against the optimizer this run builds: its kind
  (AdamW, or Muon + AdamW), the param groups (count, members, hyperparameters), and every
  state tensor (keys, shape, dtype, finite; Muon's momentum buffers included).
- `check_rng_state`: `rng.pt`: every rank's torch / CUDA / numpy / Python generator state has
  the type and size its generator takes (tried on a scratch generator, never the global one).
Each refusal is a `CheckpointError` naming the file, the field and what to do.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmforge.config import Config
from lmforge.errors import CheckpointError
from lmforge.train.optim import STATE_KEYS, group_kind
from lmforge.train.schedule import lr_at

STAGES = ("pretrain", "sft", "dpo")
BOTH, PRE, SFT, DPO, TUNE = STAGES, ("pretrain",), ("sft",), ("dpo",), ("sft", "dpo")


@dataclass(frozen=True)
class ResumeRule:
    """One config field under `--resume`.

    `refused_in`: the stages (commands) in which another value is refused; in the others
    a change is allowed. `why`: why it is refused (the message says it), or, for a field
    refused nowhere, why a change is safe. `otherwise`: why a change is safe where the
    field is not refused (another stage, or a run `when` does not hold for). `schedule`: the
    field shapes the learning-rate schedule; another value is refused only when it changes
    the learning rate of a step already taken (`lr_at`, step by step). `per_rank`: compared
    times the data-parallel ranks (accumulation: the rows of an optimizer step are micro-batch
    x accumulation x ranks, `RowStream`). `when`: the rule applies only to runs (saved
    configs) for which it holds. `elsewhere`: compared by another check, named in `why`.
    `path`: a path, compared resolved (`runs/x/data` and `./runs/x/data` are one folder).
    """

    field: str
    refused_in: tuple[str, ...]
    why: str
    otherwise: str = ""
    schedule: bool = False
    per_rank: bool = False
    when: Callable[[Config], bool] | None = None
    elsewhere: bool = False
    path: bool = False


def _muon(cfg: Config) -> bool:
    return cfg.train.optimizer == "muon"


def _stdlib_sft(cfg: Config) -> bool:
    return cfg.sft.data == "stdlib"


def _stdlib_dpo(cfg: Config) -> bool:
    return cfg.dpo.data == "stdlib"


def _stdlib_tune(cfg: Config) -> bool:
    return _stdlib_sft(cfg) or _stdlib_dpo(cfg)


R = ResumeRule
_MODEL = "a different [model] section is another architecture than the saved weights and optimizer state"
_SCHEDULE = ("shapes the learning-rate schedule: refused when it changes the learning rate of a step already "
             "taken, allowed when it only moves what is still ahead (e.g. more steps while a wsd run has not "
             "begun its decay)")
_NO_PRE = "pretraining and DPO do not read [sft]"
_NO_DPO = "pretraining and SFT do not read [dpo]"
_SFT_OWN = "SFT and DPO train with their own section's value and compare that (sft.{key}, dpo.{key})"
_OPT = "an optimizer setting applied at every step, the steps taken included"
_MUON_ONLY = "AdamW runs (train.optimizer = 'adamw') do not read it"
_ACCUM = ("the rows of every optimizer step: compared as accumulation x data-parallel ranks, so a run continued "
          "on another number of ranks keeps its global batch (up to the float order of the sums)")
def tuning_rules(section: str, items: str, batch_items: str, init: str, val_rows: str) -> tuple[ResumeRule, ...]:
    """The rules of the keys every fine-tuning section shares (`config.TuningConfig`), for
    `section` ("sft", "dpo"), in that section's words: `items` what it trains on ("the
    conversations"), `batch_items` what a micro-batch holds, `init` what its init is, `val_rows`
    what validation writes."""
    here = (section,)
    no = f"pretraining and {'DPO' if section == 'sft' else 'SFT'} do not read [{section}]"
    one = items.removeprefix("the ")
    return (
        R(f"{section}.init", here, f"the {init}; compared as a resolved path by stages/tuning.py (check_same_init), "
          f"before the model is loaded", no, elsewhere=True),
        R(f"{section}.data", here, f"{items} trained on", no, path=True),
        R(f"{section}.steps", here, _SCHEDULE, no, schedule=True),
        R(f"{section}.micro_batch_size", here, f"the {batch_items} of every micro-batch and the order of the loss sum",
          no),
        R(f"{section}.grad_accum_steps", here, _ACCUM, no, per_rank=True),
        R(f"{section}.lr", here, _SCHEDULE, no, schedule=True),
        R(f"{section}.warmup_steps", here, _SCHEDULE, no, schedule=True),
        R(f"{section}.max_examples", here, f"which {one} are trained on", no),
        R(f"{section}.val_examples", (), f"the held-out {one} validated on ({val_rows})"),
        R(f"{section}.max_chars", here, "which standard-library functions are trained on",
          no + f"; {section.upper()} on a file does not read it",
          when=lambda cfg: getattr(cfg, section).data == "stdlib"),
    )


#: Every field of every config section, once (tests/test_resume_checks.py holds this).
RESUME_RULES: tuple[ResumeRule, ...] = (
    R("tokenizer.vocab_size", (), "read by train-tokenizer only; the tokenizer itself is compared through its "
      "contract (sha256, special ids), which --resume checks first"),
    R("tokenizer.dir", (), "the tokenizer in that folder is compared through its contract, which --resume checks "
      "first; the same tokenizer in another folder is the same tokenizer"),
    R("tokenizer.max_train_bytes", (), "read by train-tokenizer only"),
    R("tokenizer.eos_token", (), "read by import-hf / import-tokenizer only; the contract they wrote is compared"),
    R("data.source", (), "read by prepare only: pretraining reads the shards in data.dir, SFT and DPO read sft.data "
      "and dpo.data"),
    R("data.dir", PRE, "the shards the rows come from", "SFT and DPO do not read it", path=True),
    R("data.seq_len", BOTH, "the length of every row, so which tokens share a row and the data position"),
    R("data.document_masking", PRE, "the attention mask and positions of every row",
      "SFT and DPO do not read it (sft.packing decides; DPO's rows are right-padded)"),
    R("data.val_fraction", TUNE, "which conversations (or pairs) are trained on",
      "pretraining: read by prepare only (the split is in the shards)"),
    R("data.include_tests", TUNE, "which standard-library functions are trained on",
      "pretraining: read by prepare only; SFT and DPO on a file do not read it", when=_stdlib_tune),
    R("data.on_bad_utf8", (), "read by prepare only"),
    *(R(f"model.{k}", BOTH, _MODEL) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim",
                                               "norm_eps", "rope_theta", "max_seq_len", "tie_embeddings", "qk_norm",
                                               "qkv_bias", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                                               "rope_high_freq_factor", "rope_original_max_seq_len")),
    R("model.attention", BOTH, "the attention backends agree within float tolerance, not bit for bit"),
    R("train.init", PRE, "the weights the run started from; compared as a resolved path by stages/pretrain.py "
      "(check_same_init) before the model is loaded", "SFT and DPO start from sft.init / dpo.init", elsewhere=True),
    R("train.steps", PRE, _SCHEDULE, _SFT_OWN.format(key="steps"), schedule=True),
    R("train.micro_batch_size", PRE, "the rows of every micro-batch and the order of the loss sum",
      _SFT_OWN.format(key="micro_batch_size")),
    R("train.grad_accum_steps", PRE, _ACCUM, _SFT_OWN.format(key="grad_accum_steps"), per_rank=True),
    R("train.lr", PRE, _SCHEDULE, _SFT_OWN.format(key="lr"), schedule=True),
    R("train.min_lr_ratio", BOTH, _SCHEDULE, schedule=True),
    R("train.warmup_steps", PRE, _SCHEDULE, _SFT_OWN.format(key="warmup_steps"), schedule=True),
    R("train.schedule", BOTH, _SCHEDULE, schedule=True),
    R("train.decay_fraction", BOTH, _SCHEDULE, schedule=True),
    R("train.weight_decay", BOTH, _OPT),
    R("train.beta1", BOTH, _OPT),
    R("train.beta2", BOTH, _OPT),
    R("train.grad_clip", BOTH, _OPT + " (the norms of the steps taken are not known)"),
    R("train.zero_init", PRE, "the initial weights of the run", "SFT and DPO start from sft.init's / dpo.init's weights"),
    R("train.optimizer", BOTH, "another optimizer has another state"),
    R("train.muon_lr_scale", BOTH, _OPT, _MUON_ONLY, when=_muon),
    R("train.muon_momentum", BOTH, _OPT, _MUON_ONLY, when=_muon),
    R("train.muon_ns_steps", BOTH, _OPT, _MUON_ONLY, when=_muon),
    R("train.embed_lr_scale", BOTH, _OPT, _MUON_ONLY, when=_muon),
    R("train.head_lr_scale", BOTH, _OPT, _MUON_ONLY, when=_muon),
    R("train.seed", BOTH, "the initial weights and the order of the rows"),
    R("train.precision", BOTH, "the compute dtype of every step (and Muon's Newton-Schulz dtype)"),
    R("train.data_parallel", (), "how ranks share the same arithmetic: the checkpoint holds the full state by "
      "parameter name, whatever the layout (a change of the number of ranks is continued too, with a note)"),
    R("train.context_parallel", BOTH, "how each sequence is split over ranks"),
    R("train.global_batch_size", (), "a check of micro_batch_size x grad_accum_steps x ranks, which are compared "
      "themselves"),
    R("train.compile", BOTH, "compiled kernels fuse and reorder float operations: the steps differ in the last bits"),
    R("train.checkpoint_every", (), "when checkpoints are written, not what is computed"),
    R("train.keep_last", (), "how many checkpoints are kept, not what is computed"),
    R("train.eval_every", (), "validation runs without gradients on its own batches; it touches neither the "
      "training RNG nor the data position, only the val_loss rows"),
    R("train.eval_tokens", (), "how much validation data is scored (val_loss rows only), as train.eval_every"),
    R("train.log_every", (), "how often the progress bar prints"),
    R("train.tensorboard", (), "a copy of the metrics as TensorBoard events, not what is computed"),
    R("train.time_limit_s", (), "when to stop with a checkpoint; elapsed_s counts the whole run"),
    R("train.time_budget_s", PRE, "decided train.steps once, when the run started (the step count is in the "
      "run's config.toml and --resume keeps it); another budget would be another schedule",
      "SFT and DPO train sft.steps / dpo.steps (their [train] copy has no budget)"),
    *tuning_rules("sft", "the conversations", "rows", "checkpoint fine-tuned",
                  "val_loss rows and sft_val.jsonl only"),
    R("sft.packing", SFT, "how conversations are laid out in rows (and their attention)", _NO_PRE),
    *(R(f"lora.{k}", BOTH, "the adapters trained (their shapes, their scale, which layers carry them) and the "
        "parameters the optimizer state belongs to") for k in ("rank", "alpha", "dropout", "targets", "use_rslora")),
    *tuning_rules("dpo", "the pairs", "pairs", "checkpoint tuned and the reference", "val_* rows only"),
    R("dpo.beta", DPO, "the loss of every step, the steps taken included", _NO_DPO),
    R("dpo.loss", DPO, "the loss of every step, the steps taken included", _NO_DPO),
    R("dpo.simpo_gamma", DPO, "the loss of every step, the steps taken included", _NO_DPO),
    R("dpo.reference", DPO, "the reference's log-probabilities: computed live and precomputed they agree within "
      "float tolerance, not bit for bit", _NO_DPO),
    *(R(f"generate.{k}", (), "sampling only (generate, chat, serve, the speedrun's samples)")
      for k in ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "greedy")),
)


def _value(cfg: Config, field: str):
    section, key = field.split(".", 1)
    return getattr(getattr(cfg, section), key)


def check_resume_config(saved: Config, new: Config, stage: str, step: int, where: str | Path,
                        saved_world_size: int = 1, world_size: int = 1) -> list[str]:
    """Compare the run's saved config (`where`, its config.toml) with the new one, by
    `RESUME_RULES`, for a run of `stage` ("pretrain" or "sft") whose checkpoint is at `step`,
    written by `saved_world_size` ranks (rng.pt) and continued on `world_size`.

    Returns notes for the log (allowed schedule changes). For SFT both configs are the ones
    the trainer runs (`stages.sft.sft_config`: [train] steps, batch, lr, warmup from [sft]).

    Raises:
        CheckpointError: naming every refused field, the new and the saved value, and why.
    """
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r}: expected one of {STAGES}")
    refused, schedule = [], []
    for rule in RESUME_RULES:
        if stage not in rule.refused_in or rule.elsewhere or (rule.when is not None and not rule.when(saved)):
            continue
        old, now = _value(saved, rule.field), _value(new, rule.field)
        if rule.per_rank:
            old_dp = max(1, saved_world_size // saved.train.context_parallel)
            new_dp = max(1, world_size // new.train.context_parallel)
            if old * old_dp == now * new_dp:
                continue
            change = (f"{rule.field} = {now!r} on {new_dp} data-parallel rank(s) (the run has {old!r} on {old_dp}; "
                      f"set {rule.field} = {old * old_dp / new_dp:g} to keep its global batch, if it divides)")
            refused.append(f"{change}: {rule.why}")
            continue
        if old == now or (rule.path and os.path.realpath(old) == os.path.realpath(now)):
            continue
        change = f"{rule.field} = {now!r} (the run has {old!r})"
        if rule.schedule:
            schedule.append(change)
        else:
            refused.append(f"{change}: {rule.why}")
    if refused:
        raise CheckpointError(f"--resume: {where}: {'; '.join(refused)}. The run cannot be continued exactly with "
                              f"another value: resume with the run's values, or use another --out for a new run.")
    if not schedule:
        return []
    for s in range(step):  # the schedule is a pure function of the step: compare every step taken
        before, after = lr_at(s, saved.train), lr_at(s, new.train)
        if before != after:
            raise CheckpointError(
                f"--resume: {where}: {'; '.join(schedule)}: step {s + 1} of the run already took learning rate "
                f"{before:.8g}, and with the new value{'s' if len(schedule) > 1 else ''} it would be {after:.8g}. "
                f"A schedule change continues exactly only when it leaves the {step} steps taken as they were (e.g. "
                f"more train.steps before a wsd decay begins). Resume with the run's values, or use another --out.")
    return [f"{'; '.join(schedule)}: the learning rates of the {step} steps taken are unchanged, so the run "
            f"continues as if it had been started with the new value"]


# -- optimizer.pt ---------------------------------------------------------------------------------
#: Param-group entries that may differ from the optimizer being built: the trainer sets `lr` at every
#: step; Muon's `ns_dtype` follows the device's precision ("auto").
_FREE_GROUP_KEYS = {"params", "param_names", "lr", "ns_dtype"}


def _kinds(groups: list[dict]) -> str:
    return ", ".join(group_kind(g) for g in groups)


def check_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: object,
                          where: str | Path) -> None:
    """`state` (a full optimizer state keyed by parameter name, as `optimizer.pt` holds it)
    fits `optimizer`, built over `model`'s parameters: the same kind of optimizer, the same
    param groups (count, members, hyperparameters except `lr`), and for every parameter the
    state keys its update rule keeps (`lmforge.train.optim.STATE_KEYS`), each a finite tensor
    of the parameter's shape and dtype (the step count: a finite scalar >= 0).

    Raises:
        CheckpointError: naming `where`, the group or parameter and key, what was found and
        what was expected.
    """
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {what}. The file does not belong to this run (or is damaged); resume from "
                               f"another checkpoint, or use another --out for a new run.")

    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list) \
            or not isinstance(state.get("state"), dict):
        raise bad("not an lmforge optimizer state (expected {'state': {...}, 'param_groups': [...]} keyed by "
                  "parameter names)")
    saved_groups, built_groups = state["param_groups"], optimizer.param_groups
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved_groups):
        raise bad("a param group is not an object with a `params` list")
    names = {id(p): n for n, p in model.named_parameters()}
    kind = "Muon + AdamW (train.optimizer = 'muon')" if any(group_kind(g) == "muon" for g in built_groups) \
        else "AdamW (train.optimizer = 'adamw')"
    if len(saved_groups) != len(built_groups) or [group_kind(g) for g in saved_groups] != \
            [group_kind(g) for g in built_groups]:
        raise bad(f"holds the state of another optimizer: {len(saved_groups)} param group(s) of kind "
                  f"[{_kinds(saved_groups)}], but this run builds {kind} with {len(built_groups)} group(s) of kind "
                  f"[{_kinds(built_groups)}]")
    for i, (sg, bg) in enumerate(zip(saved_groups, built_groups)):
        members = [names[id(p)] for p in bg["params"]]
        if sorted(map(str, sg["params"])) != sorted(members):
            raise bad(f"param group {i} ({group_kind(bg)}) holds {len(sg['params'])} parameters, this run puts "
                      f"{len(members)} there (e.g. {members[:2]}); the optimizer is another one")
        keys = (set(sg) | set(bg)) - _FREE_GROUP_KEYS
        for key in sorted(keys):
            if key not in sg or key not in bg or sg[key] != bg[key]:
                raise bad(f"param group {i} ({group_kind(bg)}) has {key} = {sg.get(key, '(missing)')!r}, this run "
                          f"builds {bg.get(key, '(none)')!r} from its config")
    params = dict(model.named_parameters())
    saved_state = state["state"]
    for bg in built_groups:
        want = STATE_KEYS[group_kind(bg)]
        for p in bg["params"]:
            name = names[id(p)]
            entry = saved_state.get(name)
            if not isinstance(entry, dict):
                raise bad(f"no optimizer state for parameter {name!r} (found {type(entry).__name__}); expected "
                          f"{{{', '.join(want)}}}")
            if set(entry) != set(want):
                raise bad(f"parameter {name!r} has state keys {sorted(entry)}, the {group_kind(bg)} update keeps "
                          f"{sorted(want)}")
            for key, t in entry.items():
                shape, dtype = ((), None) if key == "step" else (tuple(params[name].shape), params[name].dtype)
                if not isinstance(t, torch.Tensor):
                    raise bad(f"{name!r} {key} is a {type(t).__name__}, expected a tensor")
                if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype) or not t.is_floating_point():
                    raise bad(f"{name!r} {key} has shape {tuple(t.shape)} and dtype {t.dtype}, expected shape {shape} "
                              f"and dtype {dtype or 'a float'} (the parameter's)")
                if not bool(torch.isfinite(t).all()) or (key == "step" and float(t) < 0):
                    what = "a negative step" if key == "step" else "NaN or infinite values"
                    raise bad(f"{name!r} {key} holds {what}")
    extra = sorted(set(map(str, saved_state)) - set(names.values()))
    if extra:
        raise bad(f"state for parameters this model does not have: {extra[:5]}")


# -- rng.pt ---------------------------------------------------------------------------------------
_TORCH_STATE_BYTES = torch.get_rng_state().numel()


def check_rng_state(rng: object, where: str | Path) -> list[dict]:
    """Every rank's RNG states in `rng` (rng.pt as `save_checkpoint` writes it: {"world_size":
    W, "ranks": [{"torch", "cuda", "numpy", "python"}, ...]}; an older single-rank file is the
    state itself), each checked by setting it on a scratch generator of its kind.

    Raises:
        CheckpointError: naming `where`, the rank and the generator, what was found and expected.
    """
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {what}. The file is damaged; resume from another checkpoint.")

    if not isinstance(rng, dict):
        raise bad(f"expected an object with `ranks`, found {type(rng).__name__}")
    ranks = rng.get("ranks", [rng])
    if not isinstance(ranks, list) or not ranks:
        raise bad(f"`ranks` is {type(ranks).__name__} {str(ranks)[:40]}, expected a non-empty list")
    if "world_size" in rng and rng["world_size"] != len(ranks):
        raise bad(f"world_size = {rng['world_size']!r} but {len(ranks)} rank state(s)")
    for i, r in enumerate(ranks):
        if not isinstance(r, dict) or not {"torch", "cuda", "numpy", "python"} <= set(r):
            raise bad(f"rank {i}: expected {{torch, cuda, numpy, python}} states, found "
                      f"{sorted(r) if isinstance(r, dict) else type(r).__name__}")
        t = r["torch"]
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or tuple(t.shape) != (_TORCH_STATE_BYTES,):
            raise bad(f"rank {i}: the torch state is {_describe(t)}, expected a uint8 tensor of "
                      f"{_TORCH_STATE_BYTES} bytes")
        if not isinstance(r["cuda"], list) or not all(isinstance(c, torch.Tensor) and c.dtype == torch.uint8
                                                       and c.dim() == 1 for c in r["cuda"]):
            raise bad(f"rank {i}: the CUDA states are {_describe(r['cuda'])}, expected a list of uint8 tensors")
        try:
            kind, keys, pos, has_gauss, gauss = r["numpy"]
            ok = isinstance(keys, torch.Tensor) and tuple(keys.shape) == (624,) and keys.dtype == torch.int64 \
                and bool(((keys >= 0) & (keys < 2**32)).all())
            if not ok:
                raise ValueError("keys: expected 624 int64 values in [0, 2^32)")
            np.random.RandomState().set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        except (TypeError, ValueError) as exc:
            raise bad(f"rank {i}: the numpy state is not an MT19937 state ({str(exc)[:80]})") from None
        try:
            version, internal, gauss_next = r["python"]
            if not isinstance(internal, (list, tuple)) or not all(type(x) is int for x in internal):
                raise TypeError("expected a list of integers")
            random.Random().setstate((version, tuple(internal), gauss_next))
        except (TypeError, ValueError, OverflowError) as exc:
            raise bad(f"rank {i}: the python state is not a random.getstate() state ({str(exc)[:80]})") from None
    return ranks


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


__all__ = ["RESUME_RULES", "ResumeRule", "check_optimizer_state", "check_resume_config", "check_rng_state"]
