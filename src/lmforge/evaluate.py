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

import torch

from lmforge.data.packing import Batch, shard_stream
from lmforge.data.shards import Shard
from lmforge.runtime import autocast


def batch_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The one model call on a `Batch`: summed nats over its supervised targets (0-dim
    float32), through `model.forward(..., targets=, loss_mask=)` so DDP/FSDP hooks run."""
    return model(batch.tokens, batch.positions, batch.document_ids, targets=batch.targets,
                 loss_mask=batch.loss_mask)


@torch.no_grad()
def evaluate_batches(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device,
                     dtype: torch.dtype | None) -> tuple[float, int]:
    """(sum of nats, supervised targets) over `batches`, with the training loss function;
    `dtype` is the autocast dtype (None = fp32). The model's train/eval mode is restored."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    for b in batches:
        b = b.to(device)
        with autocast(device, dtype):
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
                   device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                   document_masking: bool = True) -> dict:
    """Evaluate `model` on every document of `shard`, each target once.

    Documents are packed `seq_len` pairs to a row with document masking (a document longer
    than `seq_len` is scored in pieces, each from its own start); `dtype` is an autocast
    dtype or None for fp32. Returns a dict:
        loss           float, mean nats per predicted token (the closing <|eos|> included)
        perplexity     exp(loss)
        bits_per_byte  total nats / ln 2 / `bytes` (NaN when the shard records no bytes)
        tokens         int, targets scored (= shard tokens - documents)
        bytes          int, UTF-8 bytes of the split's text (from the shard's meta.json)
    """
    nats, count = evaluate_batches(model, shard_batches(shard, seq_len, batch_size, 0, document_masking),
                                   torch.device(device), dtype)
    loss = nats / max(count, 1)
    nbytes = shard.n_bytes
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": nats / math.log(2) / nbytes if nbytes else float("nan"),
        "tokens": count,
        "bytes": nbytes,
    }


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


__all__ = ["batch_loss", "evaluate_batches", "evaluate_shard", "shard_batches", "xz_bits_per_byte", "split_texts"]
