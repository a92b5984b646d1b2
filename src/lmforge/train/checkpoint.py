"""Checkpoints: atomic `step_NNNNNN/` folders that hold everything to continue a run.

A checkpoint folder holds:
    model.safetensors      weights (tied output weight stored once, as tok_embeddings)
    optimizer.pt           optimizer state (loaded with torch.load(weights_only=True))
    state.json             step, tokens seen, data position, elapsed seconds
    rng.pt                 torch RNG state(s)
    config.toml            the resolved config
    contract.json          the contract, and the tokenizer files beside it
    tokenizer.json, tokenizer_config.json
It is written into `.tmp-step_NNNNNN` and renamed when complete, so a crash mid-write
leaves the previous checkpoints intact; folders without the final name are ignored.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

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


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights to save: contiguous CPU tensors; a tied output weight is stored once."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if getattr(model, "config", None) is not None and model.config.tie_embeddings:
        state.pop("output.weight", None)
    return state


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load safetensors weights strictly: missing or unexpected keys are errors."""
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: cannot read weights ({exc}). The file is damaged; use another checkpoint.") from None
    expected = set(model_state(model))
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the model built from its config.toml: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}. The config and weights come "
            f"from different runs."
        )
    own = model.state_dict()
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise CheckpointError(f"{path}: {k} has shape {tuple(v.shape)}, the config expects {tuple(own[k].shape)}.")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


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
) -> Path:
    """Write `run_dir/step_NNNNNN` atomically and return its path.

    `contract_dir` holds contract.json and the tokenizer files to copy in.
    `model_weights` / `optimizer_state` override what is taken from `model` / `optimizer`
    (for sharded models gathered by the caller).
    """
    run_dir = Path(run_dir)
    final = run_dir / step_dir_name(step)
    tmp = run_dir / f".tmp-{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(model_weights if model_weights is not None else model_state(model), str(tmp / MODEL_FILE))
    opt_state = optimizer_state if optimizer_state is not None else (optimizer.state_dict() if optimizer else None)
    if opt_state is not None:
        torch.save(opt_state, tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(dict(state or {}, step=step), indent=2) + "\n", encoding="utf-8")
    config.save(tmp / "config.toml")
    for name in (CONTRACT_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        shutil.copy2(Path(contract_dir) / name, tmp / name)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> None:
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
    """(state.json, optimizer state or None, rng states), all loaded safely."""
    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    opt = torch.load(folder / "optimizer.pt", weights_only=True) if (folder / "optimizer.pt").is_file() else None
    rng = torch.load(folder / "rng.pt", weights_only=True) if (folder / "rng.pt").is_file() else {}
    return state, opt, rng
