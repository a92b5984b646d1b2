"""The one loss path (P3): cross_entropy_sum, and the Trainer's token-weighted step under
gradient accumulation, on pretraining rows and on SFT rows of unequal supervised counts."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmforge.data.packing import Batch, shard_stream
from lmforge.data.conversations import Conversation, render_samples, sft_stream
from lmforge.data.shards import Shard
from lmforge.model import Transformer, resolve_model_config
from lmforge.train.distributed import DistInfo
from lmforge.model.loss import cross_entropy_sum
from lmforge.train.trainer import Trainer

SRC = Path(__file__).resolve().parents[1] / "src" / "lmforge"


# -- cross_entropy_sum ------------------------------------------------------------------------
def test_cross_entropy_sum_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g)
    targets = torch.randint(0, 11, (3, 7), generator=g)
    mask = torch.rand(3, 7, generator=g) > 0.4
    got = cross_entropy_sum(logits, targets, mask)
    ref = F.cross_entropy(logits.double()[mask], targets[mask], reduction="sum")
    assert got.dtype == torch.float32
    assert abs(float(got) - float(ref)) <= 1e-5 * float(ref)
    # bf16 logits are upcast: the same value as float32 on the same (rounded) logits
    lb = logits.bfloat16()
    got_b = cross_entropy_sum(lb, targets, mask)
    ref_b = F.cross_entropy(lb.double()[mask], targets[mask], reduction="sum")
    assert got_b.dtype == torch.float32 and abs(float(got_b) - float(ref_b)) <= 1e-5 * float(ref_b)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_grouped_sums_and_their_gradients_match_a_per_group_reference(compiled):
    """linear_cross_entropy_sum(..., groups): one sum per group (a side of a DPO pair, wherever it
    lies in a packed row), and the gradient of any weighted combination of them, equal the
    float64 cross-entropy of each group's positions alone (to float32's precision: the loss
    is summed in float32). Compiled too: torch.compile traces the forward's out-of-place branch
    (the in-place one lost every gradient under torch 2.11 on CUDA)."""
    from lmforge.model.loss import linear_cross_entropy_sum as eager

    linear_cross_entropy_sum = torch.compile(eager, fullgraph=True) if compiled else eager

    g = torch.Generator().manual_seed(0)
    N, D, V, G = 37, 8, 11, 5
    hidden = torch.randn(N, D, generator=g, requires_grad=True)
    weight = torch.randn(V, D, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    mask = torch.rand(N, generator=g) < 0.7
    groups = torch.randint(0, G, (N,), generator=g)
    groups[groups == 3] = 2  # group 3: no position at all, so 0.0
    upstream = torch.randn(G, generator=g, dtype=torch.float64)
    sums = linear_cross_entropy_sum(hidden, weight, targets, mask, chunk_rows=6, groups=groups, n_groups=G)
    assert sums.shape == (G,) and sums.dtype == torch.float32 and sums[3] == 0.0
    (sums.double() * upstream).sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ce = F.cross_entropy(h64 @ w64.t(), targets, reduction="none") * mask
    ref = torch.zeros(G, dtype=torch.float64).index_add(0, groups, ce)
    (ref * upstream).sum().backward()
    tol = 1e-5
    assert torch.allclose(sums.double(), ref, rtol=tol, atol=tol)
    assert torch.allclose(hidden.grad.double(), h64.grad, rtol=tol, atol=tol)
    assert torch.allclose(weight.grad.double(), w64.grad, rtol=tol, atol=tol)
    h2, w2 = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    total = linear_cross_entropy_sum(h2, w2, targets, mask)  # ungrouped: the sum, and its gradient
    assert float(total.detach()) == pytest.approx(float(ref.detach().sum()), rel=tol)
    total.backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    (F.cross_entropy(h64 @ w64.t(), targets, reduction="none") * mask).sum().backward()
    assert torch.allclose(h2.grad.double(), h64.grad, rtol=tol, atol=tol)
    assert torch.allclose(w2.grad.double(), w64.grad, rtol=tol, atol=tol)


def test_targets_outside_the_mask_are_never_read():
    """A pad id equal to a real id cannot leak in: only loss_mask decides (P4)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 9, generator=g)
    targets = torch.randint(0, 9, (2, 5), generator=g)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 1, 0, 0]], dtype=torch.bool)
    other = targets.clone()
    other[~mask] = (targets[~mask] + 3) % 9
    assert float(cross_entropy_sum(logits, targets, mask)) == float(cross_entropy_sum(logits, other, mask))


def test_all_masked_is_zero_not_nan_with_zero_gradient():
    logits = torch.randn(2, 4, 10, requires_grad=True)
    targets = torch.zeros(2, 4, dtype=torch.long)
    loss = cross_entropy_sum(logits, targets, torch.zeros(2, 4, dtype=torch.bool))
    assert loss.item() == 0.0 and not torch.isnan(loss)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and float(logits.grad.abs().sum()) == 0.0


# -- one optimizer step through the Trainer -----------------------------------------------------
def one_step(cfg, tok, init_state, stream, accum, tmp: Path):
    """(loss, gradients, weights after the step) of one Trainer.train_step in fp32. Gradients
    are captured just before the optimizer applies them (grad_clip = 0: unscaled)."""
    c = replace(cfg, train=replace(cfg.train, micro_batch_size=stream.micro_batch_size, grad_accum_steps=accum,
                                   precision="fp32", grad_clip=0.0, warmup_steps=0, lr=1e-2))
    model = Transformer(resolve_model_config(c.model, tok.contract))
    model.load_state_dict(init_state)
    trainer = Trainer(c, tmp, tok.folder, model, stream, None, DistInfo(), progress=False, log=lambda m: None)
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update({n: p.grad.detach().clone() for n, p in trainer.raw_model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    m = trainer.train_step()
    weights = {n: p.detach().clone() for n, p in trainer.raw_model.named_parameters()}
    return m["loss"], grads, weights


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest over tensors of max|a - b| / max|b| (tensors that are all zero compare absolutely)."""
    worst = 0.0
    for k in b:
        scale = float(b[k].abs().max())
        diff = float((a[k] - b[k]).abs().max())
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def assert_accumulation_invariant(cfg, tok, make_stream, tmp: Path) -> dict:
    init = Transformer(resolve_model_config(cfg.model, tok.contract)).state_dict()
    init = {k: v.clone() for k, v in init.items()}
    results = {}
    for mbs, accum in ((8, 1), (2, 4), (1, 8)):
        results[(mbs, accum)] = one_step(cfg, tok, init, make_stream(mbs), accum, tmp / f"{mbs}x{accum}")
    loss0, grads0, weights0 = results[(8, 1)]
    for key in ((2, 4), (1, 8)):
        loss, grads, weights = results[key]
        assert abs(loss - loss0) <= 1e-6 * loss0, (key, loss, loss0)
        assert max_rel(grads, grads0) <= 1e-5, key
        # AdamW's first step moves each weight by about lr * g / (|g| + eps): a weight whose
        # gradient is near eps magnifies float noise, so compare the weights in units of the step.
        # Where |g| is near eps (1e-8) the first step lr * g / (|g| + eps) turns fp32 noise of
        # ~1e-11 into ~1e-5 of a step, so weigh only entries with |g| >= 100 eps.
        step = max(float((weights0[k] - init[k]).abs().max()) for k in init)
        diff = max(float(((weights[k] - weights0[k]).abs() * (grads0[k].abs() >= 1e-6)).max()) for k in init)
        assert diff <= 1e-3 * step, (key, diff, step)
        for k in weights:  # and the step moved the weights (the comparison is not vacuous)
            if grads0[k].abs().max() > 0:
                assert not torch.equal(weights[k], init[k]), k
    return {"init": init, "grads": grads0, "loss": loss0}


def mean_of_means_grads(cfg, tok, init, batches) -> dict[str, torch.Tensor]:
    """The 2024 gradient-accumulation bug, for contrast: the mean of per-micro-batch means."""
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.load_state_dict(init)
    for b in batches:
        logits = model(b.tokens, b.positions, b.document_ids)
        (cross_entropy_sum(logits, b.targets, b.loss_mask) / b.n_supervised / len(batches)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def unequal_conversations(n: int = 8) -> list[Conversation]:
    words = ["value", "return", "self", "data", "items", "key", "name", "result"]
    convs = []
    for i in range(n):
        user = " ".join(words[(i + j) % len(words)] for j in range(2 + 3 * (i % 3)))
        reply = " ".join(words[(2 * i + j) % len(words)] for j in range(1 + 5 * i))  # 1 .. 36 words
        convs.append(Conversation(({"role": "user", "content": user},
                                   {"role": "assistant", "content": reply}), f"c{i}", f"c{i}"))
    return convs


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_accumulation_invariance_on_sft_rows(tiny_run, tmp_path, packing):
    cfg, tok = tiny_run
    seq_len = cfg.data.seq_len
    samples = render_samples(unequal_conversations(16 if packing else 8), tok, seq_len)

    def make_stream(mbs):
        return sft_stream(samples, seq_len, mbs, tok.pad_id, seed=0, packing=packing, shuffle=False)

    rows = make_stream(8).next_batch()
    counts = rows.loss_mask.sum(dim=1).tolist()
    assert len(set(counts)) >= 3, counts  # deliberately unequal supervised counts per row
    res = assert_accumulation_invariant(cfg, tok, make_stream, tmp_path)
    # the contrast: averaging per-micro-batch means (micro-batch 1) gives another gradient
    s = make_stream(1)
    wrong = mean_of_means_grads(cfg, tok, res["init"], [s.next_batch() for _ in range(8)])
    assert max_rel(wrong, res["grads"]) > 3e-3  # >> the 1e-5 the correct paths agree to


def test_accumulation_invariance_on_pretraining_rows(tiny_run, tmp_path):
    cfg, tok = tiny_run
    shard = Shard.open(cfg.data.dir, "train", tok.contract)
    seq_len = cfg.data.seq_len
    rows = shard_stream(shard, seq_len, 1, seed=0, shuffle=False).plan(0)
    filled = [sum(n for _, _, n in r) for r in rows]
    start = max(0, len(rows) - 8)  # the last rows of a packed plan are the partly filled ones
    assert len(set(filled[start:])) >= 2, filled[start:]

    def make_stream(mbs):
        s = shard_stream(shard, seq_len, mbs, seed=0, document_masking=cfg.data.document_masking, shuffle=False)
        s.load_state_dict({"epoch": 0, "cursor": start})
        return s

    assert_accumulation_invariant(cfg, tok, make_stream, tmp_path)


class FixedStream:
    """A stream that hands out the given micro-batches in order."""

    def __init__(self, batches: list[Batch]):
        self.batches, self.i, self.micro_batch_size = batches, 0, batches[0].tokens.shape[0]

    def next_batch(self) -> Batch:
        b = self.batches[self.i]
        self.i += 1
        return b

    def state_dict(self) -> dict:
        return {"i": self.i}


def test_all_masked_micro_batch_contributes_zero(tiny_run, tmp_path):
    """A micro-batch with no supervised token adds 0 to the loss and the gradient, never NaN."""
    cfg, tok = tiny_run
    samples = render_samples(unequal_conversations(4), tok, cfg.data.seq_len)
    batch = sft_stream(samples, cfg.data.seq_len, 4, tok.pad_id, seed=0, shuffle=False).next_batch()
    empty = Batch(batch.tokens, batch.targets, torch.zeros_like(batch.loss_mask), batch.document_ids,
                  batch.positions)
    init = {k: v.clone() for k, v in Transformer(resolve_model_config(cfg.model, tok.contract)).state_dict().items()}
    loss1, grads1, weights1 = one_step(cfg, tok, init, FixedStream([batch]), 1, tmp_path / "a")
    loss2, grads2, weights2 = one_step(cfg, tok, init, FixedStream([empty, batch]), 2, tmp_path / "b")
    assert math.isfinite(loss2) and abs(loss2 - loss1) <= 1e-6 * loss1
    assert max_rel(grads2, grads1) <= 1e-6
    assert max_rel(weights2, weights1) <= 1e-6
    # a step with nothing supervised at all: loss 0, gradients 0, nothing NaN
    loss0, grads0, _ = one_step(cfg, tok, init, FixedStream([empty]), 1, tmp_path / "c")
    assert loss0 == 0.0
    assert all(torch.isfinite(g).all() and float(g.abs().max()) == 0.0 for g in grads0.values())


# -- one loss, one loop ---------------------------------------------------------------------------
def _sources() -> dict[str, str]:
    return {str(p.relative_to(SRC)): p.read_text(encoding="utf-8") for p in SRC.rglob("*.py")}


def test_one_cross_entropy_and_one_training_loop_in_the_source_tree():
    src = _sources()
    ce = [f for f, text in src.items() if re.search(r"\bcross_entropy\(", text.replace("cross_entropy_sum(", ""))]
    assert ce == ["model/loss.py"], ce
    steps = [f for f, text in src.items() if re.search(r"optimizer\.step\(|\.step\(\)", text)]
    assert steps == ["train/trainer.py"], steps
    loops = [f for f, text in src.items() if re.search(r"^class \w*Trainer\b", text, re.M)]
    assert loops == ["train/trainer.py"], loops
    # SFT builds no optimizer and calls no backward: it hands its rows to the same Trainer
    for name in ("stages/sft.py", "data/conversations.py"):
        assert "backward(" not in src[name] and "torch.optim" not in src[name], name


@pytest.mark.parametrize("frozen_weight", [False, True], ids=["trained-head", "frozen-head"])
def test_ungrouped_loss_keeps_no_vocab_sized_tensor_and_skips_a_frozen_heads_product(frozen_weight):
    """The ungrouped loss (every training step's) runs the backward's products in its forward,
    chunk by chunk: what it keeps for backward is (N, D) and (V, D), never (N, V); with a frozen
    head (LoRA) no (V, D) either, and no weight gradient. Gradients equal float64's."""
    from lmforge.model.loss import linear_cross_entropy_sum

    g = torch.Generator().manual_seed(3)
    N, D, V = 40, 8, 97
    hidden = torch.randn(N, D, generator=g, requires_grad=True)
    weight = torch.randn(V, D, generator=g, requires_grad=not frozen_weight)
    targets = torch.randint(0, V, (N,), generator=g)
    mask = torch.rand(N, generator=g) < 0.7
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        total = linear_cross_entropy_sum(hidden, weight, targets, mask, chunk_rows=7)
    kept = saved[2:]  # after hidden and weight themselves
    assert (N, V) not in kept and ((V, D) in kept) == (not frozen_weight), kept
    (total * 0.25).backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    (F.cross_entropy(h64 @ w64.t(), targets, reduction="none") * mask * 0.25).sum().backward()
    assert torch.allclose(hidden.grad.double(), h64.grad, rtol=1e-5, atol=1e-6)
    if frozen_weight:
        assert weight.grad is None
    else:
        assert torch.allclose(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-6)
