"""`lmforge pretrain`: a model from scratch (or `--resume`) on the prepared shards in data.dir;
with `train.init`, continued pretraining of a checkpoint (an imported model too), all of its
weights or LoRA adapters on it.

Folders: the tokenizer stage writes `tokenizer.dir`; prepare reads it and writes
`data.dir`; pretrain reads both and writes a run folder (`--out`) with metrics.jsonl,
config.toml, the contract and tokenizer files, and `step_NNNNNN/` checkpoints.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from lmforge.config import Config
from lmforge.contract import CONTRACT_FILE
from lmforge.data.mixture import MixtureStream, check_mixture_folder, check_no_leak, mixture_sources
from lmforge.data.packing import shard_stream
from lmforge.errors import ConfigError
from lmforge.data.shards import Shard, preflight
from lmforge.evaluate import shard_batches
from lmforge.model import lora
from lmforge.model import Transformer, resolve_model_config
from lmforge.stages.common import log, run_training, startup_report, training_session
from lmforge.stages.tuning import check_run_inputs, start_from_checkpoint
from lmforge.tokenizer import Tokenizer


def pretrain_stage(cfg: Config, out: str | Path, resume: bool = False, dry_run: bool = False,
                   progress: bool = True, started: float | None = None) -> dict:
    """Pretrain from scratch, or continue pretraining the checkpoint `train.init` (all of its
    weights, or LoRA adapters on it with lora.rank > 0), on data.dir (or `--resume`); returns
    the last step's metrics (with `interrupted` and `signal` when a signal stopped it).
    `started`: the command's start, which train.time_budget_s counts from (the CLI passes the
    process's start, `lmforge.train.budget.command_start`; default: the training session's start).

    Raises:
        ConfigError: lora.rank > 0 without train.init (adapters need a trained base).
        CheckpointError / ContractError: train.init is not a checkpoint, or has another tokenizer
        than tokenizer.dir.
        OutputError: `out` is, holds or lies inside tokenizer.dir, data.dir, train.init or a
        train.eval_tasks file (`stages.tuning.check_run_inputs`).
    """
    check_run_inputs(cfg, out, "train", "pretrain")  # before any work: the run folder never one of its inputs
    init = None
    if cfg.train.init:  # its [model] is the run's; its contract must be tokenizer.dir's (checked at load)
        start = start_from_checkpoint(cfg, out, resume, "train", cfg.tokenizer.dir)
        cfg, model, init = start.cfg, start.model, start.init
    elif cfg.lora.rank > 0:
        raise ConfigError(f"lora.rank = {cfg.lora.rank}: pretraining from random weights has no base for adapters. "
                          f"Set train.init to a trained checkpoint to continue pretraining it with LoRA, use "
                          f"`lmforge sft --set sft.init=RUN --set lora.rank={cfg.lora.rank}`, or remove lora.rank "
                          f"(0 = train every weight).")
    with training_session(cfg, out, "pretrain", resume, dry_run, started) as s:
        cfg = s.cfg  # train.micro_batch_size = "auto" is resolved there
        tok = Tokenizer.load(cfg.tokenizer.dir)
        tok_contract_path = Path(cfg.tokenizer.dir) / CONTRACT_FILE
        d, t = cfg.data, cfg.train
        if d.sources:  # a mixture: rows drawn from each source by weight
            data, stream, val_batches = _mixture_data(cfg, tok, tok_contract_path, s.info.rank, s.info.world_size)
        else:
            data = preflight(d.dir, tok.contract, tok_contract_path)
            train = Shard.open(d.dir, "train", tok.contract, tok_contract_path)
            val = Shard.open(d.dir, "val", tok.contract, tok_contract_path)
            stream = shard_stream(train, d.seq_len, t.micro_batch_size, t.seed, d.document_masking,
                                  rank=s.info.rank, world_size=s.info.world_size)

            def val_batches():
                return shard_batches(val, d.seq_len, t.micro_batch_size, t.eval_tokens, d.document_masking)

        if init is None:  # from scratch: seeded weights, zero-initialised output projections by default
            model = Transformer(resolve_model_config(cfg.model, tok.contract))
            model.reset_parameters(seed=cfg.train.seed, zero_init=cfg.train.zero_init)
        model = s.place(model)

        if s.info.is_main:  # the start-up lines once, by rank 0
            if init is not None:
                what = (f"LoRA rank {cfg.lora.rank} on it ({lora.trainable_parameters(model):,} trainable parameters; "
                        f"checkpoints hold the adapters only)" if cfg.lora.rank > 0 else "every weight trains")
                log(f"pretrain: continuing {init}: {what}")
            log(startup_report(model, tok, data, cfg, s.info.world_size, s.runtime))
            log(stream.epoch_report())
        return run_training(s, Path(cfg.tokenizer.dir), model, stream, val_batches, resume=resume,
                            dry_run=dry_run, progress=progress, inputs={"data.dir": Path(cfg.data.dir)})


def _mixture_data(cfg: Config, tok: Tokenizer, tok_contract_path: Path, rank: int, world_size: int):
    """data.sources: (the start-up report's per-split totals, the `MixtureStream`, the validation
    batches: every source's val split, data_tokens x its share of train.eval_tokens).

    Raises:
        DataError: data.dir not prepared for these sources, a source's shards that fail
        `preflight`, or a validation document of one source in another's training split.
    """
    d, t = cfg.data, cfg.train
    sources = mixture_sources(d.sources)
    check_mixture_folder(d.dir, sources)
    folders = [Path(d.dir) / src.name for src in sources]
    data: dict[str, dict] = {}
    for folder in folders:
        for split, m in preflight(folder, tok.contract, tok_contract_path).items():
            total = data.setdefault(split, {"documents": 0, "tokens": 0, "max_id": -1})
            total["documents"] += m["documents"]
            total["tokens"] += m["tokens"]
            total["max_id"] = max(total["max_id"], m["max_id"])
    check_no_leak(folders, [src.name for src in sources])
    streams = [shard_stream(Shard.open(f, "train", tok.contract, tok_contract_path), d.seq_len, 1,
                            t.seed + i, d.document_masking) for i, f in enumerate(folders)]
    stream = MixtureStream(streams, sources, t.micro_batch_size, rank, world_size)
    vals = [Shard.open(f, "val", tok.contract, tok_contract_path) for f in folders]

    def val_batches():
        budgets = [max(d.seq_len, round(t.eval_tokens * p)) if t.eval_tokens else 0 for p in stream.shares]
        return itertools.chain.from_iterable(
            shard_batches(v, d.seq_len, t.micro_batch_size, n, d.document_masking) for v, n in zip(vals, budgets))

    return data, stream, val_batches
