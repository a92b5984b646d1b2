"""Checkpoints: atomic `step_NNNNNN/` folders that hold everything to continue a run.

A checkpoint folder holds:
    model.safetensors      full (unsharded) weights, whatever the parallelism: FSDP2 shards
                           are gathered to rank 0 first (tied output weight stored once, as
                           tok_embeddings)
    optimizer.pt           full AdamW state keyed by parameter name (torch.distributed.checkpoint
                           `get_optimizer_state_dict`, full_state_dict); loaded with
                           torch.load(weights_only=True)
    state.json             step, tokens seen, data position, elapsed seconds
    rng.pt                 RNG states of every rank: {"world_size": W, "ranks": [{"torch",
                           "cuda", "numpy", "python"}, ...]}
    config.toml            the resolved config
    contract.json          the contract, and the tokenizer files beside it
    tokenizer.json, tokenizer_config.json
So a checkpoint written by N ranks under DDP or FSDP loads in one process and vice versa.
It is written into `.tmp-step_NNNNNN` (files fsync'ed) and renamed when complete, so a
crash mid-write leaves the previous checkpoints intact; folders without the final name
are ignored, and stale `.tmp-*` folders are removed by the next save.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmforge.config import Config, load_config
from lmforge.contract import CONTRACT_FILE, Contract, check_match, check_tokenizer_hash
from lmforge.errors import CheckpointError
from lmforge.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

STEP_RE = re.compile(r"^step_(\d{6,})$")
MODEL_FILE = "model.safetensors"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := STEP_RE.match(p.name))]
    return [p for _, p in sorted(found) if (p / MODEL_FILE).is_file()]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_checkpoint(folder: str | Path) -> Path:
    """A checkpoint folder itself, or a run folder's newest complete checkpoint.

    Raises:
        CheckpointError: nothing loadable there.
    """
    folder = Path(folder)
    if (folder / MODEL_FILE).is_file():
        return folder
    latest = latest_checkpoint(folder)
    if latest is None:
        raise CheckpointError(
            f"{folder} is not a checkpoint: no {MODEL_FILE} in it and no complete step_NNNNNN/ folder. "
            f"Point at a run folder written by `lmforge pretrain`/`sft`, or at one of its step folders."
        )
    return latest


def _tied(model: torch.nn.Module) -> bool:
    return getattr(model, "config", None) is not None and bool(model.config.tie_embeddings)


def _sharded(model: torch.nn.Module) -> bool:
    from lmforge.train.distributed import is_sharded

    return is_sharded(model)


def _dist_on() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights to save: contiguous CPU tensors; a tied output weight is stored once.

    For a plain (or DDP-wrapped) module. FSDP2 modules: use `gather_model_state`.
    """
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if _tied(model):
        state.pop("output.weight", None)
    return state


def gather_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full weights as `model_state` gives them, for any parallelism (the raw module, not a
    DDP wrapper). FSDP2 shards are all-gathered: a collective that every rank must call;
    rank 0 gets the full CPU tensors, the other ranks {}."""
    if not _dist_on():
        return model_state(model)
    if not _sharded(model):  # DDP: every rank holds the same full weights; rank 0 copies them
        return model_state(model) if torch.distributed.get_rank() == 0 else {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not state:
        return {}
    state = {k: v.detach().contiguous() for k, v in state.items()}
    if _tied(model):
        state.pop("output.weight", None)
    return state


def read_weights(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """Weights of `path`, checked against `model` (full shapes, also for FSDP2 modules).

    Raises:
        CheckpointError: unreadable file, a missing or unexpected key, or a shape that differs.
    """
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: cannot read weights ({exc}). The file is damaged; use another checkpoint.") from None
    own = model.state_dict()  # DTensor shapes are the full shapes
    expected = set(own) - ({"output.weight"} if _tied(model) else set())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the model built from its config.toml: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}. The config and weights come "
            f"from different runs; no key is ever skipped."
        )
    for k, v in state.items():
        if tuple(own[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{path}: {k} has shape {tuple(v.shape)}, the config expects {tuple(own[k].shape)}.")
    return state


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load safetensors weights strictly into `model` (plain, or FSDP2-sharded: then every rank
    calls this and takes its shard): missing or unexpected keys are errors, never skipped.

    Raises:
        CheckpointError: see `read_weights`.
    """
    state = read_weights(model, path)
    if _sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if _tied(model):
            state["output.weight"] = state["tok_embeddings.weight"]
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
        return
    own = model.state_dict()
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


def gather_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Full optimizer state keyed by parameter name (independent of the parallelism).

    A collective under torch.distributed; with FSDP2, rank 0 gets the full state and the
    other ranks {}. `model` is the raw module the optimizer was built on.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = _dist_on() and _sharded(model)
    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=full))


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict,
                         where: str | Path = "optimizer.pt") -> None:
    """Load a state from `gather_optimizer_state` (every rank passes the full state).

    Raises:
        CheckpointError: the state names other parameters than `model` has.
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
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / step_dir_name(step)
    for stale in run_dir.glob(".tmp-step_*"):  # left by a write that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = run_dir / f".tmp-{final.name}"
    tmp.mkdir(parents=True)
    save_file(model_weights if model_weights is not None else model_state(model), str(tmp / MODEL_FILE))
    if optimizer_state is None and optimizer is not None:
        optimizer_state = gather_optimizer_state(model, optimizer)
    if optimizer_state is not None:
        torch.save(optimizer_state, tmp / "optimizer.pt")
    ranks = rng_states if rng_states is not None else [rng_state()]
    torch.save({"world_size": len(ranks), "ranks": ranks}, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(dict(state or {}, step=step), indent=2) + "\n", encoding="utf-8")
    config.save(tmp / "config.toml")
    for name in (CONTRACT_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        shutil.copy2(Path(contract_dir) / name, tmp / name)
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    old = run_dir / f".old-{final.name}"
    if final.exists():  # the same step written again: keep it until the new one is in place
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    _fsync(run_dir)
    if old.exists():
        shutil.rmtree(old)
    return final


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (0 = keep all)."""
    if keep_last <= 0:
        return
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def read_checkpoint_meta(folder: Path) -> tuple[Config, Contract]:
    """Config and contract of a checkpoint, with the tokenizer hash checked."""
    if not (folder / "config.toml").is_file():
        raise CheckpointError(f"checkpoint {folder} has no config.toml; it is incomplete. Use another checkpoint.")
    contract = Contract.load(folder, what="checkpoint")
    if (folder / TOKENIZER_FILE).is_file():
        check_tokenizer_hash(contract, folder / CONTRACT_FILE, folder / TOKENIZER_FILE)
    return load_config(folder / "config.toml"), contract


def load_model(folder: str | Path, device: str | torch.device = "cpu", contract: Contract | None = None,
               contract_path: str | Path = "the tokenizer"):
    """(model, config, contract, checkpoint path) from a checkpoint or run folder.

    Raises:
        CheckpointError / ContractError: incomplete checkpoint, or a contract that differs
        from `contract` (when given).
    """
    from lmforge.model import Transformer, resolve_model_config

    path = resolve_checkpoint(folder)
    config, own = read_checkpoint_meta(path)
    if contract is not None:
        check_match(contract, contract_path, own, path / CONTRACT_FILE)
    model = Transformer(resolve_model_config(config.model, own, where=f"{path}/config.toml model.vocab_size"))
    load_weights(model, path / MODEL_FILE)
    return model.to(device).eval(), config, own, path


def load_training_state(folder: Path) -> tuple[dict, dict | None, dict]:
    """(state.json, optimizer state or None, rng states), all loaded safely
    (torch.load with weights_only=True).

    Raises:
        CheckpointError: state.json missing or unreadable, or a damaged .pt file.
    """
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        opt = torch.load(folder / "optimizer.pt", weights_only=True) if (folder / "optimizer.pt").is_file() else None
        rng = torch.load(folder / "rng.pt", weights_only=True) if (folder / "rng.pt").is_file() else {}
    except (OSError, ValueError, RuntimeError, EOFError) as exc:
        raise CheckpointError(f"checkpoint {folder}: cannot read its training state ({exc}). "
                              f"Resume from another checkpoint (delete this step folder).") from None
    return state, opt, rng
