"""Attention backends and document masking (issue 4; P2, P5, P7).

- every backend against a float64 reference (block-diagonal causal, GQA, batch 1, T = 1,
  padded rows);
- packed rows: the logits and parameter gradients of the packed forward equal those of
  each document run alone (fp32, within 1e-5), for sdpa, and flex forward on CPU;
  a control shows that plain causal attention over the same row does not;
- pads cannot reach real tokens (bit-identical logits when the ids under padding change);
- a chat-shaped document full of end-of-turn and EOS ids stays one document;
- `model.attention` resolution (flex cannot train on CPU: a ConfigError before any work);
- CUDA only (skipped without a GPU): flex forward and backward against sdpa.
"""

from __future__ import annotations

import math

import numpy as np

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.data.packing import RowStream, build_row, collate, plan_packed, shard_stream
from lmforge.errors import ConfigError
from lmforge.model import Transformer
from lmforge.model import attention as A
from lmforge.model import cpu_attention as C
from lmforge.model.attention import document_mask, flex_attention, resolve_backend, sdpa_attention
from lmforge.model.loss import cross_entropy_sum

VOCAB = 320
PAD = 0


def cuda(test):
    """CUDA-only tests (FlexAttention's backward): skipped cleanly without a GPU."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FlexAttention backward)")
    return pytest.mark.cuda(skip(test))


def small(**kw) -> ModelConfig:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=128)
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(small()).float()
    # larger weights than the 0.02 init, so attention patterns are far from uniform and a
    # wrong mask shows up clearly (the control test)
    m.reset_parameters()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("wq.weight", "wk.weight")):
                p.mul_(10)
    return m


def with_backend(model: Transformer, backend: str) -> Transformer:
    model.set_attention(backend)
    return model


# -- reference attention --------------------------------------------------------------------
def reference_attention(q, k, v, document_ids=None):
    """float64 softmax(q k^T / sqrt(hd) + mask) v with k, v repeated for GQA."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, T, hd = q.shape
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / hd ** 0.5  # (B, H, T, T)
    ids = document_ids if document_ids is not None else torch.zeros(B, T, dtype=torch.long)
    scores = scores.masked_fill(~document_mask(ids), float("-inf"))
    return (scores.softmax(-1) @ v).float()


def random_document_ids(B, T, gen, padded=True):
    """Sorted segment ids per row, the last segment optionally standing for padding."""
    rows = []
    for _ in range(B):
        cuts = torch.randint(1, max(2, T), (int(torch.randint(0, 4, (1,), generator=gen)),), generator=gen)
        ids = torch.zeros(T, dtype=torch.int32)
        for c in cuts.tolist():
            ids[c:] += 1
        rows.append(ids)
    return torch.stack(rows)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("B, H, KV, T", [(2, 4, 2, 37), (1, 8, 2, 130), (3, 4, 4, 1), (1, 2, 1, 1)])
def test_backend_matches_the_float64_reference(backend, B, H, KV, T):
    """GQA (H/KV = 1, 2, 4, 8), batch 1, T = 1, a length past one 128-block, padded rows."""
    gen = torch.Generator().manual_seed(B * 1000 + T)
    q = torch.randn(B, H, T, 16, generator=gen)
    k = torch.randn(B, KV, T, 16, generator=gen)
    v = torch.randn(B, KV, T, 16, generator=gen)
    docs = random_document_ids(B, T, gen)
    fn = {"sdpa": sdpa_attention, "flex": flex_attention}[backend]
    for ids in (docs, None, torch.zeros(B, T, dtype=torch.int32)):
        out = fn(q, k, v, ids)
        assert out.shape == (B, H, T, 16) and out.dtype == torch.float32
        torch.testing.assert_close(out, reference_attention(q, k, v, ids), rtol=0, atol=1e-5)
    if T == 1:  # one query, one key: the output is that key's value, per query head's KV group
        torch.testing.assert_close(fn(q, k, v, docs), v.repeat_interleave(H // KV, 1), rtol=0, atol=1e-6)


# -- cpu_attention: sdpa's CPU forward, a backward from matrix products (compiled bf16 training) --
def _bf16_inputs(B, H, KV, T, hd, gen, q_scale=1.0):
    q = (q_scale * torch.randn(B, H, T, hd, generator=gen)).bfloat16().requires_grad_()
    k = torch.randn(B, KV, T, hd, generator=gen).bfloat16().requires_grad_()
    v = torch.randn(B, KV, T, hd, generator=gen).bfloat16().requires_grad_()
    return q, k, v, torch.randn(B, H, T, hd, generator=gen).bfloat16()


def _grads(fn, q, k, v, d_out):
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    return out, grads


@pytest.mark.parametrize("B, H, KV, T, q_scale", [(2, 4, 2, 96, 1.0), (3, 4, 4, 64, 4.0), (1, 8, 2, 130, 2.0),
                                                   (2, 2, 1, 1, 1.0)])
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive"])
def test_cpu_attention_forward_equals_sdpa_and_gradients_are_as_close_to_float64(B, H, KV, T, q_scale, mask_kind):
    """The forward is sdpa's own output bit for bit; each gradient's relative error against a
    float64 reference is at most 1.5x that of sdpa's bf16 backward + 1e-3 (bf16 rounding), with
    plain causal rows, document masks (bool and additive) and padded segments, GQA 1-4, T = 1."""
    gen = torch.Generator().manual_seed(B * 100 + T)
    q, k, v, d_out = _bf16_inputs(B, H, KV, T, 64, gen, q_scale)
    docs = random_document_ids(B, T, gen)
    allowed = document_mask(docs)
    attn_mask = {"causal": None, "bool": allowed,
                 "additive": A.additive_document_mask(docs, torch.bfloat16)}[mask_kind]
    mask = A.AttentionMask(is_causal=attn_mask is None, attn_mask=attn_mask)
    ours, our_grads = _grads(lambda *t: A.cpu_attention(*t, attn_mask), q, k, v, d_out)
    sdpa, sdpa_grads = _grads(lambda *t: A.sdpa_attend(*t, mask), q, k, v, d_out)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, sdpa)
    ids = None if attn_mask is None else docs
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = H // KV
    ref = torch.nn.functional.scaled_dot_product_attention(
        q64, k64.repeat_interleave(rep, 1), v64.repeat_interleave(rep, 1),
        attn_mask=None if ids is None else document_mask(ids), is_causal=ids is None)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_out.double())
    for name, a, b, r in zip("qkv", our_grads, sdpa_grads, ref_grads):
        # relative to the reference's norm; absolute where the exact gradient is 0 (T = 1: dq = 0
        # exactly, and a relative error would divide by 0 — inf or nan by the kernel's rounding)
        scale = float(r.norm()) or 1.0
        err = float((a.double() - r).norm()) / scale
        sdpa_err = float((b.double() - r).norm()) / scale
        assert math.isfinite(err) and err <= 1.5 * sdpa_err + 1e-3, f"d{name}: {err:.2e} against sdpa's {sdpa_err:.2e}"


def test_cpu_attention_is_taken_only_by_compiled_bf16_training(monkeypatch):
    """sdpa_attend routes to cpu_attention while torch.compile traces a bf16 forward that needs
    gradients; not in eager, not without gradients, not in fp32, not past CPU_ATTENTION_MAX_SCORES,
    not when switched off."""
    calls = []
    real = A.cpu_attention
    monkeypatch.setattr(A, "cpu_attention", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(0)
    q, k, v, d_out = _bf16_inputs(2, 4, 2, 32, 64, gen)
    mask = A.AttentionMask(is_causal=True)

    def step(q, k, v):
        return A.sdpa_attend(q, k, v, mask)

    step(q, k, v)
    with torch.no_grad():
        torch.compile(step, backend="eager")(q, k, v)
    torch.compile(step, backend="eager")(q.float(), k.float(), v.float())
    assert calls == []
    torch._dynamo.reset()
    out, grads = _grads(torch.compile(step, backend="eager", fullgraph=True), q, k, v, d_out)
    assert calls == [1]
    _, eager_grads = _grads(lambda *t: real(*t, None), q, k, v, d_out)
    for a, b in zip(grads, eager_grads):
        assert torch.equal(a, b)
    monkeypatch.setattr(C, "CPU_ATTENTION_MAX_SCORES", 2 * 4 * 32 * 32 - 1)  # one element over: sdpa's own
    torch._dynamo.reset()
    torch.compile(step, backend="eager")(q, k, v)
    assert calls == [1]
    monkeypatch.setattr(C, "CPU_ATTENTION_MAX_SCORES", 1 << 24)
    monkeypatch.setattr(C, "CPU_ATTENTION", False)
    torch._dynamo.reset()
    torch.compile(step, backend="eager")(q, k, v)
    assert calls == [1]
    torch._dynamo.reset()


def test_one_document_rows_take_the_causal_path(monkeypatch):
    """sdpa builds no mask when every row is one segment (is_causal), and one per forward
    otherwise — not one per layer."""
    built = []
    real = A.additive_document_mask
    monkeypatch.setattr(A, "additive_document_mask", lambda ids, dtype: built.append(1) or real(ids, dtype))
    torch.manual_seed(0)
    m = with_backend(Transformer(small(n_layers=3)), "sdpa")
    tokens = torch.randint(0, VOCAB, (2, 12))
    one = torch.zeros(2, 12, dtype=torch.int32)
    m(tokens, None, one)
    assert built == []
    two = torch.tensor([[0] * 5 + [1] * 7, [0] * 12], dtype=torch.int32)
    m(tokens, None, two)
    assert len(built) == 1  # three layers, one mask
    m(tokens, None, two.clone())  # a new tensor: a new mask
    assert len(built) == 2


def _graphs_compiled(m, batches, autocast: bool, grad: bool = True) -> int:
    """The graphs torch.compile makes for forwards (and backwards) of `m` over `batches`."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    cm = torch.compile(m, backend=backend)
    for tokens, ids in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(grad):
            out = cm(tokens, None, ids)
        if grad:
            out.float().square().mean().backward()
    torch._dynamo.reset()
    return len(graphs)


def test_compiled_bf16_cpu_training_keeps_one_graph_for_one_document_rows(monkeypatch):
    """Under torch.compile, bf16 training on CPU (cpu_attention's path) attends through the
    document mask even when every row is one segment: one graph for both kinds of micro-batch
    (no graph break at one_segment_per_row, no second compile), and the same logits as the
    plain causal path. fp32 training and no-grad forwards keep the choice (two graphs and a
    break); so does a batch past CPU_ATTENTION_MAX_SCORES."""
    torch.manual_seed(0)
    m = with_backend(Transformer(small(n_layers=2)), "sdpa")
    tokens = torch.randint(0, VOCAB, (2, 12))
    one = torch.zeros(2, 12, dtype=torch.int32)
    two = torch.tensor([[0] * 5 + [1] * 7, [0] * 12], dtype=torch.int32)
    batches = [(tokens, one), (tokens, two), (tokens, one)]
    assert _graphs_compiled(m, batches, autocast=True) == 1
    assert _graphs_compiled(m, batches, autocast=False) > 1
    assert _graphs_compiled(m, batches, autocast=True, grad=False) > 1
    monkeypatch.setattr(C, "CPU_ATTENTION_MAX_SCORES", 2 * small().n_heads * 12 * 12 - 1)
    assert _graphs_compiled(m, batches, autocast=True) > 1
    monkeypatch.undo()
    # the document mask over one-segment rows is plain causal attention: the same logits
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = torch.compile(m, backend="eager")(tokens, None, one)
        eager = m(tokens, None, one)
    torch._dynamo.reset()
    assert torch.allclose(compiled.float(), eager.float(), atol=2e-2, rtol=0)


def test_mask_reuse_follows_in_place_changes():
    """Reusing one document_ids tensor (changed in place) never reuses a stale mask."""
    torch.manual_seed(0)
    m = with_backend(Transformer(small()), "sdpa").eval()
    tokens = torch.randint(0, VOCAB, (1, 12))
    ids = torch.tensor([[0] * 6 + [1] * 6], dtype=torch.int32)
    with torch.no_grad():
        first = m(tokens, None, ids)
        ids[0, 3:] = 1  # in place: segments [0..3) and [3..12)
        second = m(tokens, None, ids)
        fresh = m(tokens, None, ids.clone())
    assert torch.equal(second, fresh) and not torch.allclose(first, second)


# -- packed rows equal documents alone --------------------------------------------------------------
def packed_rows(seed: int, seq_len: int = 40, n_docs: int = 14):
    """Random documents (some longer than a row) packed by the real packer into right-padded
    rows. Returns (Batch, segments): segments[(row, seg)] = (slot start, pairs) for each piece."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(2, 30, n_docs - 2), [seq_len + 9, 2 * seq_len + 5]])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = rng.integers(1, VOCAB, offsets[-1])  # PAD (0) never appears in a document

    def get_tokens(s, a, b):
        return flat[offsets[s] + a: offsets[s] + b]

    rows = plan_packed(lengths - 1, rng.permutation(len(lengths)), seq_len)
    batch = collate([build_row(r, get_tokens, None, seq_len, PAD) for r in rows])
    segments = {}
    for i, r in enumerate(rows):
        at = 0
        for j, (_, _, n) in enumerate(r):
            segments[(i, j)] = (at, n)
            at += n
    assert (~batch.loss_mask).any(), "want padded rows too"
    assert max(len(r) for r in rows) >= 3, "want rows of several documents"
    return batch, segments


def packed_loss_and_grads(model, batch, document_ids, positions):
    model.zero_grad(set_to_none=True)
    logits = model(batch.tokens, positions, document_ids)
    loss = cross_entropy_sum(logits, batch.targets, batch.loss_mask) / batch.n_supervised
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def alone_loss_and_grads(model, batch, segments):
    """Each piece run as its own sequence (default positions, no document ids, sdpa causal)."""
    model.zero_grad(set_to_none=True)
    logits = {}
    for (row, seg), (at, n) in segments.items():
        tok = batch.tokens[row: row + 1, at: at + n]
        out = model(tok)
        loss = cross_entropy_sum(out, batch.targets[row: row + 1, at: at + n], batch.loss_mask[row: row + 1, at: at + n])
        (loss / batch.n_supervised).backward()
        logits[(row, seg)] = out.detach()[0]
    return logits, {n: p.grad.clone() for n, p in model.named_parameters()}


def max_abs(a, b) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_sdpa_logits_and_gradients_equal_documents_alone(model, seed):
    batch, segments = packed_rows(seed)
    with_backend(model, "sdpa")
    packed_logits, packed_grads = packed_loss_and_grads(model, batch, batch.document_ids, batch.positions)
    alone_logits, alone_grads = alone_loss_and_grads(model, batch, segments)
    for (row, seg), (at, n) in segments.items():
        assert max_abs(packed_logits[row, at: at + n], alone_logits[(row, seg)]) <= 1e-5
    for name, g in packed_grads.items():
        assert max_abs(g, alone_grads[name]) <= 1e-5, name
    assert max(float(g.abs().max()) for g in packed_grads.values()) > 1e-3  # gradients are not trivially 0


@pytest.mark.parametrize("seed", [0])
def test_packed_flex_forward_equals_documents_alone_on_cpu(model, seed):
    """Flex forward on CPU (its backward needs CUDA: see the GPU tests below)."""
    batch, segments = packed_rows(seed)
    with torch.no_grad():
        packed = with_backend(model, "flex")(batch.tokens, batch.positions, batch.document_ids)
        with_backend(model, "sdpa")
        for (row, seg), (at, n) in segments.items():
            alone = model(batch.tokens[row: row + 1, at: at + n])[0]
            assert max_abs(packed[row, at: at + n], alone) <= 1e-5
        assert max_abs(packed, model(batch.tokens, batch.positions, batch.document_ids)) <= 1e-5


def test_control_plain_causal_over_the_row_does_not_match(model):
    """The mask matters: without document ids (positions 0..T-1) the later documents of a
    row see the earlier ones, and their logits and the gradients move far past 1e-5."""
    batch, segments = packed_rows(0)
    with_backend(model, "sdpa")
    T = batch.tokens.shape[1]
    causal = torch.arange(T).expand_as(batch.tokens)
    plain_logits, plain_grads = packed_loss_and_grads(model, batch, None, causal)
    alone_logits, alone_grads = alone_loss_and_grads(model, batch, segments)
    later = [max_abs(plain_logits[row, at: at + n], alone_logits[(row, seg)])
             for (row, seg), (at, n) in segments.items() if seg > 0]
    first = [max_abs(plain_logits[row, at: at + n], alone_logits[(row, seg)])
             for (row, seg), (at, n) in segments.items() if seg == 0]
    assert max(first) <= 1e-5  # a row's first document is unaffected either way
    assert min(later) > 1e-3  # every later document is
    assert max(max_abs(g, alone_grads[n]) for n, g in plain_grads.items()) > 1e-4


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_pad_ids_cannot_change_real_logits(model, backend):
    """P5: any ids under padding leave every real token's logits bit-identical."""
    batch, _ = packed_rows(2)
    real = batch.tokens != PAD
    assert (~real).any()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        with_backend(model, backend)
        a = model(batch.tokens, batch.positions, batch.document_ids)
        for _ in range(2):
            other = torch.where(real, batch.tokens, torch.randint(1, VOCAB, batch.tokens.shape, generator=gen))
            b = model(other, batch.positions, batch.document_ids)
            assert torch.equal(a[real], b[real])
            assert not torch.equal(a[~real], b[~real])  # the pads themselves did change


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_single_token_rows(model, backend):
    """T = 1 (batch 1 and 3) through the whole model: equals the same token alone and the
    other backend, with and without document ids."""
    with_backend(model, backend)
    tokens = torch.tensor([[5], [17], [200]])
    with torch.no_grad():
        one = model(tokens[:1])
        assert one.shape == (1, 1, VOCAB)
        three = model(tokens, torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 1, dtype=torch.int32))
        assert torch.allclose(three[:1], one, rtol=0, atol=1e-6)
        other = with_backend(model, "flex" if backend == "sdpa" else "sdpa")(tokens)
    assert max_abs(three, other) <= 1e-5


def test_single_token_step_trains_with_sdpa(model):
    with_backend(model, "sdpa")
    model.zero_grad(set_to_none=True)
    logits = model(torch.tensor([[9]]), torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32))
    cross_entropy_sum(logits, torch.tensor([[4]]), torch.tensor([[True]])).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.layers[0].attention.wv.weight.grad.abs().sum() > 0


def test_document_masking_off_in_the_stream_gives_plain_causal_logits(model):
    """data.document_masking = false: the rows carry one segment and running positions, so
    the model sees exactly plain causal attention over the packed row."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 20, 12)
    flat = rng.integers(1, VOCAB, lengths.sum())
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    stream = RowStream(lengths - 1, lambda s, a, b: flat[offsets[s] + a: offsets[s] + b], None, 32, 2, PAD,
                       seed=0, document_masking=False)
    b = stream.next_batch()
    with torch.no_grad():
        with_backend(model, "sdpa")
        assert torch.equal(model(b.tokens, b.positions, b.document_ids), model(b.tokens))


# -- chat-shaped data: boundaries from .idx, not from token values (P2) ----------------------------
def test_chat_document_with_inner_eos_and_end_of_turn_stays_one_document(tmp_path, tiny_tokenizer):
    """A document holding several <|im_end|> and <|eos|> ids inside is one segment of the
    packed row (positions 0..n-1, attending across its own turns), and its logits equal
    the document run alone; the packer never reads token values."""
    from lmforge.data.shards import Shard

    tok = tiny_tokenizer
    c = tok.contract
    turns = [c.im_start_id, *tok.encode("user\nhi"), c.im_end_id, c.eos_id,
             c.im_start_id, *tok.encode("assistant\nreturn x"), c.im_end_id, c.eos_id,
             c.im_start_id, *tok.encode("user\nmore"), c.im_end_id]
    chat = [c.bos_id, *turns, c.eos_id]
    short = [c.bos_id, *tok.encode("x = 1"), c.eos_id]
    docs = [short, chat, short]
    folder = tmp_path / "data"
    folder.mkdir()
    np.asarray(sum(docs, []), dtype=c.dtype).tofile(folder / "train.bin")
    np.asarray(np.cumsum([0] + [len(d) for d in docs]), dtype=np.int64).tofile(folder / "train.idx")
    c.save(folder)
    shard = Shard.open(folder, "train", c)
    assert shard.n_documents == 3
    seq_len = 64
    assert sum(len(d) - 1 for d in docs) <= seq_len  # all three in one row
    stream = shard_stream(shard, seq_len, 1, seed=0, shuffle=False)
    b = stream.next_batch()
    ids, pos, tokens = b.document_ids[0], b.positions[0], b.tokens[0]
    n_chat = len(chat) - 1
    start = len(short) - 1  # after the first document
    seg = ids[start: start + n_chat]
    assert (seg == seg[0]).all() and ids[start - 1] != seg[0] and ids[start + n_chat] != seg[0]
    assert pos[start: start + n_chat].tolist() == list(range(n_chat))
    inner = tokens[start: start + n_chat]
    assert int((inner == c.eos_id).sum()) == 2 and int((inner == c.im_end_id).sum()) == 3
    torch.manual_seed(0)
    m = with_backend(Transformer(small(vocab_size=tok.vocab_size)), "sdpa")
    with torch.no_grad():
        packed = m(b.tokens, b.positions, b.document_ids)[0, start: start + n_chat]
        alone = m(torch.tensor([chat[:-1]]))[0]
        is_eos = (tokens == c.eos_id).int()
        eos_split = b.document_ids[0] * 100 + torch.cumsum(is_eos, 0) - is_eos  # a new document after each EOS
        split = m(b.tokens, b.positions, eos_split[None])
    assert max_abs(packed, alone) <= 1e-5
    assert max_abs(split[0, start: start + n_chat], alone) > 1e-4  # splitting at EOS would change it


# -- model.attention resolution ---------------------------------------------------------------
def test_resolve_backend():
    assert resolve_backend("auto", "cpu") == "sdpa"
    assert resolve_backend("auto", "cuda") == "flex"
    assert resolve_backend("sdpa", "cpu") == "sdpa"
    assert resolve_backend("flex", "cuda") == "flex"
    assert resolve_backend("flex", "cpu", training=False) == "flex"  # forward only: inference is fine
    # FlexAttention's kernel needs head_dim >= 16 (an inductor NotImplementedError on CUDA otherwise)
    assert resolve_backend("auto", "cuda", head_dim=16) == "flex"
    assert resolve_backend("auto", "cuda", head_dim=8) == "sdpa"
    with pytest.raises(ConfigError, match="head_dim 8 .*at least 16"):
        resolve_backend("flex", "cuda", head_dim=8)
    with pytest.raises(ConfigError, match=r'model.attention = "flex" cannot train on cpu.*model.attention="sdpa"'):
        resolve_backend("flex", "cpu", training=True)
    with pytest.raises(ConfigError, match=r"model.attention = 'xformers': expected one of 'auto', 'sdpa', 'flex'"):
        resolve_backend("xformers", "cpu")


def test_pretrain_with_flex_on_cpu_fails_before_any_work(tmp_path, monkeypatch):
    """The ConfigError comes before the tokenizer, the data or the run folder are touched:
    here none of them exists, and the error is still the attention one."""
    from conftest import tiny_config

    from lmforge.stages import pretrain_stage

    cfg = tiny_config(tmp_path, None, **{"model.attention": "flex"})
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="FlexAttention has no backward pass on CPU"):
        pretrain_stage(cfg, out, progress=False)
    assert not out.exists()


# -- CUDA: flex forward and backward against sdpa ----------------------------------------------
@cuda
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_cuda_packed_logits_and_gradients_equal_documents_alone(backend):
    """On CUDA, fp32 (no TF32): flex (compiled, forward and backward) and sdpa."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    m = Transformer(small()).cuda().float()
    batch, segments = packed_rows(0)
    batch = batch.to("cuda")
    packed_logits, packed_grads = packed_loss_and_grads(with_backend(m, backend), batch, batch.document_ids,
                                                        batch.positions)
    alone_logits, alone_grads = alone_loss_and_grads(with_backend(m, "sdpa"), batch, segments)
    for (row, seg), (at, n) in segments.items():
        assert max_abs(packed_logits[row, at: at + n], alone_logits[(row, seg)]) <= 1e-5
    for name, g in packed_grads.items():
        assert max_abs(g, alone_grads[name]) <= 1e-5, name


@cuda
@pytest.mark.slow
@pytest.mark.parametrize("B, H, KV, T", [(1, 4, 2, 1), (3, 8, 2, 1), (2, 4, 1, 200), (9, 4, 2, 81)])
def test_cuda_flex_matches_sdpa_for_single_tokens_and_gqa(B, H, KV, T):
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B, h, T, 16, generator=gen).cuda().requires_grad_() for h in (H, KV, KV))
    ids = random_document_ids(B, T, gen).cuda()
    out = flex_attention(q, k, v, ids)
    ref = sdpa_attention(q, k, v, ids)
    assert max_abs(out, ref) <= 1e-5
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    assert all(max_abs(a, b) <= 1e-5 for a, b in zip(grads, ref_grads))


@pytest.mark.parametrize("T", [1, 81, 128, 130])
@pytest.mark.parametrize("with_docs", [True, False])
def test_flex_padded_to_its_block_equals_sdpa(monkeypatch, T, with_docs):
    """On CUDA FlexAttention runs rows padded to a multiple of FLEX_BLOCK (`flex_width`: an 81-token
    RL row failed to compile on an H200): the padding forced here on a CPU gives sdpa's output for
    the real T queries, document masks and GQA included, with the padded slots a segment of their own."""
    monkeypatch.setattr(A, "flex_width", lambda T, device: -(-T // A.FLEX_BLOCK) * A.FLEX_BLOCK)
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(2, h, T, 16, generator=gen) for h in (4, 2, 2))
    docs = random_document_ids(2, T, gen) if with_docs else None
    mask = A.prepare_mask("flex", T, torch.device("cpu"), q.dtype, docs)
    assert mask.block_mask.seq_lengths[0] == -(-T // 128) * 128
    out = A.flex_attend(q, k, v, mask)
    assert out.shape == (2, 4, T, 16)
    torch.testing.assert_close(out, A.sdpa_attention(q, k, v, docs), rtol=0, atol=1e-5)
