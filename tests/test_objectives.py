"""The objective is the trainer's unit of change: what a micro-batch adds to the loss, how many
rows one item takes, how tokens per step are counted, the start-up line, and — for an objective
that makes its own batches (a rollout) — where its micro-batches come from."""

from __future__ import annotations

from dataclasses import replace

import torch

from lmforge.data.packing import Batch, shard_stream
from lmforge.data.shards import Shard
from lmforge.model import Transformer, resolve_model_config
from lmforge.train.distributed import DistInfo
from lmforge.train.dpo import DPOObjective
from lmforge.train.plan import make_plan
from lmforge.train.trainer import TokenObjective, Trainer


class ConstantRollout(TokenObjective):
    """A toy objective that makes its own batches: it takes the stream's rows as prompts (their
    shape), then trains on a sequence it wrote itself (token 7 everywhere)."""

    def __init__(self):
        self.calls = 0

    def next_batch(self, stream, model):
        self.calls += 1
        b = stream.next_batch()
        seven = torch.full_like(b.tokens, 7)
        return Batch(seven, seven.clone(), torch.ones_like(b.loss_mask), torch.zeros_like(b.document_ids),
                     torch.arange(b.tokens.shape[1]).expand_as(b.tokens).contiguous())


def _trainer(tiny_run, objective, tmp_path):
    cfg, tok = tiny_run
    cfg = replace(cfg, train=replace(cfg.train, optimizer="adamw", lr=1e-2, warmup_steps=0, steps=20,
                                     grad_accum_steps=2))
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=0)
    train = Shard.open(cfg.data.dir, "train", tok.contract, tok.folder / "contract.json")
    stream = shard_stream(train, cfg.data.seq_len, cfg.train.micro_batch_size, 0)
    return Trainer(cfg, tmp_path / "run", tok.folder, model, stream, None, DistInfo(), False, lambda _m: None,
                   objective=objective), stream


def _p_seven(model) -> float:
    with torch.no_grad():
        logits = model(torch.full((1, 8), 7))
    return float(torch.softmax(logits[0, -1].float(), -1)[7])


def test_an_objective_that_makes_its_own_batches_is_trained_on_them(tiny_run, tmp_path):
    objective = ConstantRollout()
    trainer, stream = _trainer(tiny_run, objective, tmp_path)
    before = _p_seven(trainer.raw_model)
    for _ in range(20):
        trainer.train_step()
    assert objective.calls == 20 * 2  # every micro-batch of every step, accumulation included
    after = _p_seven(trainer.raw_model)
    assert after > 0.5 and before < 0.05, (before, after)  # it learned what it wrote, not the corpus
    # the prompts came from the stream, so its position moved like a plain run's (resume restores it)
    _, plain = _trainer(tiny_run, TokenObjective(), tmp_path)
    for _ in range(40):
        plain.next_batch()
    assert plain.state_dict() == stream.state_dict()
    assert not (tmp_path / "run").exists()  # steps alone write nothing


def test_the_objective_declares_rows_tokens_per_step_and_its_batch_line(tiny_run, tmp_path):
    token, pairs = TokenObjective(), DPOObjective.__new__(DPOObjective)
    assert (token.rows_per_sample, pairs.rows_per_sample) == (1, 2)
    assert token.tokens_per_step(4, 2, 3, 64) == 4 * 2 * 3 * 64
    assert pairs.tokens_per_step(4, 2, 3, 64) == 2 * 4 * 2 * 3 * 64
    assert token.batch_shape(16) == "16" and pairs.batch_shape(8) == "8 pairs (2 rows each)"
    pairs.packing = True
    assert pairs.batch_shape(8) == "8 pairs (packed: at most 16 rows)"
    trainer, _ = _trainer(tiny_run, TokenObjective(), tmp_path)
    t = trainer.cfg.train
    assert make_plan(trainer)["tokens_per_step"] == t.micro_batch_size * t.grad_accum_steps * trainer.cfg.data.seq_len
