"""`lmforge sft`: supervised fine-tuning.

SFT is data, not a second trainer: `sft_stage` loads the model from `sft.init`, checks its
contract against the tokenizer, renders conversations into rows (lmforge.data.conversations) and
runs the same `Trainer.fit` as pretraining, with the same loss (P3). The [sft] section
supplies the step count, batch shape, learning rate, warm-up, optimizer and schedule; every other
[train] key (weight decay, clipping, precision, seed, checkpointing) applies as it is.

The SFT run folder holds what a pretraining run folder holds (metrics.jsonl, config.toml
with the [train] values actually used, step_NNNNNN/ checkpoints, contract and tokenizer
files) plus `sft_data.json` (counts: conversations, truncated, dropped) and
`sft_val.jsonl` (the held-out conversations validated on).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from lmforge.config import Config
from lmforge.data.conversations import (Conversation, cap_examples, read_conversations, render_samples, sft_batches,
                                        sft_stream, split_conversations)
from lmforge.data.stdlib_functions import StdlibStats, stdlib_examples
from lmforge.errors import ConfigError
from lmforge.stages.common import log, run_training, startup_report, training_session
from lmforge.stages.tuning import chat_template_line, lora_line, require_training, start_tuning, tuning_config

SFT_DATA_FILE = "sft_data.json"
SFT_VAL_FILE = "sft_val.jsonl"


# -- configuration -------------------------------------------------------------------------
def sft_config(cfg: Config, init_cfg: Config) -> Config:
    """The config an SFT run trains and saves: [model] from the initial checkpoint, and
    [train] steps / micro_batch_size / grad_accum_steps / lr / warmup_steps / optimizer / schedule from [sft]
    (`stages.tuning.tuning_config`).

    Raises:
        ConfigError: e.g. data.seq_len above the checkpoint's model.max_seq_len.
    """
    return tuning_config(cfg, init_cfg.model, "sft")


# -- data ---------------------------------------------------------------------------------
def load_conversations(cfg: Config) -> tuple[dict[str, list[Conversation]], dict[str, list], dict]:
    """SFT conversations by split, the held-out stdlib functions (empty for files), and counts.

    `sft.data` = "stdlib": the standard-library function set, split by module with the
    pretraining rule; otherwise a JSONL / Parquet file split by content hash. Training
    conversations are capped at sft.max_examples, validation ones at sft.val_examples
    (both by a stable hash).

    Raises:
        DataError: a bad file (naming file and line), or no training conversation.
    """
    s, d = cfg.sft, cfg.data
    info: dict = {"source": s.data}
    functions: dict[str, list] = {"train": [], "val": []}
    if s.data == "stdlib":
        stats = StdlibStats()
        functions = stdlib_examples(d.val_fraction, s.max_chars, s.max_examples, d.include_tests, stats)
        functions["val"] = cap_examples(functions["val"], s.val_examples, lambda e: f"{e.module}:{e.qualname}")
        convs = {split: [e.conversation() for e in exs] for split, exs in functions.items()}
        info.update(modules_parsed=stats.modules, functions_found=stats.functions,
                    left_out_too_long=stats.too_long, left_out_per_module_cap=stats.per_module_cap,
                    left_out_val_duplicates=stats.val_duplicates)
    else:
        convs = split_conversations(read_conversations(s.data), d.val_fraction)
        convs["train"] = cap_examples(convs["train"], s.max_examples, lambda c: c.key)
        convs["val"] = cap_examples(convs["val"], s.val_examples, lambda c: c.key)
    require_training(convs, cfg, "sft", "conversation")
    return convs, functions, info


def val_records(convs: Sequence[Conversation], functions: Sequence) -> str:
    """sft_val.jsonl's text: each held-out conversation, with its signature and reference
    body when it is a standard-library function."""
    by_name = {f"{f.module}:{f.qualname}": f for f in functions}
    lines = []
    for c in convs:
        rec = {"name": c.name, "messages": list(c.messages)}
        fn = by_name.get(c.name)
        if fn is not None:
            rec.update(signature=fn.signature, body=fn.body)
        lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
    return "".join(lines)


# -- the stage --------------------------------------------------------------------------------
def sft_stage(cfg: Config, out: str | Path, resume: bool = False, dry_run: bool = False,
              progress: bool = True) -> dict:
    """Fine-tune the checkpoint `sft.init` on `sft.data`; returns the last step's metrics
    (with `val_loss`, the mean nats per supervised token on the held-out conversations).

    Raises:
        ConfigError: sft.init not set, or a config that does not fit the checkpoint.
        CheckpointError / ContractError: sft.init is not a checkpoint, or was trained with
        another tokenizer than tokenizer.dir.
        DataError: bad SFT data (naming file and line), or nothing left to train on.
    """
    if not cfg.sft.init:
        raise ConfigError("sft.init is empty: set the checkpoint to fine-tune, e.g. --set sft.init=runs/pre "
                          "(a pretraining run folder or one of its step_NNNNNN folders).")
    start = start_tuning(cfg, out, resume, "sft")
    cfg, model, tok, init = start.cfg, start.model, start.tok, start.init
    with training_session(cfg, out, "sft", resume, dry_run) as session:
        info, model = session.info, session.place(model)
        d, t, s = cfg.data, cfg.train, cfg.sft
        t0 = time.perf_counter()
        convs, functions, data_info = load_conversations(cfg)
        samples = {split: render_samples(c, tok, d.seq_len) for split, c in convs.items()}
        data_info["seconds"] = round(time.perf_counter() - t0, 2)
        stream = sft_stream(samples["train"], d.seq_len, t.micro_batch_size, tok.pad_id, t.seed, s.packing,
                            rank=info.rank, world_size=info.world_size)
        val = samples["val"]

        def val_batches():
            return sft_batches(val, d.seq_len, t.micro_batch_size, tok.pad_id, s.packing)

        counts = {split: smp.counts() for split, smp in samples.items()}
        stream.plan(0)
        data_info.update(splits=counts, seq_len=d.seq_len, packing=s.packing, init=str(init),
                         padding_fraction=round(stream.last_padding_fraction, 4))
        if info.is_main:
            report = {split: {"documents": smp.counts()["kept"], "tokens": smp.tokens,
                              "max_id": max((int(x.max()) for x in smp.ids), default=-1)}
                      for split, smp in samples.items()}
            log(f"sft: init {init}; data {s.data!r}, {'packed with document masking' if s.packing else 'right-padded'}")
            log(startup_report(model, tok, report, cfg, info.world_size, session.runtime))
            log(f"sft: {chat_template_line(tok)}")
            if cfg.lora.rank > 0:
                log(f"sft: {lora_line(cfg, model, init)}")
            for split, c in counts.items():
                log(f"sft data {split}: {c['conversations']} conversations, {c['truncated']} truncated to "
                    f"seq_len {d.seq_len} (tail cut), {c['dropped_all_cut']} dropped (every supervised token "
                    f"was cut), {c['supervised']:,} supervised targets")
            log(f"sft rows: padding {data_info['padding_fraction']:.1%} of the training rows; data read and "
                f"rendered in {data_info['seconds']:.1f}s")
        side = {SFT_DATA_FILE: json.dumps(data_info, indent=2) + "\n",
                SFT_VAL_FILE: val_records(convs["val"], functions.get("val", []))}
        return run_training(session, tok.folder, model, stream, val_batches if val.ids else None,
                            resume=resume, dry_run=dry_run, progress=progress, side_files=side,
                            inputs={} if cfg.sft.data == "stdlib" else {"sft.data": Path(cfg.sft.data)})
