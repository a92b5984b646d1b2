"""`lmforge pretrain`: a model from scratch (or `--resume`) on the prepared shards in data.dir.

Folders: the tokenizer stage writes `tokenizer.dir`; prepare reads it and writes
`data.dir`; pretrain reads both and writes a run folder (`--out`) with metrics.jsonl,
config.toml, the contract and tokenizer files, and `step_NNNNNN/` checkpoints.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.config import Config
from lmforge.contract import CONTRACT_FILE
from lmforge.data.packing import shard_stream
from lmforge.errors import ConfigError
from lmforge.data.shards import Shard, preflight
from lmforge.evaluate import shard_batches
from lmforge.model import Transformer, resolve_model_config
from lmforge.stages.common import log, run_training, startup_report, training_session
from lmforge.tokenizer import Tokenizer


def pretrain_stage(cfg: Config, out: str | Path, resume: bool = False, dry_run: bool = False,
                   progress: bool = True) -> dict:
    """Pretrain from scratch (or `--resume`) on data.dir; returns the last step's metrics
    (with `interrupted` and `signal` when a signal stopped it).

    Raises:
        ConfigError: lora.rank > 0 (adapters need a trained base: `lmforge sft` takes them).
    """
    if cfg.lora.rank > 0:
        raise ConfigError(f"lora.rank = {cfg.lora.rank}: pretraining starts from random weights, and LoRA adapts a "
                          f"trained base. Use `lmforge sft --set sft.init=RUN --set lora.rank={cfg.lora.rank}`, or "
                          f"remove lora.rank (0 = train every weight).")
    with training_session(cfg, out, "pretrain", resume, dry_run) as s:
        tok = Tokenizer.load(cfg.tokenizer.dir)
        tok_contract_path = Path(cfg.tokenizer.dir) / CONTRACT_FILE
        data = preflight(cfg.data.dir, tok.contract, tok_contract_path)
        model = Transformer(resolve_model_config(cfg.model, tok.contract))
        model.set_attention(s.backend)
        model.reset_parameters(seed=cfg.train.seed, zero_init=cfg.train.zero_init)
        train = Shard.open(cfg.data.dir, "train", tok.contract, tok_contract_path)
        val = Shard.open(cfg.data.dir, "val", tok.contract, tok_contract_path)
        d, t = cfg.data, cfg.train
        stream = shard_stream(train, d.seq_len, t.micro_batch_size, t.seed, d.document_masking,
                              rank=s.info.rank, world_size=s.info.world_size)

        def val_batches():
            return shard_batches(val, d.seq_len, t.micro_batch_size, t.eval_tokens, d.document_masking)

        if s.info.is_main:
            log(startup_report(model, tok, data, cfg, s.info.world_size, s.runtime))
            log(stream.epoch_report())
        s.open_run()  # after every input check: refused input leaves no run folder behind
        return run_training(s, Path(cfg.tokenizer.dir), model, stream, val_batches, resume=resume,
                            dry_run=dry_run, progress=progress)
