"""The stages behind each command. `cli.py` parses arguments and calls these.

Folders: the tokenizer stage writes `tokenizer.dir`; prepare reads it and writes
`data.dir`; pretrain reads both and writes a run folder (`--out`) with metrics.jsonl,
config.toml, the contract and tokenizer files, and `step_NNNNNN/` checkpoints.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch

from lmforge.config import Config
from lmforge.contract import CONTRACT_FILE
from lmforge.data.packing import shard_stream
from lmforge.data.shards import Shard, preflight, prepare
from lmforge.data.sources import SourceStats, iter_documents
from lmforge.model import Transformer, resolve_model_config
from lmforge.model.attention import resolve_backend
from lmforge.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer, train_tokenizer
from lmforge.train.distributed import init_distributed, shutdown
from lmforge.train.trainer import Trainer, check_run_dir, resolve_precision, seed_everything


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- tokenizer -----------------------------------------------------------------------
def train_tokenizer_stage(cfg: Config, out: str | Path | None = None, progress: bool = True) -> Tokenizer:
    """Train the BPE tokenizer on the training split of `data.source` into `out` (or tokenizer.dir)."""
    out = Path(out or cfg.tokenizer.dir)
    d = cfg.data
    stats = SourceStats()
    budget = cfg.tokenizer.max_train_bytes

    def texts():
        used = 0
        for doc in iter_documents(d.source, "train", d.val_fraction, d.include_tests, d.on_bad_utf8, stats):
            yield doc.text
            used += len(doc.text.encode("utf-8"))
            if budget and used >= budget:
                return

    t0 = time.perf_counter()
    tok = train_tokenizer(texts(), cfg.tokenizer.vocab_size, out, show_progress=progress)
    cfg.save(out / "config.toml")
    log(f"tokenizer: {tok.vocab_size} tokens (model vocab {tok.contract.model_vocab_size}) trained on "
        f"{stats.documents} documents in {time.perf_counter() - t0:.1f}s -> {out}"
        + (f" ({stats.bad_utf8} non-UTF-8 files skipped)" if stats.bad_utf8 else ""))
    return tok


# -- prepare -------------------------------------------------------------------------
def prepare_stage(cfg: Config, out: str | Path | None = None, progress: bool = True) -> dict:
    """Pretokenize `data.source` with the tokenizer in tokenizer.dir into `out` (or data.dir)."""
    out = Path(out or cfg.data.dir)
    tok = Tokenizer.load(cfg.tokenizer.dir)
    d = cfg.data
    meta = prepare(d.source, tok, out, d.val_fraction, d.include_tests, d.on_bad_utf8, progress)
    cfg.save(out / "config.toml")
    for split, m in meta["splits"].items():
        log(f"prepare: {split}: {m['documents']} documents, {m['tokens']:,} tokens, {m['bytes']:,} bytes "
            f"({m['bytes'] / max(1, m['tokens'] - 2 * m['documents']):.2f} bytes/token)")
    skipped = {k: meta[k] for k in ("skipped_bad_utf8", "skipped_empty", "skipped_duplicates") if meta.get(k)}
    if skipped:
        log(f"prepare: skipped {skipped}")
    return meta


# -- pretrain ------------------------------------------------------------------------
def copy_contract_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in (CONTRACT_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        shutil.copy2(src / name, dst / name)


def startup_report(model: Transformer, tok: Tokenizer, data: dict, cfg: Config, world: int,
                   device: torch.device, dtype) -> str:
    c, t = model.config, cfg.train
    per_step = t.micro_batch_size * t.grad_accum_steps * world * cfg.data.seq_len
    lines = [
        f"model: dim {c.dim}, {c.n_layers} layers, {c.n_heads} heads / {c.n_kv_heads} kv heads, "
        f"ffn {c.resolved_ffn_dim()}, {model.num_parameters():,} parameters "
        f"({model.num_parameters(non_embedding=True):,} non-embedding), attention {model.layers[0].attention.backend}",
        f"vocab: tokenizer {tok.vocab_size}, model {model.model_vocab_size} (padded to 64); special ids "
        + ", ".join(f"{k}={v}" for k, v in tok.contract.special_tokens.items()),
    ]
    for split, m in data.items():
        lines.append(f"data {split}: {m['documents']:,} documents, {m['tokens']:,} tokens, max id {m['max_id']}")
    lines.append(f"batch: {t.micro_batch_size} x {cfg.data.seq_len} tokens x {t.grad_accum_steps} accumulation x "
                 f"{world} ranks = {per_step:,} tokens/step; {t.steps} steps = {per_step * t.steps:,} tokens; "
                 f"device {device}, precision {'bf16 autocast' if dtype else 'fp32'}")
    return "\n".join(lines)


def pretrain_stage(cfg: Config, out: str | Path, resume: bool = False, dry_run: bool = False,
                   progress: bool = True) -> dict:
    """Pretrain from scratch (or `--resume`) on data.dir; returns the last step's metrics."""
    out = Path(out)
    info = init_distributed(cfg)  # validates the parallel degrees against WORLD_SIZE first
    try:
        backend = resolve_backend(cfg.model.attention, info.device, training=True)  # before any work
        tok = Tokenizer.load(cfg.tokenizer.dir)
        tok_contract_path = Path(cfg.tokenizer.dir) / CONTRACT_FILE
        data = preflight(cfg.data.dir, tok.contract, tok_contract_path)
        if not dry_run:
            check_run_dir(out, resume)
        seed_everything(cfg.train.seed)
        model = Transformer(resolve_model_config(cfg.model, tok.contract))
        model.set_attention(backend)
        model.reset_parameters(seed=cfg.train.seed, zero_init=cfg.train.zero_init)
        train = Shard.open(cfg.data.dir, "train", tok.contract, tok_contract_path)
        val = Shard.open(cfg.data.dir, "val", tok.contract, tok_contract_path)
        d, t = cfg.data, cfg.train
        stream = shard_stream(train, d.seq_len, t.micro_batch_size, t.seed, d.document_masking,
                              rank=info.rank, world_size=info.world_size)
        from lmforge.evaluate import shard_batches

        def val_batches():
            return shard_batches(val, d.seq_len, t.micro_batch_size, t.eval_tokens, d.document_masking)

        dtype = resolve_precision(t.precision, info.device)
        if info.is_main:
            log(startup_report(model, tok, data, cfg, info.world_size, info.device, dtype))
            log(stream.epoch_report())
        return run_training(cfg, out, Path(cfg.tokenizer.dir), model, stream, val_batches, info,
                            resume=resume, dry_run=dry_run, progress=progress)
    finally:
        shutdown(info)


def run_training(cfg: Config, out: Path, contract_dir: Path, model: Transformer, stream, val_batches, info,
                 resume: bool = False, dry_run: bool = False, progress: bool = True) -> dict:
    """The common tail of every training stage (pretrain, sft): one dry-run step, or the one
    `Trainer.fit` into `out` (continuing its newest checkpoint with `resume`). `contract_dir`
    holds the contract and tokenizer files copied into the run folder and its checkpoints."""
    if dry_run:
        return dry_run_step(model, stream, info.device, resolve_precision(cfg.train.precision, info.device))
    trainer = Trainer(cfg, out, Path(contract_dir), model, stream, val_batches, info, progress, log)
    if resume and not trainer.resume():  # before the copy: a mismatched --resume leaves the run folder as it was
        log(f"--resume: no checkpoint in {out} yet; starting from step 0")
    if info.is_main:
        copy_contract_files(Path(contract_dir), out)
        cfg.save(out / "config.toml")
    return trainer.fit()


def dry_run_step(model: Transformer, stream, device: torch.device, dtype) -> dict:
    """One forward and backward pass on one micro-batch; nothing written."""
    from lmforge.train.trainer import autocast

    model.to(device).train()
    b = stream.next_batch().to(device)
    with autocast(device, dtype):
        nats = model(b.tokens, b.positions, b.document_ids, targets=b.targets, loss_mask=b.loss_mask)
    (nats / max(1, b.n_supervised)).backward()
    loss = float(nats.detach()) / max(1, b.n_supervised)
    log(f"dry run: one micro-batch forward and backward, loss {loss:.4f} nats/token; all checks passed")
    return {"loss": loss, "dry_run": True}


# -- generate / eval -----------------------------------------------------------------
def load_for_inference(checkpoint: str | Path, tokenizer_dir: str | Path | None = None):
    """(model, tokenizer, config) from a checkpoint, checking a separate tokenizer if given."""
    from lmforge.train.checkpoint import load_model, read_checkpoint_meta, resolve_checkpoint

    path = resolve_checkpoint(checkpoint)
    read_checkpoint_meta(path)  # a checkpoint without config/contract is named as a checkpoint
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else path
    tok = Tokenizer.load(tok_dir)
    model, cfg, _, _ = load_model(path, "cpu", tok.contract, tok_dir / CONTRACT_FILE)
    return model, tok, cfg


def generate_text(model: Transformer, tok: Tokenizer, prompt: str, sampling, seed: int | None = None,
                  truncate: bool = False) -> str:
    """Complete `prompt` (a document start: <|bos|> is prepended); stops at <|eos|>."""
    from lmforge.generate import generate

    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    # fp32 on CPU: decoding is latency-bound, and autocast would re-cast every weight each step.
    ids = generate(model, [[tok.bos_id, *tok.encode(prompt)]], [tok.eos_id], sampling, tok.pad_id,
                   truncate=truncate, generator=gen)[0]
    if ids and ids[-1] == tok.eos_id:
        ids = ids[:-1]
    return prompt + tok.decode(ids)


def eval_stage(checkpoint: str | Path, data_dir: str | Path | None = None, split: str = "val",
               out: str | Path | None = None) -> dict:
    """Held-out loss, perplexity and bits per byte of a checkpoint on a prepared split."""
    from lmforge.evaluate import evaluate_shard
    from lmforge.train.checkpoint import load_model, resolve_checkpoint

    path = resolve_checkpoint(checkpoint)
    model, cfg, contract, _ = load_model(path)
    data_dir = Path(data_dir or cfg.data.dir)
    preflight(data_dir, contract, path / CONTRACT_FILE)  # contract, ids < vocab, eos ends: before any forward
    shard = Shard.open(data_dir, split, contract, path / CONTRACT_FILE)
    dtype = resolve_precision(cfg.train.precision, torch.device("cpu"))
    res = evaluate_shard(model, shard, cfg.data.seq_len, cfg.train.micro_batch_size, "cpu", dtype,
                         cfg.data.document_masking)
    res.update(checkpoint=str(path), data=str(data_dir), split=split)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return res
