"""`lmforge export --format peft`: a LoRA checkpoint's adapters as a PEFT adapter folder.

The folder holds what `peft.PeftModel.from_pretrained(model, folder)` reads on top of the base
exported with `lmforge export --format hf`:
    adapter_model.safetensors  the adapters under PEFT's names, e.g. lmforge's
                               `layers.0.attention.wq.lora_a` (rank, in) ->
                               `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`
                               and `lora_b` (out, rank) -> `...q_proj.lora_B.weight`, float32
    adapter_config.json        peft_type LORA, r, lora_alpha, lora_dropout, target_modules (HF names),
                               use_rslora; the scale is the same (alpha / r, or alpha / sqrt(r)).
The names are the model family's (`export.families`: the family `export --format hf` writes the
base as, `family_of`), so the adapters of an imported Gemma, OLMo 2 or Qwen land on that family's
q_proj ... down_proj. The embedding and the head are never adapted (`config.check_lora`): a tied
head stays tied in PEFT, as in the base.
PEFT loads a file whose names it does not expect as a silent no-op (it warns of missing
adapter keys); tests/test_lora.py turns that warning into a failure and compares logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from lmforge.config import LORA_TARGETS, LoRAConfig, ModelConfig
from lmforge.export.families import Family, family_of
from lmforge.export.families.shared import part_rows
from lmforge.export.hf import map_name
from lmforge.export.options import ExportError, check_export_options
from lmforge.fileio import atomic_dir, check_output, save_safetensors
from lmforge.model import Transformer, lora, resolve_model_config
from lmforge.model.io import MODEL_FILE, read_checkpoint_meta, read_weights, resolve_checkpoint
from lmforge.model.load import check_lora_base, lora_base

PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_CONFIG_FILE = "adapter_config.json"
_SIDE = {"lora_a": "lora_A", "lora_b": "lora_B"}

#: The marker command of a PEFT adapter folder: not "export" (a Hugging Face model folder), so
#: neither export replaces the other's folder.
PEFT_OUTPUT = "export-peft"


def peft_name(name: str, family: Family | None = None) -> str:
    """lmforge adapter name -> PEFT's saved name in `family`'s layout ("layers.0.attention.wq.lora_a" ->
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")."""
    stem, _, side = name.rpartition(".")
    hf = map_name(f"{stem}.weight", family=family).removesuffix(".weight")
    return f"base_model.model.{hf}.{_SIDE[side]}.weight"


def target_module(target: str, family: Family | None = None) -> str:
    """A `lora.targets` entry (wq ... w3) as PEFT's target_modules name in `family`'s layout (q_proj
    ...; a part of a fused weight: the fused module, Phi-3's qkv_proj or gate_up_proj)."""
    where = "attention" if target in LORA_TARGETS[:4] else "feed_forward"
    name = f"layers.{{i}}.{where}.{target}.weight"
    group = next((g for g in (family.fused if family else ()) if name in g.parts), None)
    return map_name((group.name if group else name).replace("{i}", "0"), family=family).split(".")[-2]


def fuse_adapters(adapters: dict[str, torch.Tensor], family: Family, model: ModelConfig,
                  lo: LoRAConfig) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """The adapters of a fused weight's parts (`Family.fused`: Phi-3's q, k, v -> qkv_proj) as one
    LoRA of the fused weight, exactly: with n adapted parts of rank r, A = cat(A_1 .. A_n)
    (n r, in) and B block-diagonal (the fused rows, n r) with each part's B at its rows and its
    slot, so B A stacks each part's B_k A_k at its rows (zero rows for a part not adapted); the
    scale stays alpha / r (alpha / sqrt(r) with rsLoRA) through PEFT's per-module rank and alpha
    (LoraConfig's rank_pattern and alpha_pattern).

    Returns:
        (adapters with the parts' replaced by the fused weight's, PEFT rank_pattern, alpha_pattern).
    """
    out, rank_pattern, alpha_pattern = dict(adapters), {}, {}
    for group in family.fused:
        adapted = [k for k, p in enumerate(group.parts) if p.split(".")[-2] in lo.targets]
        if not adapted:
            continue
        rows = [part_rows(model, p) for p in group.parts]
        r, n = lo.rank, len(adapted)
        for i in range(model.n_layers):
            stems = [p.replace("{i}", str(i)).removesuffix(".weight") for p in group.parts]
            a = torch.cat([out.pop(f"{stems[k]}.lora_a") for k in adapted])
            b = torch.block_diag(*[out.pop(f"{stems[k]}.lora_b") if k in adapted else a.new_zeros(rows[k], 0)
                                   for k in range(len(rows))])  # a part not adapted: its rows zero, no columns
            fused = group.name.replace("{i}", str(i)).removesuffix(".weight")
            out[f"{fused}.lora_a"], out[f"{fused}.lora_b"] = a, b
        module = map_name(group.name.replace("{i}", "0"), family=family).split(".")[-2]
        rank_pattern[module] = n * r
        alpha_pattern[module] = lo.alpha * (math.sqrt(n) if lo.use_rslora else n)
    return out, rank_pattern, alpha_pattern


def export_peft(checkpoint: str | Path, out: str | Path, dtype: str = "float32", verify: bool = False,
                force: bool = False) -> Path:
    """Write the adapters of the LoRA checkpoint `checkpoint` (a step folder or a run folder)
    as a PEFT adapter folder `out` (atomically; absent, empty or an earlier export).

    Raises:
        ExportError: an option that does not apply, a checkpoint without adapters (lora.rank = 0).
        CheckpointError: the checkpoint is damaged, or its base moved or changed (the adapters
            belong to those exact weights).
    """
    check_export_options("peft", dtype, verify, force)
    out = Path(out)
    check_output(out, PEFT_OUTPUT, "`lmforge export --format peft`", replace_whole=True)  # before any work
    path = resolve_checkpoint(checkpoint)
    cfg, contract = read_checkpoint_meta(path)
    from lmforge.loading import note_overlay_model

    note_overlay_model(cfg, path)  # its [model] as saved: an overlay's is said to be ignored
    lo = cfg.lora
    if lo.rank <= 0:
        raise ExportError(f"{path} is not a LoRA checkpoint (lora.rank = 0 in its config.toml): --format peft writes "
                          f"adapters. Export its weights with --format hf or gguf.")
    base, sha256 = lora_base(path)
    check_lora_base(path, base, sha256)
    model = lora.inject(Transformer(resolve_model_config(cfg.model, contract)), lo)
    family = family_of(model.config)  # the layout `export --format hf` writes the base in
    adapters = read_weights(model, path / MODEL_FILE)  # names, shapes and finite values checked
    adapters, rank_pattern, alpha_pattern = fuse_adapters(adapters, family, model.config, lo)
    tensors = {peft_name(k, family): v.to(torch.float32).contiguous() for k, v in sorted(adapters.items())}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lo.rank, "lora_alpha": lo.alpha,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
        "lora_dropout": lo.dropout, "use_rslora": lo.use_rslora, "bias": "none", "fan_in_fan_out": False,
        "target_modules": sorted({target_module(t, family) for t in lo.targets}),
        "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": None,
    }
    with atomic_dir(out, PEFT_OUTPUT, what="`lmforge export --format peft`") as tmp:
        save_safetensors(tensors, tmp / PEFT_WEIGHTS_FILE, metadata={"format": "pt"})
        (tmp / PEFT_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


__all__ = ["export_peft", "fuse_adapters", "peft_name", "target_module", "PEFT_WEIGHTS_FILE", "PEFT_CONFIG_FILE"]
