"""`lmforge dpo`: direct preference optimisation (Rafailov et al. 2023, arXiv 2305.18290).

DPO is data and a loss, not a second trainer: `dpo_stage` loads the model from `dpo.init`
(usually an SFT run), reads preference pairs (lmforge.data.preferences; `dpo.data =
"stdlib"`: the embedded pairs of lmforge.data.stdlib_pairs), renders both replies of each
pair with the chat template, and runs the same `Trainer.fit` as pretraining and SFT with
`lmforge.train.dpo.DPOObjective` as its loss. The reference is `dpo.init` itself: with LoRA
(`[lora] rank > 0`) the model with its adapters disabled, otherwise a frozen copy, or its
log-probabilities precomputed once (`dpo.reference = "precomputed"`). The [dpo] section
supplies the step count, batch shape (pairs per micro-batch), learning rate and warm-up;
every other [train] key applies as it is.

The run folder holds what an SFT run folder holds (metrics.jsonl — with rewards/* and
logps/* per step and val_* at validation — config.toml, step_NNNNNN/ checkpoints, contract
and tokenizer files) plus `dpo_data.json` (the pair counts, per split and kind). Every other
command takes its checkpoints as it takes an SFT run's (a LoRA run's: adapters only, merged
at load).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lmforge.config import Config
from lmforge.data.preferences import (PairStream, cap_pairs, pair_batches, pair_from_record, read_pairs,
                                      render_pairs, split_pairs)
from lmforge.errors import ConfigError
from lmforge.stages.common import log, run_training, startup_report, training_session
from lmforge.stages.tuning import chat_template_line, lora_line, require_training, start_tuning, tuning_config
from lmforge.model.loss import REFERENCE_FREE
from lmforge.train.dpo import DPOObjective, live_reference, precompute, table_reference

DPO_DATA_FILE = "dpo_data.json"


def dpo_config(cfg: Config, init_cfg: Config) -> Config:
    """The config a DPO run trains and saves: [model] from the initial checkpoint, and [train]
    steps / micro_batch_size / grad_accum_steps / lr / warmup_steps from [dpo]
    (`stages.tuning.tuning_config`)."""
    return tuning_config(cfg, init_cfg.model, "dpo")


def load_pairs(cfg: Config) -> tuple[dict[str, list], dict]:
    """Preference pairs by split, and counts. `dpo.data = "stdlib"`: the embedded pairs (SFT's
    functions and split); a file: split by the prompt's hash with data.val_fraction. Training
    pairs capped at dpo.max_examples, held-out ones at dpo.val_examples.

    Raises:
        DataError: a bad file (file and line), or no training pair.
    """
    d, p = cfg.data, cfg.dpo
    info: dict = {"source": p.data}
    if p.data == "stdlib":
        from lmforge.data.stdlib_pairs import PairStats, stdlib_preference_pairs

        stats = PairStats()
        records = stdlib_preference_pairs(d.val_fraction, seed=cfg.train.seed, max_train=p.max_examples,
                                          max_chars=p.max_chars, include_tests=d.include_tests, stats=stats)
        pairs = {split: [pair_from_record(r, r["name"]) for r in recs] for split, recs in records.items()}
        info.update(stats.as_dict())
    else:
        pairs = split_pairs(read_pairs(p.data), d.val_fraction)
        pairs["train"] = cap_pairs(pairs["train"], p.max_examples)
    pairs["val"] = cap_pairs(pairs["val"], p.val_examples)
    require_training(pairs, cfg, "dpo", "pair")
    return pairs, info


def dpo_stage(cfg: Config, out: str | Path, resume: bool = False, dry_run: bool = False,
              progress: bool = True) -> dict:
    """Preference-tune the checkpoint `dpo.init` on `dpo.data`; returns the last step's metrics
    (with the val_* figures of the held-out pairs).

    Raises:
        ConfigError: dpo.init not set; lora.dropout > 0; a config that does not fit the checkpoint.
        CheckpointError / ContractError: dpo.init is not a checkpoint, or has another tokenizer.
        DataError: bad pairs (naming file and line), or nothing left to train on.
    """
    if not cfg.dpo.init:
        raise ConfigError("dpo.init is empty: set the checkpoint to tune, e.g. --set dpo.init=runs/sft (an SFT run "
                          "folder or one of its step_NNNNNN folders); it is also the reference model.")
    if cfg.lora.rank > 0 and cfg.lora.dropout > 0 and cfg.dpo.loss not in REFERENCE_FREE:
        raise ConfigError(f"lora.dropout = {cfg.lora.dropout}: DPO compares the model with its reference, and "
                          f"dropout would make that comparison random (the loss at step 0 would not be ln 2). Set "
                          f"lora.dropout = 0 for dpo.")
    start = start_tuning(cfg, out, resume, "dpo")
    cfg, model, tok, init = start.cfg, start.model, start.tok, start.init
    with training_session(cfg, out, "dpo", resume, dry_run) as session:
        info, rt, model = session.info, session.runtime, session.place(model)
        d, t, p = cfg.data, cfg.train, cfg.dpo
        t0 = time.perf_counter()
        pairs, data_info = load_pairs(cfg)
        samples = {split: render_pairs(ps, tok, d.seq_len) for split, ps in pairs.items()}
        stream = PairStream(samples["train"], d.seq_len, t.micro_batch_size, tok.pad_id, t.seed,
                            rank=info.rank, world_size=info.world_size, packing=p.packing)
        val = samples["val"]
        reference = live_reference(model, rt) if p.loss not in REFERENCE_FREE else None
        val_reference = reference
        if p.reference == "precomputed" and reference is not None:
            ref_t0 = time.perf_counter()
            reference = table_reference(*precompute(reference, samples["train"], d.seq_len, t.micro_batch_size,
                                                    tok.pad_id, rt, p.packing))
            val_reference = table_reference(*precompute(val_reference, val, d.seq_len, t.micro_batch_size,
                                                        tok.pad_id, rt, p.packing))
            data_info["reference_seconds"] = round(time.perf_counter() - ref_t0, 2)
        objective = DPOObjective(p, reference, val_reference, val.mutations)
        data_info["seconds"] = round(time.perf_counter() - t0, 2)
        data_info["splits"] = {split: smp.counts() for split, smp in samples.items()}
        data_info.update(seq_len=d.seq_len, init=str(init), beta=p.beta, loss=p.loss, reference=p.reference,
                         packing=p.packing, padding_fraction=round(stream.padding_fraction(), 4))

        def val_batches():
            return pair_batches(val, d.seq_len, t.micro_batch_size, tok.pad_id, p.packing)

        if info.is_main:
            _say_startup(cfg, model, tok, init, rt, objective, info.world_size, samples, data_info)
        side = {DPO_DATA_FILE: json.dumps(data_info, indent=2, default=str) + "\n"}
        return run_training(session, tok.folder, model, stream, val_batches if len(val) else None,
                            resume=resume, dry_run=dry_run, progress=progress, side_files=side,
                            objective=objective, inputs={} if p.data == "stdlib" else {"dpo.data": Path(p.data)})


def _say_startup(cfg: Config, model, tok, init: Path, rt, objective, world_size: int, samples: dict,
                 data_info: dict) -> None:
    """The start-up lines of a DPO run (the main process's): the run, `startup_report`, the
    template, LoRA, each split's pairs (`samples`: rendered, by split) and the rows."""
    d, p = cfg.data, cfg.dpo
    report = {split: {"documents": 2 * len(smp), "tokens": smp.counts()["tokens"],
                      "max_id": max((int(x.max()) for side in smp.ids.values() for x in side), default=-1)}
              for split, smp in samples.items()}
    log(f"dpo: init {init} (also the reference: {_reference_line(cfg)}); data {p.data!r}; loss {p.loss}, "
        f"beta {p.beta:g}")
    log(startup_report(model, tok, report, cfg, world_size, rt, objective))
    log(f"dpo: {chat_template_line(tok)}")
    if cfg.lora.rank > 0:
        log(f"dpo: {lora_line(cfg, model, init)}")
    for split, smp in samples.items():
        c = smp.counts()
        kinds = data_info.get("kinds", {}).get(split)
        log(f"dpo data {split}: {c['pairs']} pairs, {c['truncated']} truncated to seq_len {d.seq_len} "
            f"(tail cut), {c['dropped_empty']} dropped (a completion was cut away entirely), "
            f"{c['completion_tokens']:,} completion tokens" + (f"; kinds {kinds}" if kinds else ""))
    log(f"dpo rows: {'packed (each side its own segment)' if p.packing else 'right-padded, one side a row'}, "
        f"padding {data_info['padding_fraction']:.1%} of the training rows; data read and rendered in "
        f"{data_info['seconds']:.1f}s")


def _reference_line(cfg: Config) -> str:
    if cfg.dpo.loss in REFERENCE_FREE:
        return f"none: dpo.loss = {cfg.dpo.loss!r} needs no reference model"
    how = "its log-probabilities precomputed once" if cfg.dpo.reference == "precomputed" else "computed every step"
    what = "the model with its adapters disabled" if cfg.lora.rank > 0 else "a frozen copy"
    return f"{what}, {how}"


__all__ = ["dpo_stage", "dpo_config", "load_pairs", "DPO_DATA_FILE"]
