"""Held-out evaluation: loss (nats/token), perplexity and bits per byte.

bits per byte = (total nats over every predicted token of the split, the closing <|eos|>
included) / ln 2 / (total UTF-8 bytes of the split's text). Tokenizer-independent, so it
compares across vocabularies and with a compressor (`xz_bits_per_byte`: xz -9e, i.e.
Python's lzma with preset 9 | PRESET_EXTREME, on the same text).
"""

from __future__ import annotations

import lzma
import math
from collections.abc import Iterable

import numpy as np
import torch

from lmforge.data.packing import Batch, shard_stream
from lmforge.data.shards import Shard
from lmforge.model.loss import cross_entropy_sum
from lmforge.runtime import CPU_FP32, Runtime


def batch_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The one model call on a `Batch`: summed nats over its supervised targets (0-dim
    float32), through `model.forward(..., targets=, loss_mask=)` so DDP/FSDP hooks run."""
    return model(batch.tokens, batch.positions, batch.document_ids, targets=batch.targets,
                 loss_mask=batch.loss_mask)


@torch.no_grad()
def evaluate_batches(model: torch.nn.Module, batches: Iterable[Batch], runtime: Runtime) -> tuple[float, int]:
    """(sum of nats, supervised targets) over `batches`, with the training loss function, on
    `runtime.device` under `runtime.autocast()` (the command's `training_runtime`). The
    model's train/eval mode is restored."""
    runtime.check_model(model)  # no float16 compute for (offset + w) norms
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    for b in batches:
        b = b.to(runtime.device)
        with runtime.autocast():
            nats = batch_loss(model, b)
        total += nats.double().cpu()
        count += b.n_supervised
    model.train(was_training)
    return float(total), count


def shard_batches(shard: Shard, seq_len: int, batch_size: int, max_tokens: int = 0,
                  document_masking: bool = True) -> Iterable[Batch]:
    """Every document of `shard` once, in order, packed; the last batch may be short.
    With `max_tokens`, stop after about that many tokens."""
    stream = shard_stream(shard, seq_len, batch_size, seed=0, document_masking=document_masking, shuffle=False)
    return stream.batches_once(max(1, max_tokens // seq_len) if max_tokens else 0)


def evaluate_shard(model: torch.nn.Module, shard: Shard, seq_len: int, batch_size: int = 16,
                   runtime: Runtime = CPU_FP32, document_masking: bool = True) -> dict:
    """Evaluate `model` (on `runtime.device`) on every document of `shard`, each target once,
    under `runtime.autocast()`.

    Documents are packed `seq_len` pairs to a row with document masking (a document longer
    than `seq_len` is scored in pieces, each from its own start). Returns a dict:
        loss           float, mean nats per predicted token (the closing <|eos|> included)
        perplexity     exp(loss)
        bits_per_byte  total nats / ln 2 / `bytes` (NaN when the shard records no bytes)
        tokens         int, targets scored (= shard tokens - documents)
        bytes          int, UTF-8 bytes of the split's text (from the shard's meta.json)
    """
    nats, count = evaluate_batches(model, shard_batches(shard, seq_len, batch_size, 0, document_masking), runtime)
    loss = nats / max(count, 1)
    nbytes = shard.n_bytes
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": nats / math.log(2) / nbytes if nbytes else float("nan"),
        "tokens": count,
        "bytes": nbytes,
    }


@torch.no_grad()
def sliding_window_bits_per_byte(logits_fn, shard: Shard, window: int, stride: int = 0, batch_size: int = 16,
                                 runtime: Runtime = CPU_FP32) -> dict:
    """Bits per byte with a sliding window: every target once, each with up to `window`
    tokens of its own document as context (parameter-golf's second score; report it beside
    `evaluate_shard`, never instead). Windows of `window` tokens start every `stride`
    (default window // 2) tokens of a document, the last one aligned to its end; a window
    scores only the targets no earlier window scored. `logits_fn(tokens (B, T), positions
    (B, T)) -> logits (B, T, V)`: any model (lmforge's, or a Hugging Face reference), called on
    `runtime.device` under `runtime.autocast()`.
    Returns {"loss", "bits_per_byte", "tokens", "bytes", "window", "stride"}."""
    stride = stride or max(1, window // 2)
    jobs: list[tuple[np.ndarray, int]] = []  # (window tokens incl. the last target, first scored target)
    for d in range(shard.n_documents):
        doc = np.asarray(shard.document(d), dtype=np.int64)
        n = len(doc) - 1  # targets
        if n <= window:
            jobs.append((doc, 0))
            continue
        starts = list(range(0, n - window, stride)) + [n - window]
        done = 0
        for s in starts:
            jobs.append((doc[s: s + window + 1], done - s))
            done = s + window
    total, count = 0.0, 0
    dev = runtime.device
    pad = shard.contract.pad_id
    for i in range(0, len(jobs), batch_size):
        chunk = jobs[i: i + batch_size]
        T = max(len(w) - 1 for w, _ in chunk)
        tokens = torch.full((len(chunk), T), int(pad), dtype=torch.int64)
        targets = torch.zeros((len(chunk), T), dtype=torch.int64)
        mask = torch.zeros((len(chunk), T), dtype=torch.bool)
        for r, (w, first) in enumerate(chunk):
            t = torch.from_numpy(w)
            tokens[r, : len(w) - 1] = t[:-1]
            targets[r, : len(w) - 1] = t[1:]
            mask[r, first: len(w) - 1] = True  # right padding never influences real tokens (causal)
        positions = torch.arange(T).expand(len(chunk), T)
        with runtime.autocast():
            logits = logits_fn(tokens.to(dev), positions.to(dev))
        total += float(cross_entropy_sum(logits, targets.to(dev), mask.to(dev)))
        count += int(mask.sum())
    nbytes = shard.n_bytes
    return {"loss": total / max(count, 1), "bits_per_byte": total / math.log(2) / nbytes if nbytes else float("nan"),
            "tokens": count, "bytes": nbytes, "window": window, "stride": stride}


def xz_bits_per_byte(texts: Iterable[str]) -> float:
    """Bits per byte of `xz -9e` on the concatenated UTF-8 texts (a reference point)."""
    data = b"".join(t.encode("utf-8") for t in texts)
    if not data:
        return float("nan")
    packed = lzma.compress(data, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
    return 8 * len(packed) / len(data)


def split_texts(shard: Shard, tokenizer) -> Iterable[str]:
    """The split's documents decoded back to text (exact: decode(encode(x)) == x)."""
    for i in range(shard.n_documents):
        doc = shard.document(i)
        yield tokenizer.decode(doc[1:-1].tolist())


__all__ = ["batch_loss", "evaluate_batches", "evaluate_shard", "sliding_window_bits_per_byte", "shard_batches",
           "xz_bits_per_byte", "split_texts"]
