"""The checkpoint layout, defined once, and reading a model's files back.

A checkpoint folder (`step_NNNNNN/` inside a run folder, or a folder `import-hf` wrote):
    model.safetensors      full (unsharded) weights; a tied output weight stored once, as
                           tok_embeddings.weight
    config.toml            the resolved config (lmforge.config)
    contract.json          the contract, with the tokenizer files beside it (P1, P6)
    tokenizer.json, tokenizer_config.json
and, in a training checkpoint (written by lmforge.train.checkpoint):
    optimizer.pt           full optimizer state keyed by parameter name
    rng.pt                 every rank's RNG states
    state.json             step, tokens seen, data position, elapsed seconds
A LoRA run's checkpoint (config lora.rank > 0) holds the adapters only in model.safetensors
(`*.lora_a`, `*.lora_b`), with its base checkpoint's folder and the sha256 of the base's
model.safetensors in the file's metadata (lmforge.model.lora); `load_model` merges them.
Weights load strictly (a missing or unexpected key is an error) and only through
safetensors; `.pt` files only with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from lmforge.config import CONFIG_FILE, Config, load_config
from lmforge.contract import (CONTRACT_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Contract,
                              check_tokenizer_hash)
from lmforge.errors import CheckpointError, LmforgeError
from lmforge.fileio import SafetensorsReader, check_readable, load_safetensors, save_safetensors
from lmforge.model import lora

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
#: The files that travel with every set of weights: the contract and the tokenizer (P1).
CONTRACT_FILES = (CONTRACT_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
STEP_RE = re.compile(r"^step_(\d{6,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders of a run, oldest first: real `step_NNNNNN` folders (not links)
    holding a weights entry. A folder without one, or under a temporary name, is not a
    checkpoint; one whose weights entry is damaged (a folder, a FIFO) is listed, so that
    loading it fails with a clear error instead of silently falling back to an older step."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir()
             if (m := STEP_RE.match(p.name)) and p.is_dir() and not p.is_symlink()]
    return [p for _, p in sorted(found) if _has_weights_entry(p)]


def _has_weights_entry(step: Path) -> bool:
    """A weights entry in `step`; a folder that cannot be looked into (permission denied) is
    listed too, so that loading it says why instead of falling back to an older step."""
    try:
        os.lstat(step / MODEL_FILE)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_checkpoint(folder: str | Path) -> Path:
    """A checkpoint folder itself, or a run folder's newest complete checkpoint.

    Raises:
        CheckpointError: nothing loadable there.
    """
    folder = Path(folder)
    if os.path.lexists(folder / MODEL_FILE):
        return folder
    latest = latest_checkpoint(folder)
    if latest is None:
        raise CheckpointError(
            f"{folder} is not a checkpoint: no {MODEL_FILE} in it and no complete step_NNNNNN/ folder. "
            f"Point at a run folder written by `lmforge pretrain`/`sft`, or at one of its step folders."
        )
    return latest


def is_tied(model: torch.nn.Module) -> bool:
    return getattr(model, "config", None) is not None and bool(model.config.tie_embeddings)


def is_sharded(model: torch.nn.Module) -> bool:
    """True when `model`'s parameters are DTensors (FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights to save: contiguous CPU tensors; a tied output weight is stored once.

    For a plain (or DDP-wrapped) module. FSDP2 modules: use `gather_model_state`.
    """
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if is_tied(model):
        state.pop("output.weight", None)
    return saved_state(model, state)


def saved_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a checkpoint of `model` holds of its full `state`: everything, or, for a model with
    LoRA adapters, the adapters only (their base is recorded by location and hash)."""
    return lora.adapter_state(state) if lora.has_adapters(model) else state


def weights_metadata(model: torch.nn.Module) -> dict[str, str] | None:
    """The safetensors metadata of `model`'s checkpoint: a LoRA model's base (`lora_base`, set by
    the stage that injected the adapters: {BASE_PATH_KEY: folder, BASE_SHA256_KEY: hash})."""
    return dict(getattr(model, "lora_base", None) or {}) or None


def read_checkpoint_meta(folder: Path) -> tuple[Config, Contract]:
    """Config and contract of a checkpoint, with the tokenizer hash checked. The config is the
    checkpoint's config.toml as saved: `LMFORGE_CONFIG_OVERLAY` sets what a command runs, never
    what a checkpoint is (`lmforge.loading.note_overlay_model` says when it would differ).

    Raises:
        CheckpointError: config.toml missing or unreadable; ContractError: a bad contract.
    """
    if not (folder / CONFIG_FILE).is_file():
        raise CheckpointError(f"checkpoint {folder} has no {CONFIG_FILE}; it is incomplete. Use another checkpoint.")
    contract = Contract.load(folder, what="checkpoint")
    if (folder / TOKENIZER_FILE).is_file():
        check_tokenizer_hash(contract, folder / CONTRACT_FILE, folder / TOKENIZER_FILE)
    try:
        return load_config(folder / CONFIG_FILE, overlay=False), contract  # a record: as saved, never overlaid
    except LmforgeError as exc:
        raise CheckpointError(f"checkpoint {folder}: its {CONFIG_FILE} does not load ({exc})") from None


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path} is not a regular file (a folder, a link to nothing, a pipe); the checkpoint "
                              f"is damaged. Use another checkpoint (or delete this step folder).")
    check_readable(path)  # the operating system's refusal in its own words (safetensors says "not found")


def _check_names_and_shapes(model: torch.nn.Module, own: dict[str, torch.Tensor], path: Path,
                            shapes: dict[str, tuple[int, ...]]) -> None:
    """The file's tensors (`shapes`: name -> shape) are exactly what a checkpoint of `model` holds."""
    expected = set(saved_state(model, {k: v for k, v in own.items() if not (is_tied(model) and k == "output.weight")}))
    missing, unexpected = expected - set(shapes), set(shapes) - expected
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the model built from its {CONFIG_FILE}: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}. The config and weights come "
            f"from different runs; no key is ever skipped."
        )
    for k, shape in shapes.items():
        if tuple(own[k].shape) != tuple(shape):
            raise CheckpointError(f"{path}: {k} has shape {tuple(shape)}, the config expects {tuple(own[k].shape)}.")


_FINITE_SLICE = 1 << 22  # elements checked at once: the check's temporaries stay a few MB


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in `t` (any dtype; an integer tensor is finite), checked a slice of
    4M elements at a time: `torch.isfinite(t)` on a CPU builds temporaries of t's size (a float
    copy and a mask: ~1 GB for a 262k-token embedding)."""
    if not t.is_floating_point():
        return True
    flat = t.detach().reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + _FINITE_SLICE]).all()) for i in range(0, flat.numel(), _FINITE_SLICE))


def _check_finite(path: Path, k: str, v: torch.Tensor) -> None:
    if not all_finite(v):
        raise CheckpointError(f"{path}: {k} holds NaN or infinite values; this checkpoint cannot be used. "
                              f"Use an earlier checkpoint of the run.")


def read_weights(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """Weights of `path`, checked against `model` (full shapes, also for FSDP2 modules).

    Raises:
        CheckpointError: unreadable file, a missing or unexpected key, a shape that differs,
        or a non-finite value (a checkpoint is never trusted to be finite).
    """
    _check_file(path)
    try:
        state = load_safetensors(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read weights ({exc}). The file is damaged; use another checkpoint.") from None
    _check_names_and_shapes(model, model.state_dict(), path, {k: tuple(v.shape) for k, v in state.items()})
    for k, v in state.items():
        _check_finite(path, k, v)
    return state


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load safetensors weights strictly into `model` (plain, or FSDP2-sharded: then every rank
    calls this and takes its shard): missing or unexpected keys are errors, never skipped.

    A plain model's tensors are read from the file straight into its own storage
    (`fileio.SafetensorsReader`): the load's peak memory is the model's, not twice it; a tensor
    of another dtype than the file's goes through one temporary of its size.

    Raises:
        CheckpointError: see `read_weights`.
    """
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state = read_weights(model, path)
        if is_tied(model):
            state["output.weight"] = state["tok_embeddings.weight"]
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True,
                                                                    strict=not lora.has_adapters(model)))
        return
    _check_file(path)
    own = model.state_dict()
    try:
        with SafetensorsReader(path) as reader:
            _check_names_and_shapes(model, own, path, {k: e[1] for k, e in reader.entries.items()})
            with torch.no_grad():
                for k, (dtype, _, _, _) in reader.entries.items():
                    dest = own[k]
                    direct = dest.dtype == dtype and dest.device.type == "cpu" and dest.is_contiguous()
                    buf = dest if direct else torch.empty(dest.shape, dtype=dtype)
                    reader.read_into(k, buf)
                    _check_finite(path, k, buf)
                    if not direct:
                        dest.copy_(buf)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read weights ({exc}). The file is damaged; use another checkpoint.") from None


def write_model_files(folder: Path, weights: dict[str, torch.Tensor], config: Config, contract_dir: Path,
                      metadata: dict[str, str] | None = None) -> None:
    """The files every checkpoint holds (weights, config, contract, tokenizer files), into
    `folder` (a temporary folder of `lmforge.fileio.atomic_dir`)."""
    save_safetensors(weights, folder / MODEL_FILE, metadata=metadata)
    config.save(folder / CONFIG_FILE)
    for name in CONTRACT_FILES:
        shutil.copy2(Path(contract_dir) / name, folder / name)


__all__ = ["model_state", "MODEL_FILE", "OPTIMIZER_FILE", "RNG_FILE", "STATE_FILE", "CONTRACT_FILES", "step_dir_name",
           "all_finite", "list_checkpoints", "latest_checkpoint", "resolve_checkpoint", "read_checkpoint_meta", "read_weights",
           "load_weights", "write_model_files", "is_tied", "is_sharded", "saved_state", "weights_metadata"]
