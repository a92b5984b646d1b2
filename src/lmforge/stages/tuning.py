"""The start of every run that begins from a checkpoint — continued pretraining
(`train.init`), SFT (`sft.init`), DPO (`dpo.init`) and the stages to come — in one place:
resolve the init, refuse it as `--out`, on `--resume` require the same init and (LoRA) the same
base weights, refuse a run folder that is, holds or lies inside one of the run's inputs
(`check_run_inputs`), load it with its tokenizer, inject the adapters and record the base's path and
hash, take its [model] section (`config.model_from_init`). A fine-tuning section ([sft], [dpo])
supplies the run's steps, batch shape, learning rate and warm-up (`tuning_config`). Each stage
keeps only what is its own: its data, its objective, its report lines.

Not a stage: stages import it, and no stage imports another (tests/test_layering.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from lmforge.config import Config, model_from_init
from lmforge.contract import TOKENIZER_FILE
from lmforge.errors import CheckpointError, ConfigError, DataError, LmforgeError
from lmforge.fileio import check_not_input, check_output, path_text
from lmforge.loading import load_checkpoint
from lmforge.model import Transformer, lora
from lmforge.model.io import MODEL_FILE, latest_checkpoint, read_checkpoint_meta, resolve_checkpoint
from lmforge.model.load import lora_base
from lmforge.tokenizer import Tokenizer

#: The [train] keys a fine-tuning section ([sft], [dpo]) supplies for its run.
TUNING_TRAIN_KEYS = ("steps", "micro_batch_size", "grad_accum_steps", "lr", "warmup_steps", "optimizer", "schedule",
                     "compile")


@dataclass
class Start:
    """What a run from a checkpoint starts with: the config (the checkpoint's [model]), the model
    (LoRA adapters injected when lora.rank > 0), its tokenizer, and the resolved init folder."""

    cfg: Config
    model: Transformer
    tok: Tokenizer
    init: Path


def start_from_checkpoint(cfg: Config, out: str | Path, resume: bool, key: str,
                          tokenizer_dir: str | Path | None) -> Start:
    """The shared start-up of a run from `KEY.init` (`key`: "train", "sft" or "dpo").

    `tokenizer_dir`: the tokenizer the checkpoint must match (None: its own copy).
    Raises:
        ConfigError: init as --out, another init or a LoRA/full switch on --resume, a typed
        --set model.X the checkpoint disagrees with, a LoRA rank past a layer.
        CheckpointError / ContractError: not a checkpoint, another base on --resume, another tokenizer.
    """
    init_arg = getattr(cfg, key).init
    init = resolve_checkpoint(init_arg)
    refuse_init_as_out(Path(out), Path(init_arg), init, key)
    if Path(out) != Path("."):  # a hard link, a mount of it, or --out inside a folder of yours that holds it
        check_not_input(out, [(f"{key}.init", init_arg), (f"{key}.init", str(init))])
    if resume:
        check_same_init(Path(out), init, key)
    model, tok, init_cfg, _ = load_checkpoint(init, tokenizer_dir, note_overlay=False)  # model_from_init: refused
    if cfg.lora.rank > 0:  # load the base, inject, freeze; the trainer then wraps and builds the optimizer
        base_sha = lora.file_sha256(init / MODEL_FILE)
        if resume:
            check_same_base(Path(out), init, base_sha)
        lora.inject(model, cfg.lora, seed=cfg.train.seed)
        model.lora_base = {lora.BASE_PATH_KEY: path_text(str(init.resolve())), lora.BASE_SHA256_KEY: base_sha}
    cfg = model_from_init(cfg, init_cfg.model, f"{key}.init", init_arg)
    return Start(cfg, model, tok, init)


def tuning_config(cfg: Config, init_model, key: str) -> Config:
    """The config a fine-tuning run (`key`: "sft", "dpo") trains and saves: [model] from the
    initial checkpoint, and [train] TUNING_TRAIN_KEYS from its section (no time budget).

    Raises:
        ConfigError: e.g. data.seq_len above the checkpoint's model.max_seq_len.
    """
    section = getattr(cfg, key)
    train = replace(cfg.train, time_budget_s=0.0, **{k: getattr(section, k) for k in TUNING_TRAIN_KEYS})
    return model_from_init(replace(cfg, train=train), init_model, f"{key}.init", section.init)


def start_tuning(cfg: Config, out: str | Path, resume: bool, key: str) -> Start:
    """The start of a fine-tuning stage (`key`: "sft", "dpo", "rl"), after its own checks of its
    section: `out` checked before anything else (`.`, a parent, another command's output), the
    checkpoint `KEY.init` loaded with its own tokenizer unless tokenizer.dir holds one
    (`start_from_checkpoint`), and `Start.cfg` the config the run trains and saves
    (`tuning_config`, with tokenizer.dir the tokenizer it loaded).

    Raises:
        see `start_from_checkpoint`, `tuning_config` and `fileio.check_output`.
    """
    check_output(Path(out), key)
    check_run_inputs(cfg, out, key)
    start = start_from_checkpoint(cfg, out, resume, key, own_tokenizer_dir(cfg))
    cfg = replace(start.cfg, tokenizer=replace(cfg.tokenizer, dir=str(start.tok.folder)))
    return replace(start, cfg=tuning_config(cfg, start.cfg.model, key))


def run_inputs(cfg: Config, key: str) -> list[tuple[str, str]]:
    """What a training run reads, besides its init checkpoint, as `fileio.check_not_input`'s
    (name, path) pairs: pretraining (`key` "train") tokenizer.dir and data.dir; a fine-tuning run
    (`key` "sft", "dpo", "rl") KEY.data (a file of yours, not "stdlib") and tokenizer.dir where
    that folder holds the tokenizer it loads; every run its train.eval_tasks files."""
    if key == "train":
        inputs = [("tokenizer.dir", cfg.tokenizer.dir), ("data.dir", cfg.data.dir)]
    else:
        data = getattr(cfg, key).data
        inputs = [(f"{key}.data", data)] if data and data != "stdlib" else []
        if own_tokenizer_dir(cfg) is not None:
            inputs.append(("tokenizer.dir", cfg.tokenizer.dir))
    inputs += [("train.eval_tasks", str(t)) for t in cfg.train.eval_tasks if str(t).endswith((".jsonl", ".parquet"))]
    return inputs


def check_run_inputs(cfg: Config, out: str | Path, key: str, command: str | None = None) -> None:
    """Refuse a run folder `out` that is one of the run's inputs (`run_inputs`: the same folder,
    under any name), holds one (a run prunes and rewrites its folder: an input there would be
    lost or changed under the run), or lies inside an input folder that is not an lmforge run
    (the run would write into the data it reads), `--resume` or not (`fileio.check_not_input`).
    A run folder beside its data, or inside a pretraining run, is no overlap. `command` (default
    `key`) is the run folder's marker: its own check (`check_output`) speaks first where it
    refuses `out` too. A dry run without --out (Path(".")) names no folder.

    Raises:
        OutputError: naming --out, the key and its value, and what to do.
    """
    if Path(out) == Path("."):
        return
    check_not_input(out, run_inputs(cfg, key), own_check=lambda: check_output(Path(out), command or key))


def require_training(splits: dict[str, list], cfg: Config, key: str, what: str) -> None:
    """Refuse a fine-tuning run (`key`: "sft", "dpo", "rl") left with no training `what`
    ("conversation", "pair", "prompt") after the split and the caps.

    Raises:
        DataError: naming KEY.data, the held-out count and data.val_fraction.
    """
    if not splits["train"]:
        raise DataError(f"{key}.data = {getattr(cfg, key).data!r}: no training {what} (all {len(splits['val'])} fell in "
                        f"the validation split, data.val_fraction = {cfg.data.val_fraction}). Add {what}s or lower "
                        f"data.val_fraction.")


def lora_line(cfg: Config, model: Transformer, init: Path) -> str:
    """The start-up line of a LoRA run: rank, scale, targets, trainable parameters, the base."""
    lo = cfg.lora
    return (f"LoRA rank {lo.rank}, alpha {lo.alpha:g} (scale {lora.lora_scale(lo):g}), dropout {lo.dropout:g}, "
            f"targets {' '.join(lo.targets)}: {lora.trainable_parameters(model):,} trainable parameters of "
            f"{model.num_parameters():,}; checkpoints hold the adapters only, on the base {init}")


def own_tokenizer_dir(cfg: Config) -> Path | None:
    """tokenizer.dir when that folder holds a tokenizer, else None: the checkpoint's own copy."""
    tok_dir = Path(cfg.tokenizer.dir)
    return tok_dir if (tok_dir / TOKENIZER_FILE).is_file() else None


def chat_template_line(tok: Tokenizer) -> str:
    """What conversations are rendered with: lmforge's ChatML, or the imported model's own template."""
    from lmforge.tokenizer import CHAT_TEMPLATE

    ends = f"replies end with {tok.spellings['im_end']!r}"
    if tok.contract.chat_template == CHAT_TEMPLATE:
        return f"chat template: lmforge's ChatML; {ends}"
    first = tok.contract.chat_template.strip().splitlines()[0][:60] if tok.contract.chat_template.strip() else ""
    return (f"chat template: the model's own ({len(tok.contract.chat_template):,} characters, from "
            f"{tok.folder / 'tokenizer_config.json'}: {first!r}…); {ends}; documents "
            f"{'start with ' + repr(tok.spellings['bos']) if tok.contract.add_bos else 'have no BOS'}")


def check_same_init(out: Path, init: Path, section: str = "sft") -> None:
    """`--resume` continues a fine-tuning run (`section` "sft" or "dpo") only from the
    checkpoint it started from (`section`.init)."""
    latest = latest_checkpoint(out)
    if latest is None:
        return
    saved, _ = read_checkpoint_meta(latest)
    was = getattr(saved, section).init
    try:
        before = resolve_checkpoint(was).resolve() if was else None
    except LmforgeError:
        before = None
    if before != init.resolve():
        raise ConfigError(f"--resume: {out} is a {section.upper()} run from {section}.init = {was!r}, but this "
                          f"command sets {section}.init = {str(init)!r}. Resume with the same {section}.init, or "
                          f"choose another --out.")


def check_same_base(out: Path, init: Path, sha256: str) -> None:
    """`--resume` of a LoRA run: the base weights are the ones its adapters were trained on
    (same sha256 of model.safetensors), not merely the same folder."""
    latest = latest_checkpoint(out)
    if latest is None:
        return
    saved, _ = read_checkpoint_meta(latest)
    if saved.lora.rank <= 0:
        raise ConfigError(f"--resume: {out} is a full fine-tuning run (lora.rank = 0 in {latest}/config.toml); this "
                          f"command sets lora.rank > 0. Resume with lora.rank = 0, or choose another --out.")
    _, before = lora_base(latest)
    if before != sha256:
        raise CheckpointError(f"--resume: {out}'s adapters were trained on a base whose {MODEL_FILE} has sha256 "
                              f"{before}; {init / MODEL_FILE} now has sha256 {sha256}: another model. Restore the "
                              f"original base, or start a new run (another --out).")


def refuse_init_as_out(out: Path, init_arg: Path, init: Path, section: str = "sft") -> None:
    """The run being fine-tuned is never the fine-tuning run folder, nor inside it (its
    checkpoints would be pruned by keep_last, or continued with other data)."""
    try:
        o, i, c = out.resolve(), init_arg.resolve(), init.resolve()
    except OSError:
        return
    if o in (i, c) or o in c.parents:
        raise ConfigError(f"--out {out} is the checkpoint being fine-tuned ({section}.init = {init_arg}) or holds "
                          f"it; {section.upper()} writes a run of its own. Choose another --out, e.g. "
                          f"{out}-{section}.")


__all__ = ["Start", "start_from_checkpoint", "tuning_config", "run_inputs", "check_run_inputs", "lora_line",
           "own_tokenizer_dir", "chat_template_line",
           "check_same_init", "check_same_base", "refuse_init_as_out", "TUNING_TRAIN_KEYS"]
