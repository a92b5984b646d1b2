"""Training checkpoints: `step_NNNNNN/` folders that hold everything to continue a run.

The folder layout is defined once, in `lmforge.model.io` (weights, config, contract and
tokenizer files); a training checkpoint adds:
    optimizer.pt   full optimizer state keyed by parameter name (torch.distributed.checkpoint
                   `get_optimizer_state_dict`, full_state_dict); loaded with weights_only=True
    state.json     step, tokens seen, data position, elapsed seconds
    rng.pt         RNG states of every rank: {"world_size": W, "ranks": [{"torch", "cuda",
                   "numpy", "python"}, ...]}
So a checkpoint written by N ranks under DDP or FSDP loads in one process and vice versa.
It is written through `lmforge.fileio.atomic_dir` (a unique temporary folder, every file
fsync'ed, renamed when complete), so a crash mid-write leaves the previous checkpoints
intact; folders without the final name are not checkpoints.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from lmforge.config import Config
from lmforge.errors import CheckpointError
from lmforge.fileio import atomic_dir, loads_json
from lmforge.model.io import (OPTIMIZER_FILE, all_finite, RNG_FILE, STATE_FILE, is_sharded, is_tied, model_state,
                              list_checkpoints, saved_state, step_dir_name, weights_metadata,
                              write_model_files)
from lmforge.train.resume import check_optimizer_state


def _dist_on() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def gather_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full weights as `model_state` gives them, for any parallelism (the raw module, not a
    DDP wrapper). FSDP2 shards are all-gathered: a collective that every rank must call;
    rank 0 gets the full CPU tensors, the other ranks {}."""
    if not _dist_on():
        return model_state(model)
    if not is_sharded(model):  # DDP: every rank holds the same full weights; rank 0 copies them
        return model_state(model) if torch.distributed.get_rank() == 0 else {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not state:
        return {}
    state = {k: v.detach().contiguous() for k, v in state.items()}
    if is_tied(model):
        state.pop("output.weight", None)
    return saved_state(model, state)


def gather_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Full optimizer state keyed by parameter name (independent of the parallelism).

    A collective under torch.distributed; with FSDP2, rank 0 gets the full state and the
    other ranks {}. `model` is the raw module the optimizer was built on.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = _dist_on() and is_sharded(model)
    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=full))


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict,
                         where: str | Path = "optimizer.pt") -> None:
    """Load a state from `gather_optimizer_state` (every rank passes the full state).

    Raises:
        CheckpointError: the state does not fit `optimizer` (lmforge.train.resume.check_optimizer_state:
        another kind, other param groups, a state tensor of another shape or dtype, a missing key).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {n for n, p in model.named_parameters() if p.requires_grad}
    try:
        saved = {n for g in state["param_groups"] for n in g["params"]}
    except (KeyError, TypeError):
        raise CheckpointError(f"{where}: not an lmforge optimizer state (no param_groups with parameter "
                              f"names). Use a checkpoint written by this version.") from None
    if saved != names:
        raise CheckpointError(
            f"{where}: optimizer state for other parameters: missing {sorted(names - saved)[:5]}, "
            f"unexpected {sorted(saved - names)[:5]}. The checkpoint comes from another model."
        )
    check_optimizer_state(model, optimizer, state, where)
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def rng_state() -> dict:
    """This process's RNG states (torch, CUDA, numpy, python), storable with weights_only."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
            "python": [version, list(internal), gauss_next]}


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned (keys absent from `state` are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():  # a machine with fewer GPUs sets those it has
        torch.cuda.set_rng_state_all(state["cuda"][:torch.cuda.device_count()])
    if "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    config: Config,
    contract_dir: str | Path,
    optimizer: torch.optim.Optimizer | None = None,
    state: dict | None = None,
    model_weights: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict | None = None,
    rng_states: list[dict] | None = None,
) -> Path:
    """Write `run_dir/step_NNNNNN` atomically and return its path (call on one rank).

    `contract_dir` holds contract.json and the tokenizer files to copy in.
    `model_weights` / `optimizer_state` override what is taken from `model` / `optimizer`
    (for sharded models gathered by the caller: `gather_model_state`,
    `gather_optimizer_state`); `rng_states` lists every rank's `rng_state()` (default:
    this process's only).

    Raises:
        CheckpointError: a weight is NaN or infinite (no non-finite checkpoint is written).
    """
    run_dir = Path(run_dir)
    final = run_dir / step_dir_name(step)
    weights = model_weights if model_weights is not None else model_state(model)
    bad = [k for k, v in weights.items() if not all_finite(v)]
    if bad:
        raise CheckpointError(f"step {step}: {bad[0]} holds NaN or infinite values; no checkpoint is written "
                              f"for it. The newest finite checkpoint of {run_dir} is kept.")
    if optimizer_state is None and optimizer is not None:
        optimizer_state = gather_optimizer_state(model, optimizer)
    ranks = rng_states if rng_states is not None else [rng_state()]
    # the run folder belongs to this training command (checked when the run started)
    with atomic_dir(final, "checkpoint", fsync=True, check=False) as tmp:
        write_model_files(tmp, weights, config, Path(contract_dir), metadata=weights_metadata(model))
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        torch.save({"world_size": len(ranks), "ranks": ranks}, tmp / RNG_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(dict(state or {}, step=step), indent=2) + "\n", encoding="utf-8")
    return final


def remove_unfinished(run_dir: str | Path) -> None:
    """Remove what a killed checkpoint write left in `run_dir` (`.step_NNNNNN.tmp-*` and
    `.step_NNNNNN.old-*` folders). Only for the process that holds the run folder's lock:
    nothing else writes there."""
    for p in Path(run_dir).glob(".step_*.*-*"):
        if p.is_dir() and (".tmp-" in p.name or ".old-" in p.name):
            shutil.rmtree(p, ignore_errors=True)


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (0 = keep all)."""
    if keep_last <= 0:
        return
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_training_state(folder: Path) -> tuple[dict, dict, dict]:
    """(state.json, optimizer state, rng states) of a training checkpoint, loaded safely
    (torch.load with weights_only=True); resume is exact or refused, so each must be there.

    Raises:
        CheckpointError: a file missing, unreadable, or not of the expected shape.
    """
    missing = [n for n in (STATE_FILE, OPTIMIZER_FILE, RNG_FILE) if not (folder / n).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {folder} has no {', '.join(missing)}: it cannot be continued exactly "
                              f"(weights alone are not a training state). Resume from a checkpoint written by "
                              f"`lmforge pretrain`/`sft`, or start a new run with sft.init pointing at it.")
    try:
        state = loads_json((folder / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / STATE_FILE}: not readable JSON ({exc}). Resume from another checkpoint "
                              f"(delete this step folder).") from None
    if not isinstance(state, dict) or not isinstance(state.get("data"), dict) or not all(
            isinstance(state.get(k), int) for k in ("step", "tokens")):
        raise CheckpointError(f"{folder / STATE_FILE}: expected an object with integer `step`, `tokens` and a "
                              f"`data` object (the data position); found {str(state)[:80]!r}. Resume from "
                              f"another checkpoint.")
    loaded = {}
    for name in (OPTIMIZER_FILE, RNG_FILE):
        try:
            loaded[name] = torch.load(folder / name, weights_only=True)
        except Exception as exc:  # torch raises many kinds (UnpicklingError, RuntimeError, EOFError...)
            first = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"{folder / name}: damaged or not an lmforge file ({first}). It is never loaded "
                                  f"unsafely; resume from another checkpoint (delete this step folder).") from None
        if not isinstance(loaded[name], dict):
            raise CheckpointError(f"{folder / name}: expected a dictionary, found {type(loaded[name]).__name__}. "
                                  f"Resume from another checkpoint.")
    return state, loaded[OPTIMIZER_FILE], loaded[RNG_FILE]
