"""Rows for training: documents packed (or right-padded) into `seq_len` slots.

Every training example is a *sample*: a token sequence d[0..L) (a pretraining
document `[bos] text [eos]`, or a rendered conversation) with a per-token learn
flag. Sample boundaries come from the data's own structure (the shard's `.idx`
offsets, or the list of conversations), never from token values: an EOS or
end-of-turn id inside a sample does not end it (P2). A sample gives L - 1
(input, target) pairs: input d[i], target d[i+1], supervised when the target's learn
flag is set (all of them for pretraining; the assistant's tokens for SFT). The last
pair of a sample is (d[L-2], d[L-1] = EOS); the EOS itself is never an input, so no
target ever crosses into the next sample.

Packing (`plan_packed`) is greedy best-fit over the epoch's shuffled order: a sample
longer than `seq_len` pairs is cut into pieces of `seq_len` pairs (each a full row of
its own) and one shorter tail; every piece shorter than a row goes into the open row
with the least room that fits it. Every pair of every sample lands in exactly one row slot per epoch
(and `RowStream` deals every row of an epoch out exactly once, over all ranks).
`padding_fraction` measures the waste; `RowStream` records it per epoch
(`padding_fractions`, `epoch_report`).

A piece that starts mid-sample is its own attention segment: it attends only to
itself, its positions count from 0 (not from its offset in the sample), and every one
of its targets keeps its learn flag: its first target, d[start+1], is predicted from
the one token of context the piece has (d[start], the previous piece's last target).
So the pairs of a long document are all trained on, once, with context truncated at
piece boundaries.

A row carries (all (T,), T = seq_len):
    tokens      int64  inputs; `pad_id` in padding slots
    targets     int64  next tokens; `pad_id` in padding slots (never read: masked)
    loss_mask   bool   supervised targets; False in padding and unsupervised slots
    document_ids int32 segment of each slot (0, 1, 2, … in row order); padding is one
                       more segment after the last piece, so every slot attends to
                       at least itself and no real token attends to padding
    positions   int64  rotary position: 0 at the start of each segment
With `document_masking=False` every slot is in segment 0 and positions run 0..T-1:
plain causal attention over the whole row (for comparison, and for right-padded rows
where causal attention alone keeps padding out of every real token).
Labels are masked by `loss_mask` only, never by comparing ids with `pad_id` (P4).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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
        return Batch(*(getattr(self, f).to(device, non_blocking=True) for f in FIELDS))


FIELDS = ("tokens", "targets", "loss_mask", "document_ids", "positions")


def split_pieces(sample: int, n_pairs: int, seq_len: int) -> list[Piece]:
    """Cut a sample of `n_pairs` pairs into pieces (sample, first pair, pairs) of `seq_len`
    pairs each, the last one shorter when `seq_len` does not divide `n_pairs`."""
    return [(sample, s, min(seq_len, n_pairs - s)) for s in range(0, n_pairs, seq_len)]


def plan_packed(n_pairs: Sequence[int], order: Sequence[int], seq_len: int, max_open: int = 64) -> list[list[Piece]]:
    """Greedy best-fit packing of samples (in `order`) into rows of `seq_len` pairs.

    Each sample is cut by `split_pieces`; full pieces become rows at once, and each shorter
    piece goes into the open row with the least room that still fits it (best fit). When
    `max_open` rows are open and none fits, the fullest is closed first. Samples with no
    pair are skipped. Deterministic; about 1% padding on mixed lengths (see tests).
    Returns the rows, each a list of pieces (sample, first pair, pairs).
    """
    rows: list[list[Piece]] = []
    open_rows: list[list[Piece]] = []
    room = np.zeros(0, dtype=np.int64)  # room[j]: free slots of open_rows[j]
    for s in order:
        if n_pairs[s] <= 0:
            continue
        for piece in split_pieces(int(s), int(n_pairs[s]), seq_len):
            n = piece[2]
            if n == seq_len:  # a full piece is a row by itself: nothing can join it
                rows.append([piece])
                continue
            fits = np.flatnonzero(room >= n)
            if len(fits):
                # best fit: the tightest row that still takes it leaves the roomier rows for
                # longer pieces to come (first fit would pad more on mixed lengths)
                j = int(fits[np.argmin(room[fits])])
                open_rows[j].append(piece)
                room[j] -= n
                if room[j] == 0:
                    rows.append(open_rows.pop(j))
                    room = np.delete(room, j)
                continue
            if len(open_rows) >= max_open:  # bound the search: close the fullest open row
                j = int(np.argmin(room))
                rows.append(open_rows.pop(j))
                room = np.delete(room, j)
            open_rows.append([piece])
            room = np.append(room, seq_len - n)
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
    per-token learn flags (None: every target is learned). Returns the five (seq_len,)
    numpy arrays of the module docstring, by field name.

    Raises:
        DataError: the pieces overflow the row, or `get_tokens` returns fewer tokens than
            a piece needs (sample lengths that do not match the data).
    """
    T = seq_len
    tokens = np.full(T, pad_id, dtype=np.int64)
    targets = np.full(T, pad_id, dtype=np.int64)
    loss_mask = np.zeros(T, dtype=bool)
    document_ids = np.zeros(T, dtype=np.int32)
    positions = np.zeros(T, dtype=np.int64)
    at = 0
    if sum(n for (_, _, n) in pieces) > T:
        raise DataError(f"build_row: pieces {list(pieces)} hold more than seq_len = {T} pairs. "
                        f"Plan rows with plan_packed/plan_padded for the same seq_len.")
    for seg, (s, start, n) in enumerate(pieces):
        d = np.asarray(get_tokens(s, start, start + n + 1), dtype=np.int64)
        if len(d) != n + 1:
            raise DataError(f"sample {s}: asked for tokens {start}..{start + n + 1} ({n + 1} tokens), got "
                            f"{len(d)}: the sample lengths given to the packer do not match the data. "
                            f"Re-run `lmforge prepare` (or fix the sample index).")
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
    return Batch(*(torch.from_numpy(np.stack([r[f] for r in rows])) for f in FIELDS))


def padding_fraction(rows: Sequence[Sequence[Piece]], seq_len: int) -> float:
    """Padding slots / all slots of planned rows (0.0 for no rows)."""
    used = sum(n for row in rows for (_, _, n) in row)
    return 1.0 - used / max(1, len(rows) * seq_len)


class RowStream:
    """An endless, resumable stream of micro-batches over samples, epoch after epoch.

    Epoch e shuffles the samples with numpy's generator seeded by (seed, e), plans the
    rows (packed or padded), then shuffles the rows (seeded by (seed, e, 1)) so that the
    pieces of one long document do not fill a micro-batch. The epochs' rows, one after another, form one global row
    sequence, dealt out a micro-batch at a time: the j-th micro-batch of rank r of W is the
    global micro-batch j * W + r, i.e. global rows [(j * W + r) * B, (j * W + r + 1) * B)
    (across an epoch's end it goes on into the next epoch, nothing is dropped). So an
    optimizer step of A micro-batches of B rows on each of W ranks uses global rows
    [s * A * B * W, (s + 1) * A * B * W), and every one of its micro-batches is, row for
    row, a micro-batch that one process with accumulation A * W draws in the same step.
    That makes data parallelism exact under bf16 autocast too: a micro-batch's weight
    gradient is summed over its rows inside a bf16 matmul and rounded once, so regrouping
    rows into other micro-batches (dealing rows round-robin, as before 2026-11-23) changed
    the weights by ~1e-3 relative after a few steps; equal micro-batches leave only the
    float32 order of summing micro-batch gradients.
    The position (epoch, global row cursor within the epoch) is all the state, the same on
    every rank; `state_dict` / `load_state_dict` resume exactly.

    Each planned epoch's fraction of padding slots is kept in `padding_fractions`
    ({epoch: fraction}; `last_padding_fraction` is the newest) and described by
    `epoch_report(epoch)`.
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
        self.padding_fractions: dict[int, float] = {}

    def plan(self, epoch: int) -> list[list[Piece]]:
        """The rows of `epoch` (lists of pieces), planned once and cached."""
        if self._plan_epoch != epoch:
            order = np.arange(len(self.n_pairs))
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.n_pairs))
            plan = plan_packed if self.packing else plan_padded
            rows = plan(self.n_pairs, order, self.seq_len)
            if self.shuffle:
                # Shuffle the rows too: the pieces of one long document are planned side by side,
                # and a micro-batch of one file's consecutive pieces is a badly correlated batch.
                perm = np.random.default_rng([self.seed, epoch, 1]).permutation(len(rows))
                rows = [rows[i] for i in perm]
            self._rows = rows
            self._plan_epoch = epoch
            self.last_padding_fraction = padding_fraction(self._rows, self.seq_len)
            self.padding_fractions[epoch] = self.last_padding_fraction
        return self._rows

    def rows_per_epoch(self) -> int:
        return len(self.plan(self.epoch))

    def epoch_report(self, epoch: int | None = None) -> str:
        """One line on an epoch's rows (default: the current epoch), e.g. for the startup log:
        rows, samples, pieces cut from long samples, padding fraction."""
        epoch = self.epoch if epoch is None else epoch
        rows = self.plan(epoch)
        n_samples = int((self.n_pairs > 0).sum())
        n_pieces = sum(len(r) for r in rows)
        kind = "packed" if self.packing else "right-padded"
        return (f"rows: epoch {epoch}: {len(rows):,} {kind} rows of {self.seq_len} from {n_samples:,} samples "
                f"({n_pieces:,} pieces), padding {100 * padding_fraction(rows, self.seq_len):.2f}%, "
                f"document masking {'on' if self.document_masking else 'off'}")

    def build(self, pieces: Sequence[Piece]) -> dict[str, np.ndarray]:
        """One planned row's arrays (`build_row` with this stream's data and settings)."""
        return build_row(pieces, self.get_tokens, self.get_learn, self.seq_len, self.pad_id, self.document_masking)

    def make_batch(self, rows: Sequence[Sequence[Piece]]) -> Batch:
        """The micro-batch of these planned rows (a subclass may lay them out otherwise)."""
        return collate([self.build(r) for r in rows])

    def peek(self, k: int) -> list[Piece]:
        """The planned row `k` global rows past the current position (the position stays)."""
        epoch, row = self._ahead(k)
        return self.plan(epoch)[row]

    def advance(self, n: int) -> None:
        """Move the position `n` global rows on."""
        self.epoch, self.cursor = self._ahead(n)

    def next_batch(self) -> Batch:
        B = self.micro_batch_size
        rows = [self.peek(self.rank * B + i) for i in range(B)]  # this rank's micro-batch among the next W
        self.advance(self.world_size * B)
        return self.make_batch(rows)

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

    def batches_once(self, max_rows: int = 0) -> Iterator[Batch]:
        """Epoch 0's rows once, in plan order, `micro_batch_size` to a batch (the last may be
        short), for evaluation: with `shuffle=False` every sample appears once, in order.
        `max_rows` > 0 stops after that many rows. The stream's position is not touched."""
        rows = self.plan(0)
        limit = len(rows) if max_rows <= 0 else min(len(rows), max_rows)
        for i in range(0, limit, self.micro_batch_size):
            yield self.make_batch(rows[i: min(i + self.micro_batch_size, limit)])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        """Continue at a saved position.

        Raises:
            DataError: a position outside the data (a negative epoch, a cursor past the rows
            of its epoch), e.g. a damaged checkpoint or other data.
        """
        epoch, cursor = state["epoch"], state["cursor"]
        for name, value in (("epoch", epoch), ("cursor", cursor)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DataError(f"data position {name} = {value!r}: expected a non-negative integer")
        rows = len(self.plan(epoch))
        if cursor >= max(rows, 1):
            raise DataError(f"data position cursor = {cursor} is past the {rows} rows of epoch {epoch}")
        self.epoch, self.cursor = epoch, cursor


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
