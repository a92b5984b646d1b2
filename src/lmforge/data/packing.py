"""Rows for training: documents packed (or right-padded) into `seq_len` slots.

Every training example is a *sample*: a token sequence d[0..L) (a pretraining
document `[bos] text [eos]`, or a rendered conversation) with a per-token learn
flag. A sample gives L - 1 (input, target) pairs: input d[i], target d[i+1],
supervised when the target's learn flag is set (all of them for pretraining; the
assistant's tokens for SFT). The EOS is never an input, so no target ever crosses
into the next document.

A sample longer than `seq_len` pairs is cut into pieces of at most `seq_len` pairs.
A piece that starts mid-document is its own attention segment: it attends only to
itself, its positions count from 0, and every one of its targets keeps its learn
flag (its first target is predicted from the one token of context the piece has).

A row carries (all (T,), T = seq_len):
    tokens      int64  inputs; `pad_id` in padding slots
    targets     int64  next tokens; `pad_id` in padding slots (never read: masked)
    loss_mask   bool   supervised targets; False in padding and unsupervised slots
    document_ids int32 segment of each slot (0, 1, 2, … in row order); padding is one
                       more segment after the last document, so every slot attends to
                       at least itself
    positions   int64  rotary position: 0 at the start of each segment
Labels are masked by `loss_mask` only, never by comparing ids with `pad_id` (P4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmforge.errors import DataError

# (sample index, first pair, number of pairs)
Piece = tuple[int, int, int]


@dataclass
class Batch:
    """A micro-batch: every field (B, T); see the module docstring."""

    tokens: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    document_ids: torch.Tensor
    positions: torch.Tensor

    @property
    def n_supervised(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(getattr(self, f).to(device, non_blocking=True) for f in _FIELDS))


_FIELDS = ("tokens", "targets", "loss_mask", "document_ids", "positions")


def split_pieces(sample: int, n_pairs: int, seq_len: int) -> list[Piece]:
    return [(sample, s, min(seq_len, n_pairs - s)) for s in range(0, n_pairs, seq_len)]


def plan_packed(n_pairs: Sequence[int], order: Sequence[int], seq_len: int, max_open: int = 64) -> list[list[Piece]]:
    """Greedy first-fit packing of samples (in `order`) into rows of `seq_len` pairs.

    Full pieces become rows at once; shorter ones go to the first open row with room.
    When `max_open` rows are open and none fits, the fullest is closed. Deterministic.
    """
    rows: list[list[Piece]] = []
    open_rows: list[list[Piece]] = []
    room: list[int] = []
    for s in order:
        if n_pairs[s] <= 0:
            continue
        for piece in split_pieces(int(s), int(n_pairs[s]), seq_len):
            n = piece[2]
            if n == seq_len:
                rows.append([piece])
                continue
            for j, r in enumerate(room):
                if r >= n:
                    open_rows[j].append(piece)
                    room[j] -= n
                    if room[j] == 0:
                        rows.append(open_rows.pop(j))
                        room.pop(j)
                    break
            else:
                if len(open_rows) >= max_open:
                    j = int(np.argmin(room))
                    rows.append(open_rows.pop(j))
                    room.pop(j)
                open_rows.append([piece])
                room.append(seq_len - n)
    rows.extend(open_rows)
    return rows


def plan_padded(n_pairs: Sequence[int], order: Sequence[int], seq_len: int) -> list[list[Piece]]:
    """One sample per row, right-padded; a sample longer than `seq_len` pairs keeps its
    first `seq_len` pairs (the tail is truncated)."""
    return [[(int(s), 0, min(int(n_pairs[s]), seq_len))] for s in order if n_pairs[s] > 0]


def build_row(
    pieces: Sequence[Piece],
    get_tokens: Callable[[int, int, int], np.ndarray],
    get_learn: Callable[[int, int, int], np.ndarray] | None,
    seq_len: int,
    pad_id: int,
    document_masking: bool = True,
) -> dict[str, np.ndarray]:
    """Assemble one row (see the module docstring).

    get_tokens(sample, start, stop) -> tokens d[start:stop]; get_learn likewise for the
    per-token learn flags (None: every target is learned).
    """
    T = seq_len
    tokens = np.full(T, pad_id, dtype=np.int64)
    targets = np.full(T, pad_id, dtype=np.int64)
    loss_mask = np.zeros(T, dtype=bool)
    document_ids = np.zeros(T, dtype=np.int32)
    positions = np.zeros(T, dtype=np.int64)
    at = 0
    for seg, (s, start, n) in enumerate(pieces):
        d = np.asarray(get_tokens(s, start, start + n + 1), dtype=np.int64)
        tokens[at: at + n] = d[:n]
        targets[at: at + n] = d[1: n + 1]
        if get_learn is None:
            loss_mask[at: at + n] = True
        else:
            loss_mask[at: at + n] = np.asarray(get_learn(s, start + 1, start + n + 1), dtype=bool)
        document_ids[at: at + n] = seg
        positions[at: at + n] = np.arange(n)
        at += n
    if at < T:  # padding: one more segment
        document_ids[at:] = len(pieces)
        positions[at:] = np.arange(T - at)
    if not document_masking:
        document_ids[:] = 0
        positions[:] = np.arange(T)
    return {"tokens": tokens, "targets": targets, "loss_mask": loss_mask,
            "document_ids": document_ids, "positions": positions}


def collate(rows: Sequence[dict[str, np.ndarray]]) -> Batch:
    return Batch(*(torch.from_numpy(np.stack([r[f] for r in rows])) for f in _FIELDS))


def padding_fraction(rows: Sequence[Sequence[Piece]], seq_len: int) -> float:
    used = sum(n for row in rows for (_, _, n) in row)
    return 1.0 - used / max(1, len(rows) * seq_len)


class RowStream:
    """An endless, resumable stream of micro-batches over samples, epoch after epoch.

    Epoch e shuffles the samples with numpy's generator seeded by (seed, e) and plans the
    rows (packed or padded). The epochs' rows, one after another, form one global row
    sequence, dealt out W at a time: the k-th row of this rank's stream is global row
    k * W + rank (rank r of W takes rows r, r + W, …; across an epoch's end it goes on
    into the next epoch, nothing is dropped). So an optimizer step of A micro-batches of
    B rows on each of W ranks uses global rows [s * A * B * W, (s + 1) * A * B * W),
    whatever the split into ranks and micro-batches: W ranks with accumulation A see the
    rows that one process with accumulation A * W sees.
    The position (epoch, global row cursor within the epoch) is all the state, the same on
    every rank; `state_dict` / `load_state_dict` resume exactly.
    """

    def __init__(
        self,
        n_pairs: np.ndarray,
        get_tokens: Callable[[int, int, int], np.ndarray],
        get_learn: Callable[[int, int, int], np.ndarray] | None,
        seq_len: int,
        micro_batch_size: int,
        pad_id: int,
        seed: int,
        packing: bool = True,
        document_masking: bool = True,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.n_pairs = np.asarray(n_pairs)
        self.get_tokens, self.get_learn = get_tokens, get_learn
        self.seq_len, self.micro_batch_size, self.pad_id = seq_len, micro_batch_size, pad_id
        self.seed, self.packing, self.document_masking, self.shuffle = seed, packing, document_masking, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch, self.cursor = 0, 0
        self._plan_epoch: int | None = None
        self._rows: list[list[Piece]] = []
        self.last_padding_fraction = 0.0

    def plan(self, epoch: int) -> list[list[Piece]]:
        if self._plan_epoch != epoch:
            order = np.arange(len(self.n_pairs))
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.n_pairs))
            plan = plan_packed if self.packing else plan_padded
            self._rows = plan(self.n_pairs, order, self.seq_len)
            self._plan_epoch = epoch
            self.last_padding_fraction = padding_fraction(self._rows, self.seq_len)
        return self._rows

    def rows_per_epoch(self) -> int:
        return len(self.plan(self.epoch))

    def next_batch(self) -> Batch:
        rows = []
        for _ in range(self.micro_batch_size):
            epoch, i = self._ahead(self.rank)  # this rank's row among the next W global rows
            rows.append(build_row(self.plan(epoch)[i], self.get_tokens, self.get_learn, self.seq_len,
                                  self.pad_id, self.document_masking))
            self.epoch, self.cursor = self._ahead(self.world_size)
        return collate(rows)

    def _ahead(self, k: int) -> tuple[int, int]:
        """(epoch, row) of the global row `k` rows past the current position."""
        epoch, i = self.epoch, self.cursor + k
        while i >= (n := len(self.plan(epoch))):
            if n == 0:
                raise DataError("the training data has no sample with a target (every sample is empty "
                                "or unsupervised): there are no rows to train on. Check the data source.")
            epoch, i = epoch + 1, i - n
        return epoch, i

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def shard_stream(shard, seq_len: int, micro_batch_size: int, seed: int, document_masking: bool = True,
                 shuffle: bool = True, rank: int = 0, world_size: int = 1) -> RowStream:
    """A RowStream over a pretraining `Shard`: every document a sample, every target learned."""
    offsets = shard.offsets
    tokens = shard.tokens

    def get_tokens(s: int, start: int, stop: int) -> np.ndarray:
        return tokens[offsets[s] + start: offsets[s] + stop]

    return RowStream(shard.lengths() - 1, get_tokens, None, seq_len, micro_batch_size,
                     shard.contract.pad_id, seed, packing=True, document_masking=document_masking,
                     shuffle=shuffle, rank=rank, world_size=world_size)
