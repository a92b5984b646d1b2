"""Packed pretraining rows (issue 4, P2): greedy packing with little padding, long documents
cut into pieces (the policy in `lmforge.data.packing`'s docstring), no target crossing into
the next document, and every target of every document exactly once per epoch —
checked by reconstructing the documents from the rows alone.

The synthetic documents below hold globally unique token values (token = its offset in the
flat token array), so every slot of a row names the exact document and index it came from.
"""

from __future__ import annotations

import numpy as np
import pytest

from lmforge.data.packing import (
    RowStream,
    build_row,
    collate,
    padding_fraction,
    plan_packed,
    shard_stream,
    split_pieces,
)
from lmforge.errors import DataError

PAD = -7  # not a token value the synthetic documents use (those are >= 0)


def flat_documents(lengths):
    """(offsets, tokens, get_tokens): document s is tokens[offsets[s]:offsets[s+1]], and every
    token's value is its own offset, so a value identifies its document and index."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.arange(offsets[-1], dtype=np.int64)

    def get_tokens(s, start, stop):
        return tokens[offsets[s] + start: offsets[s] + stop]

    return offsets, tokens, get_tokens


def doc_of(offsets, values):
    return np.searchsorted(offsets, values, side="right") - 1


def epoch_rows(stream: RowStream) -> list:
    """Exactly one epoch of rows drawn through `next_batch` (micro-batch of 1 row)."""
    n = stream.rows_per_epoch()
    batches = [stream.next_batch() for _ in range(n)]
    assert stream.state_dict() == {"epoch": 1, "cursor": 0}
    return batches


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_target_exactly_once_per_epoch_and_none_crosses_documents(seed):
    rng = np.random.default_rng(seed)
    seq_len = 32
    # short documents, documents of exactly seq_len + 1 tokens (one full row), long ones cut
    # into pieces, and two-token documents ([bos, eos]: one pair)
    lengths = np.concatenate([rng.integers(2, 20, 40), [seq_len + 1, 2, 2], rng.integers(33, 120, 8)])
    offsets, tokens, get_tokens = flat_documents(lengths)
    stream = RowStream(lengths - 1, get_tokens, None, seq_len, 1, PAD, seed=seed)
    seen = []
    for b in epoch_rows(stream):
        tok, tgt, mask = b.tokens[0].numpy(), b.targets[0].numpy(), b.loss_mask[0].numpy()
        docs, pos = b.document_ids[0].numpy(), b.positions[0].numpy()
        real = tok != PAD
        assert (mask == real).all()  # pretraining: every real target is learned, no pad is
        assert (tgt[mask] == tok[mask] + 1).all()  # the next token of the same flat array ...
        assert (doc_of(offsets, tgt[mask]) == doc_of(offsets, tok[mask])).all()  # ... of the same document
        assert not np.isin(tgt[mask], offsets).any()  # never a next document's first token
        for d in np.unique(docs):
            where = np.flatnonzero(docs == d)
            assert (np.diff(where) == 1).all()  # a segment is contiguous
            assert (pos[where] == np.arange(len(where))).all()  # positions restart at 0
            if real[where].any():
                assert real[where].all() and (np.diff(tok[where]) == 1).all()  # one run of one document
                assert len(set(doc_of(offsets, tok[where]).tolist())) == 1
        seen.append(tgt[mask])
    seen = np.sort(np.concatenate(seen))
    expected = np.sort(np.concatenate([tokens[offsets[s] + 1: offsets[s + 1]] for s in range(len(lengths))]))
    assert np.array_equal(seen, expected)  # each target of each document once: reconstructs the corpus


def test_ranks_together_cover_an_epoch_exactly_once():
    lengths = np.random.default_rng(5).integers(2, 70, 60)
    offsets, tokens, get_tokens = flat_documents(lengths)
    world = 3
    streams = [RowStream(lengths - 1, get_tokens, None, 24, 1, PAD, seed=1, rank=r, world_size=world)
               for r in range(world)]
    n_rows = streams[0].rows_per_epoch()
    seen = []
    for i in range(n_rows):
        b = streams[i % world].next_batch()  # global row i is rank i % W's
        seen.append(b.targets[b.loss_mask].numpy())
    seen = np.sort(np.concatenate(seen))
    expected = np.sort(np.concatenate([tokens[offsets[s] + 1: offsets[s + 1]] for s in range(len(lengths))]))
    assert np.array_equal(seen, expected)


def test_long_document_is_cut_into_pieces_as_documented():
    """A document longer than seq_len: full-row pieces, then a tail; each piece its own
    segment with positions from 0, every target learned (the first from one token of
    context: the previous piece's last target)."""
    seq_len = 16
    L = 2 * seq_len + 6 + 1  # 38 pairs: pieces of 16, 16, 6
    offsets, tokens, get_tokens = flat_documents([L])
    assert split_pieces(0, L - 1, seq_len) == [(0, 0, 16), (0, 16, 16), (0, 32, 6)]
    rows = plan_packed([L - 1], [0], seq_len)
    assert sorted(map(tuple, rows)) == [((0, 0, 16),), ((0, 16, 16),), ((0, 32, 6),)]
    built = {r[0][1]: build_row(r, get_tokens, None, seq_len, PAD) for r in rows}
    prev_last_target = None
    for start in (0, 16, 32):
        row = built[start]
        n = min(seq_len, L - 1 - start)
        assert row["tokens"][:n].tolist() == list(range(start, start + n))
        assert row["targets"][:n].tolist() == list(range(start + 1, start + n + 1))
        assert row["loss_mask"][:n].all() and not row["loss_mask"][n:].any()
        assert row["positions"][:n].tolist() == list(range(n))  # from 0, not from `start`
        assert (row["document_ids"][:n] == 0).all() and (row["document_ids"][n:] == 1).all()
        if prev_last_target is not None:
            assert row["tokens"][0] == prev_last_target  # its one token of context
        prev_last_target = row["targets"][n - 1]
    assert prev_last_target == L - 1  # the last target is the document's last token (its EOS)


def test_learn_flags_follow_targets_across_pieces():
    """SFT-style learn flags: a piece keeps the flags of its own targets, the first included."""
    seq_len = 8
    L = 21  # 20 pairs: pieces of 8, 8, 4
    offsets, tokens, get_tokens = flat_documents([L])
    learn = (np.arange(L) % 3 == 0)

    def get_learn(s, start, stop):
        return learn[start:stop]

    for piece in split_pieces(0, L - 1, seq_len):
        row = build_row([piece], get_tokens, get_learn, seq_len, PAD)
        _, start, n = piece
        assert row["loss_mask"][:n].tolist() == learn[start + 1: start + n + 1].tolist()
        assert not row["loss_mask"][n:].any()


def test_padding_slots_are_their_own_segment_and_never_supervised():
    seq_len = 20
    offsets, tokens, get_tokens = flat_documents([5, 7])
    row = build_row([(0, 0, 4), (1, 0, 6)], get_tokens, None, seq_len, PAD)
    assert row["tokens"].tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 9, 10] + [PAD] * 10
    assert row["targets"].tolist() == [1, 2, 3, 4, 6, 7, 8, 9, 10, 11] + [PAD] * 10
    assert row["loss_mask"].tolist() == [True] * 10 + [False] * 10
    assert row["document_ids"].tolist() == [0] * 4 + [1] * 6 + [2] * 10
    assert row["positions"].tolist() == list(range(4)) + list(range(6)) + list(range(10))
    assert {k: v.dtype for k, v in row.items()} == {
        "tokens": np.int64, "targets": np.int64, "loss_mask": np.bool_, "document_ids": np.int32,
        "positions": np.int64}


def test_document_masking_off_is_plain_causal_over_the_row():
    seq_len = 20
    offsets, tokens, get_tokens = flat_documents([5, 7, 3])
    pieces = [(0, 0, 4), (1, 0, 6), (2, 0, 2)]
    on = build_row(pieces, get_tokens, None, seq_len, PAD, document_masking=True)
    off = build_row(pieces, get_tokens, None, seq_len, PAD, document_masking=False)
    assert (off["document_ids"] == 0).all()
    assert off["positions"].tolist() == list(range(seq_len))
    for k in ("tokens", "targets", "loss_mask"):  # the same data, only the attention layout differs
        assert np.array_equal(on[k], off[k])
    assert not np.array_equal(on["document_ids"], off["document_ids"])
    # and through a stream
    stream = RowStream(np.array([4, 6, 2]), get_tokens, None, seq_len, 2, PAD, seed=0, document_masking=False)
    b = stream.next_batch()
    assert (b.document_ids == 0).all() and (b.positions == np.arange(seq_len)).all()


@pytest.mark.parametrize("dist", ["uniform", "lognormal", "code-like"])
def test_greedy_packing_wastes_little(dist):
    rng = np.random.default_rng(0)
    seq_len = 256
    n_pairs = {
        "uniform": rng.integers(1, seq_len, 10000),
        "lognormal": np.maximum(1, rng.lognormal(4.5, 1.0, 3000).astype(int)),
        "code-like": np.maximum(1, rng.lognormal(7.5, 1.2, 800).astype(int)),  # mostly longer than a row
    }[dist]
    rows = plan_packed(n_pairs, rng.permutation(len(n_pairs)), seq_len)
    assert all(sum(n for _, _, n in r) <= seq_len for r in rows)
    frac = padding_fraction(rows, seq_len)
    # the waste of the best possible packing is at least 1 - total / (rows * seq_len) with the
    # fewest rows ceil(total / seq_len); greedy best-fit stays under 2% of the slots
    lower = 1 - n_pairs.sum() / (np.ceil(n_pairs.sum() / seq_len) * seq_len)
    assert lower <= frac < 0.02, (dist, frac)


def test_padding_fraction_is_recorded_per_epoch_and_matches_the_rows():
    lengths = np.random.default_rng(3).integers(2, 40, 50)
    offsets, tokens, get_tokens = flat_documents(lengths)
    seq_len = 32
    stream = RowStream(lengths - 1, get_tokens, None, seq_len, 1, PAD, seed=4)
    for epoch in (0, 1):
        rows = epoch_rows(stream) if epoch == 0 else [stream.next_batch() for _ in range(stream.rows_per_epoch())]
        pads = sum(int((b.tokens == PAD).sum()) for b in rows)
        measured = pads / (len(rows) * seq_len)
        assert stream.padding_fractions[epoch] == pytest.approx(measured)
        assert 0 < measured < 0.2
    assert set(stream.padding_fractions) >= {0, 1}
    assert stream.last_padding_fraction == stream.padding_fractions[max(stream.padding_fractions)]
    report = stream.epoch_report(0)
    assert f"padding {100 * stream.padding_fractions[0]:.2f}%" in report
    assert f"{len(stream.plan(0)):,} packed rows of {seq_len}" in report


def test_packing_is_deterministic_and_epochs_differ():
    lengths = np.random.default_rng(8).integers(2, 40, 60)
    a = RowStream(lengths - 1, flat_documents(lengths)[2], None, 32, 1, PAD, seed=9)
    b = RowStream(lengths - 1, flat_documents(lengths)[2], None, 32, 1, PAD, seed=9)
    assert a.plan(0) == b.plan(0) and a.plan(1) == b.plan(1)
    assert a.plan(0) != a.plan(1)


# -- bad input -------------------------------------------------------------------------------------
def test_sample_lengths_that_do_not_match_the_data_are_a_data_error():
    offsets, tokens, get_tokens = flat_documents([5])
    with pytest.raises(DataError, match=r"sample 0: asked for tokens 0\.\.9 \(9 tokens\), got 5"):
        build_row([(0, 0, 8)], get_tokens, None, 16, PAD)  # the index claims 8 pairs, the data has 4


def test_pieces_that_overflow_the_row_are_a_data_error():
    offsets, tokens, get_tokens = flat_documents([9, 9])
    with pytest.raises(DataError, match="more than seq_len = 12"):
        build_row([(0, 0, 8), (1, 0, 8)], get_tokens, None, 12, PAD)


def test_no_sample_with_a_target_is_a_data_error_not_a_hang():
    stream = RowStream(np.array([0, 0]), lambda s, a, b: np.zeros(b - a, np.int64), None, 8, 2, PAD, seed=0)
    with pytest.raises(DataError, match="no rows to train on"):
        stream.next_batch()


# -- through a real shard: boundaries come from .idx, never from token values (P2) -------------------
def test_shard_rows_follow_the_idx_offsets(tiny_run):
    from lmforge.data.shards import Shard

    cfg, tok = tiny_run
    shard = Shard.open(cfg.data.dir, "train", tok.contract)
    stream = shard_stream(shard, cfg.data.seq_len, 4, seed=0)
    rows = stream.plan(0)
    batch = collate([build_row(r, stream.get_tokens, None, cfg.data.seq_len, tok.pad_id) for r in rows])
    n_docs_targets = int((batch.targets[batch.loss_mask] == tok.eos_id).sum())
    assert n_docs_targets == shard.n_documents  # each document's EOS is learned once
    assert not (batch.tokens[batch.loss_mask] == tok.eos_id).any()  # and is never an input
    assert int(batch.loss_mask.sum()) == int((shard.lengths() - 1).sum())


def test_pretrain_logs_the_epoch_padding(tiny_run, tmp_path, capsys):
    from lmforge.stages import pretrain_stage

    cfg, tok = tiny_run
    pretrain_stage(cfg, tmp_path / "run", dry_run=True, progress=False)
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("rows: epoch 0:"))
    assert "packed rows of 64" in line and "document masking on" in line
    pct = float(line.split("padding ")[1].split("%")[0])
    assert 0 < pct < 10
