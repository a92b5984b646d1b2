"""Reading a checkpoint into a model: its format (model/io.py) and its meaning — the config, the
contract, and for a LoRA checkpoint (adapters only) the base it names, checked by the sha256 of
its weights and merged. `Transformer.from_checkpoint` is bound here (the model file holds only
the model)."""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.config import CONFIG_FILE, Config
from lmforge.contract import CONTRACT_FILE, Contract, check_match
from lmforge.errors import CheckpointError
from lmforge.fileio import path_from_text, safetensors_metadata
from lmforge.model import lora
from lmforge.model.io import MODEL_FILE, load_weights, read_checkpoint_meta, resolve_checkpoint
from lmforge.model.transformer import Transformer, resolve_model_config


def load_model(folder: str | Path, device: str | torch.device = "cpu", contract: Contract | None = None,
               contract_path: str | Path = "the tokenizer") -> tuple[Transformer, Config, Contract, Path]:
    """(model in eval mode, config, contract, checkpoint path) from a checkpoint or run folder.
    A LoRA checkpoint (config lora.rank > 0: adapters only) is loaded on its base, the
    checkpoint named in its weights' metadata, whose model.safetensors must have the recorded
    sha256; the adapters are merged (lmforge.model.lora.merged_state) and the model returned
    is a plain Transformer.

    Raises:
        CheckpointError / ContractError: incomplete or damaged checkpoint, non-finite weights,
        or a contract that differs from `contract` (when given); for a LoRA checkpoint, a base
        that is gone or whose weights changed.
    """
    path = resolve_checkpoint(folder)
    config, own = read_checkpoint_meta(path)
    if contract is not None:
        check_match(contract, contract_path, own, path / CONTRACT_FILE)
    model = Transformer(resolve_model_config(config.model, own, where=f"{path}/{CONFIG_FILE} model.vocab_size"),
                        init_weights=False)  # every weight is read next (strictly): no random draw
    if config.lora.rank > 0:
        model = _load_lora(model, config, own, path)
    else:
        load_weights(model, path / MODEL_FILE)
    return model.to(device).eval(), config, own, path


def lora_base(path: Path) -> tuple[Path, str]:
    """(base checkpoint folder, sha256 of its model.safetensors) recorded in the LoRA
    checkpoint `path`'s weights.

    Raises:
        CheckpointError: no record (not a LoRA checkpoint lmforge wrote).
    """
    try:
        meta = safetensors_metadata(path / MODEL_FILE)
    except Exception as exc:  # safetensors raises several kinds
        raise CheckpointError(f"{path / MODEL_FILE}: cannot read ({exc}); the checkpoint is damaged.") from None
    if lora.BASE_PATH_KEY not in meta or lora.BASE_SHA256_KEY not in meta:
        raise CheckpointError(f"{path / MODEL_FILE}: a LoRA checkpoint (lora.rank > 0 in its {CONFIG_FILE}) without "
                              f"the base checkpoint's location and hash in its metadata. Use a checkpoint written "
                              f"by `lmforge sft` with lora.rank > 0.")
    return Path(path_from_text(meta[lora.BASE_PATH_KEY])), meta[lora.BASE_SHA256_KEY]


def check_lora_base(path: Path, base: Path, sha256: str) -> None:
    """The base of the LoRA checkpoint `path` is still at `base`, with weights of hash `sha256`.

    Raises:
        CheckpointError: naming both folders and both hashes.
    """
    if not (base / MODEL_FILE).is_file():
        raise CheckpointError(f"{path} holds LoRA adapters for the base checkpoint {base}, which has no "
                              f"{MODEL_FILE} any more. Put the base back at that path (sha256 {sha256}).")
    found = lora.file_sha256(base / MODEL_FILE)
    if found != sha256:
        raise CheckpointError(f"{path} holds LoRA adapters for the base checkpoint {base} with weights of sha256 "
                              f"{sha256}, but {base / MODEL_FILE} now has sha256 {found}: another model. Restore "
                              f"the original base; adapters are never applied to other weights.")


def _load_lora(model: Transformer, config: Config, own: Contract, path: Path) -> Transformer:
    """The merged model of a LoRA checkpoint `path` (see load_model)."""
    base_dir, sha256 = lora_base(path)
    check_lora_base(path, base_dir, sha256)
    base, _, _, _ = load_model(base_dir, contract=own, contract_path=path / CONTRACT_FILE)
    if base.config != model.config:
        raise CheckpointError(f"{path}: its [model] section differs from its base {base_dir}'s; the checkpoint "
                              f"is damaged.")
    lora.inject(base, config.lora)
    load_weights(base, path / MODEL_FILE)  # the adapters only (model/io.py: a model with adapters)
    with torch.no_grad():
        model.load_state_dict(lora.merged_state(base))
    return model


def _from_checkpoint(cls, folder: str | Path, device: str | torch.device = "cpu") -> "Transformer":
    """Load a trained model from a checkpoint folder (a `step_NNNNNN/` or a run folder,
    whose newest complete checkpoint is used). Strict: missing or unexpected keys fail.

    Raises:
        CheckpointError / ContractError: see `load_model`.
    """
    return load_model(folder, device)[0]


Transformer.from_checkpoint = classmethod(_from_checkpoint)

__all__ = ["load_model", "lora_base", "check_lora_base"]
