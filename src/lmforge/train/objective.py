"""The objective: the unit of change of a training stage. `TokenObjective` is pretraining's and
SFT's loss; DPO's (`lmforge.train.dpo.DPOObjective`) and every later objective subclass it, and
the trainer, the plan and `stages.common.run_training` take them as they are
(docs/where-changes-go.md, "An objective")."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lmforge.data.packing import Batch
from lmforge.evaluate import batch_loss, evaluate_batches
from lmforge.runtime import Runtime
from lmforge.train.distributed import DistInfo, all_reduce_sum


class TokenObjective:
    """The loss of pretraining and SFT: summed nats over a micro-batch's supervised targets
    (`batch_loss`), counted in supervised targets. An objective tells the trainer what one
    micro-batch adds to the step's loss numerator (`loss`), in what units the denominator is
    counted (`count`), which further per-unit sums it logs (`loss`'s second value, named by
    `stats`), and what validation reports (`validate`). DPO's is `lmforge.train.dpo.DPOObjective`."""

    stats: tuple[str, ...] = ()
    unit = "token"
    """What `count` counts (the loss is in nats per unit)."""
    rows_per_sample = 1
    """Rows of seq_len tokens one micro-batch item takes (DPO: 2, chosen and rejected)."""
    zero_gradient_is_a_fault = True
    """Cross-entropy over supervised targets always has a gradient (the output head's is
    hidden x (softmax - one-hot)): a gradient norm of exactly 0 with a finite loss above 0 is a
    broken backward pass, and the trainer stops at the first step (a compiled loss that lost
    its saved tensor on torch 2.11 + CUDA trained a frozen model for a whole run; 2026-11-26 (an H100)).
    Objectives whose gradient can be 0 legitimately (RL: equal rewards in every group) say False."""

    def count(self, batch: Batch) -> int:
        return batch.n_supervised

    def tokens_per_step(self, micro_batch_size: int, grad_accum_steps: int, world_size: int, seq_len: int) -> int:
        """Tokens one optimizer step processes over every rank (rows x seq_len, padding included)."""
        return micro_batch_size * self.rows_per_sample * grad_accum_steps * world_size * seq_len

    def batch_shape(self, micro_batch_size: int) -> str:
        """The start-up report's words for one micro-batch ("16"; DPO: "8 pairs (2 rows each)")."""
        return f"{micro_batch_size}" if self.rows_per_sample == 1 else \
            f"{micro_batch_size} {self.unit}s ({self.rows_per_sample} rows each)"

    def next_batch(self, stream, model: torch.nn.Module) -> Batch:
        """The next micro-batch to train on: drawn from the data stream. An objective that makes its
        own batches (a rollout of the model being trained) overrides this; `stream` then holds
        its prompts, and resume restores its position as for any stream."""
        return stream.next_batch()

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(summed loss, a 0-dim float32 tensor with grad; the sums of `stats` (float64, detached) or None)."""
        return batch_loss(model, batch), None

    def step_metrics(self, dist: DistInfo) -> dict:
        """Figures of the step just taken that are the objective's own (reinforcement learning: its
        rollouts' rewards), reduced over ranks; merged into the step's metrics row. None here."""
        return {}

    def validate(self, model: torch.nn.Module, batches: Iterable[Batch], runtime: Runtime, dist: DistInfo) -> dict:
        """{"val_loss": mean nats per supervised target over `batches`, all ranks}."""
        nats, count = evaluate_batches(model, batches, runtime)
        totals = all_reduce_sum(torch.tensor([nats, float(count)], dtype=torch.float64, device=runtime.device), dist)
        return {"val_loss": float(totals[0] / max(totals[1], 1.0))}


__all__ = ["TokenObjective"]
