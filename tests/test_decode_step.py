"""`Transformer.decode_step`, the fused T = 1 decode path that `generate` and `lmforge serve`
share: equal to a full recomputation (fp32, 1e-5) with a shared slot (left-padded batch) and
with per-row slots (continuous batching), rows independent of each other, and batch-invariant
at every batch size with `batch_invariant=True` (what the server relies on)."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.generate import left_pad
from lmforge.model import Transformer

VOCAB, PAD, MAX_LEN = 200, 0, 64


def model(seed: int = 0) -> Transformer:
    m = Transformer(ModelConfig(dim=48, n_layers=3, n_heads=6, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=MAX_LEN))
    m.reset_parameters(seed=seed)
    return m.eval()


def rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


#: the head's layouts in the decode step (DecodeWeights): oneDNN-prepacked with the layers; a
#: (dim, V) copy for batch 1 and F.linear on the weight for more rows (the head over PACK_LIMIT:
#: a large vocabulary's); F.linear on the weight at every batch (over HEAD_COPY_LIMIT); oneDNN's prepacked
#: head for several rows and F.linear on the weight for one (over HEAD_COPY_LIMIT, under PACK_LIMIT: Gemma 3's)
HEAD_LAYOUTS = {"packed": {}, "copied": {"PACK_LIMIT": 0}, "weight": {"PACK_LIMIT": 0, "HEAD_COPY_LIMIT": 0},
                "packed-weight": {"HEAD_COPY_LIMIT": 0}}


@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
@pytest.mark.parametrize("batch", [1, 4])
@torch.inference_mode()
def test_shared_slot_decode_equals_full_recompute(layout, batch, monkeypatch):
    from lmforge.model.decode import DecodeWeights

    for name, limit in HEAD_LAYOUTS[layout].items():
        monkeypatch.setattr(DecodeWeights, name, limit)
    m = model(1)
    seqs = rows([9, 3, 1, 6][:batch], seed=2)
    steps = 8
    tokens, positions, key_mask = left_pad(seqs, PAD, steps)
    cache = m.new_cache(len(seqs), tokens.shape[1] + steps, key_mask)
    logits = m(tokens, positions, cache=cache)[:, -1]
    pos = positions[:, -1] + 1
    for _ in range(steps):
        nxt = logits.argmax(-1)
        for i, s in enumerate(seqs):
            s.append(int(nxt[i]))
        logits = m.decode_step(nxt, pos, cache)
        pos = pos + 1
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], m(torch.tensor([s]))[0, -1], rtol=1e-5, atol=1e-5)
    w = cache.weights  # the layout asked for was the one used
    assert (w.packed is not None, w.head_t) == {"packed": (True, True), "copied": (False, True),
                                                "weight": (False, False), "packed-weight": (True, False)}[layout]


@torch.inference_mode()
def test_per_row_slots_equal_full_recompute_and_rows_are_independent():
    """Rows at different lengths in one cache (slot = position), prefilled one by one through
    views of the cache, as the server's engine does."""
    m = model(3)
    seqs = rows([5, 1, 12, 7], seed=4)
    cache = m.new_cache(4, MAX_LEN)
    last = []
    for i, s in enumerate(seqs):
        last.append(m(torch.tensor([s]), cache=cache.rows(i, i + 1))[0, -1])
    logits = torch.stack(last)
    for _ in range(6):
        nxt = logits.argmax(-1)
        pos = torch.tensor([len(s) for s in seqs])
        for i, s in enumerate(seqs):
            s.append(int(nxt[i]))
        logits = m.decode_step(nxt, pos, cache, slots=pos)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], m(torch.tensor([s]))[0, -1], rtol=1e-5, atol=1e-5)
    # the first two rows again, in a batch of their own (a view of the cache): same numbers
    pos = torch.tensor([len(s) for s in seqs])
    nxt = logits.argmax(-1)
    two = m.decode_step(nxt[:2], pos[:2], cache.rows(0, 2), slots=pos[:2])  # rewrites the same slots
    four = m.decode_step(nxt, pos, cache, slots=pos)
    torch.testing.assert_close(two, four[:2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["packed", "packed-weight"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 9, 16])
@torch.inference_mode()
def test_decode_step_is_batch_invariant(n, layout, monkeypatch):
    """The first rows' logits are bit-identical whether n or 16 rows decode together, with
    `batch_invariant=True` (the server's setting): oneDNN's prepacked matmuls do not change with
    the batch size, the head prepacked from its (dim, V) copy or from the weight itself (a head over
    HEAD_COPY_LIMIT). Without oneDNN, MKL's do not from 4 rows up (the engine then pads to 4)."""
    from lmforge.model.decode import DecodeWeights

    for name, limit in HEAD_LAYOUTS[layout].items():
        monkeypatch.setattr(DecodeWeights, name, limit)
    m = model(5)
    if m.decode_weights().packed is None and n < 4:
        pytest.skip("no oneDNN linear in this torch: batch invariance holds from 4 rows only")
    cache = m.new_cache(16, MAX_LEN)
    for i, s in enumerate(rows([3 + i for i in range(16)], seed=6)):
        m(torch.tensor([s]), cache=cache.rows(i, i + 1))
    tok = torch.randint(1, VOCAB, (16,))
    pos = torch.arange(3, 19)
    ref = m.decode_step(tok, pos, cache, slots=pos, batch_invariant=True)
    out = m.decode_step(tok[:n], pos[:n], cache.rows(0, n), slots=pos[:n], batch_invariant=True)
    assert torch.equal(out, ref[:n])


def test_decode_weights_follow_parameter_changes():
    """The fused copies are remade when a parameter changes in place (e.g. between training steps)."""
    m = model(7)
    first = m.decode_weights()
    assert m.decode_weights() is first
    with torch.no_grad():
        m.layers[0].feed_forward.w1.weight.mul_(2)
    second = m.decode_weights()
    assert second is not first
    with torch.inference_mode():
        cache = m.new_cache(1, 8)
        m(torch.tensor([[1, 2, 3]]), cache=cache)
        out = m.decode_step(torch.tensor([4]), torch.tensor([3]), cache)
        torch.testing.assert_close(out[0], m(torch.tensor([[1, 2, 3, 4]]))[0, -1], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_decode_step_does_not_depend_on_the_slots_it_may_not_see():
    """A row's logits are bit-identical whatever the span of cache slots the step covers beyond
    the row's own (the engine attends over the filled slots rounded up, which depends on the
    other rows): masked slots add exact zeros."""
    m = Transformer(ModelConfig(dim=48, n_layers=3, n_heads=6, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=256))
    m.reset_parameters(seed=8)
    cache = m.new_cache(4, 256)
    for i, s in enumerate(rows([3, 9, 60, 5], seed=9)):
        m(torch.tensor([s]), cache=cache.rows(i, i + 1))
    tok, pos = torch.randint(1, VOCAB, (4,)), torch.tensor([3, 9, 60, 5])
    ref = m.decode_step(tok, pos, cache, slots=pos)
    for span in (64, 128, 192):  # multiples of the engine's SPAN_STEP
        assert torch.equal(m.decode_step(tok, pos, cache.rows(0, 4, span), slots=pos), ref)
