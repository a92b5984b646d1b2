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


def shard_batches(shard: Shard, seq_len: int, batch_size: int, max_tokens: int = 0,
                  document_masking: bool = True) -> Iterable[Batch]:
    """Every document of `shard` once, in order, packed; the last batch may be short.
    With `max_tokens`, stop after about that many tokens."""
    stream = shard_stream(shard, seq_len, batch_size, seed=0, document_masking=document_masking, shuffle=False)
    rows = stream.plan(0)
    limit = len(rows) if not max_tokens else min(len(rows), max(1, max_tokens // seq_len))
    from lmforge.data.packing import build_row, collate

    for i in range(0, limit, batch_size):
        chunk = rows[i: min(i + batch_size, limit)]
        yield collate([build_row(r, stream.get_tokens, None, seq_len, stream.pad_id, document_masking) for r in chunk])


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
    from lmforge.train.trainer import evaluate_batches

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


__all__ = ["evaluate_shard", "shard_batches", "xz_bits_per_byte", "split_texts"]
