"""What `--resume` checks before it loads anything: resume is exact, or refused.

A run continued with `--resume` must equal the run that would have been trained from step 0
with the new config, bit for bit on CPU (tests/test_resume.py). Three checks, all before a
weight, an optimizer state or an RNG state is loaded and before any file is written:

- `check_resume_config`: the saved `config.toml` against the new config, field by field,
  through ONE table (`RESUME_RULES`, derived from each field's declaration in lmforge.config:
  the rule is written beside the field's default and range): every field is listed once, refused
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

import json
import math
import os
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from lmforge.config import OVERLAY_ENV, SECTIONS, Config
from lmforge.config.fields import STAGES, ResumeRule, resume_rules
from lmforge.errors import CheckpointError
from lmforge.fileio import write_text
from lmforge.model.io import all_finite
from lmforge.train.optim import STATE_KEYS, group_kind
from lmforge.train.schedule import lr_at

#: A run's metrics, one JSON row per logged step (and per validation), in its folder.
METRICS_FILE = "metrics.jsonl"
#: Every field of every config section, once, from the fields' declarations (lmforge.config.fields;
#: tests/test_resume_checks.py holds this).
RESUME_RULES: tuple[ResumeRule, ...] = tuple(rule for section, cls in SECTIONS.items()
                                             for rule in resume_rules(section, cls))


def _value(cfg: Config, field: str):
    section, key = field.split(".", 1)
    return getattr(getattr(cfg, section), key)


def check_resume_config(saved: Config, new: Config, stage: str, step: int, where: str | Path,
                        saved_world_size: int = 1, world_size: int = 1) -> list[str]:
    """Compare the run's saved config (`where`, its config.toml) with the new one, by
    `RESUME_RULES`, for a run of `stage` ("pretrain" or "sft") whose checkpoint is at `step`,
    written by `saved_world_size` ranks (rng.pt) and continued on `world_size`.

    The saved config is read as saved (never through the overlay); a refused value the overlay
    (`LMFORGE_CONFIG_OVERLAY`) set is named with the file, as a --set is refused.

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
            origin = new.origin(rule.field)
            shown = f", set by {origin}," if origin.startswith(OVERLAY_ENV) else ""
            change = (f"{rule.field} = {now!r}{shown} on {new_dp} data-parallel rank(s) (the run has {old!r} on {old_dp}; "
                      f"set {rule.field} = {old * old_dp / new_dp:g} to keep its global batch, if it divides)")
            refused.append(f"{change}: {rule.why}")
            continue
        if old == now or (rule.path and os.path.realpath(old) == os.path.realpath(now)):
            continue
        origin = new.origin(rule.field)  # the overlay's value is named with its file (a --set's is typed)
        shown = f", set by {origin}" if origin.startswith(OVERLAY_ENV) else ""
        change = f"{rule.field} = {now!r}{shown} (the run has {old!r})"
        if rule.schedule:
            schedule.append(change)
        else:
            refused.append(f"{change}: {rule.why}")
    overlay = f" (remove them from {OVERLAY_ENV}={new.overlay_path}, or unset it)" if new.overlay_keys and \
        any(f", set by {OVERLAY_ENV}=" in c for c in refused + schedule) else ""
    if refused:
        raise CheckpointError(f"--resume: {where}: {'; '.join(refused)}. The run cannot be continued exactly with "
                              f"another value: resume with the run's values{overlay}, or use another --out for a new "
                              f"run.")
    if not schedule:
        return []
    _check_steps_taken(saved, new, step, where, schedule, overlay)
    return [f"{'; '.join(schedule)}: the learning rates of the {step} steps taken are unchanged, so the run "
            f"continues as if it had been started with the new value"]


def _check_steps_taken(saved: Config, new: Config, step: int, where: str | Path, schedule: list[str],
                       overlay: str) -> None:
    """CheckpointError unless the changed schedule fields (`schedule`: their lines) leave the
    learning rate of each of the `step` steps taken as it was."""
    for s in range(step):  # the schedule is a pure function of the step: compare every step taken
        before, after = lr_at(s, saved.train), lr_at(s, new.train)
        if before != after:
            raise CheckpointError(
                f"--resume: {where}: {'; '.join(schedule)}: step {s + 1} of the run already took learning rate "
                f"{before:.8g}, and with the new value{'s' if len(schedule) > 1 else ''} it would be {after:.8g}. "
                f"A schedule change continues exactly only when it leaves the {step} steps taken as they were (e.g. "
                f"more train.steps before a wsd decay begins). Resume with the run's values{overlay}, or use "
                f"another --out.")


# -- state.json and metrics.jsonl --------------------------------------------------------------
def check_training_state(state: dict, latest: Path, steps: int, metrics: Path, steps_key: str = "train.steps") -> None:
    """`latest`/state.json describes a position a run of `steps` steps can have reached, and its
    `metrics` file is a file, before anything is loaded. `steps_key`: the config key the run's
    step count comes from (`train.steps`; a fine-tuning stage's own, e.g. `sft.steps`).

    Raises:
        CheckpointError: naming the field, the value, and the range.
    """
    where = latest / "state.json"
    step = state["step"]
    if isinstance(step, bool) or step != int(latest.name.split("_")[1]):
        raise CheckpointError(f"{where}: step = {step!r}, but the folder is {latest.name}. The checkpoint is "
                              f"damaged; resume from another one (delete this step folder).")
    if step > steps:
        raise CheckpointError(f"--resume: {latest} is at step {step}, past {steps_key} = {steps}. "
                              f"Raise {steps_key} to continue it, or use another --out.")
    for key in ("tokens", "supervised"):
        value = state.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{where}: {key} = {value!r}: expected a non-negative integer. Resume from "
                                  f"another checkpoint.")
    elapsed = state.get("elapsed_s", 0.0)
    if isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)) or not math.isfinite(elapsed) \
            or elapsed < 0:
        raise CheckpointError(f"{where}: elapsed_s = {elapsed!r}: expected seconds >= 0.")
    if (metrics.exists() or metrics.is_symlink()) and not metrics.is_file():
        raise CheckpointError(f"{metrics} is not a regular file; the run folder is damaged. Restore it or "
                              f"use another --out.")


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics.jsonl rows (`path`) up to `step` (the run continues from there); a torn last
    line from a killed run is dropped too. Rewritten atomically."""
    if not path.is_file():
        return

    def kept(line: str) -> bool:
        try:
            return json.loads(line).get("step", 0) <= step
        except (json.JSONDecodeError, AttributeError):
            return False

    keep = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
            if line.strip() and kept(line)]
    write_text(path, "".join(line + "\n" for line in keep))


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
    _check_param_groups(saved_groups, built_groups, names, bad)
    saved_state = state["state"]
    _check_param_states(saved_state, built_groups, dict(model.named_parameters()), names, bad)
    extra = sorted(set(map(str, saved_state)) - set(names.values()))
    if extra:
        raise bad(f"state for parameters this model does not have: {extra[:5]}")


def _check_param_groups(saved_groups: list[dict], built_groups: list[dict], names: dict[int, str],
                        bad: Callable[[str], CheckpointError]) -> None:
    """The saved param groups against the built ones (`names`: parameter id -> name): the same
    count and kinds, members and hyperparameters (bar _FREE_GROUP_KEYS); raises `bad(what)`."""
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


def _check_param_states(saved_state: dict, built_groups: list[dict], params: dict[str, torch.nn.Parameter],
                        names: dict[int, str], bad: Callable[[str], CheckpointError]) -> None:
    """Every built parameter's saved state: the keys its group's update keeps, each a finite float
    tensor of the parameter's shape and dtype (`step`: a scalar >= 0); raises `bad(what)`."""
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
                if not all_finite(t) or (key == "step" and float(t) < 0):
                    what = "a negative step" if key == "step" else "NaN or infinite values"
                    raise bad(f"{name!r} {key} holds {what}")


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


__all__ = ["METRICS_FILE", "RESUME_RULES", "check_training_state", "truncate_metrics", "ResumeRule", "check_optimizer_state", "check_resume_config", "check_rng_state"]
