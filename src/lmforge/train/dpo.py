"""DPO on the one training loop: the objective and its reference model.

`DPOObjective` is what `Trainer` runs for `lmforge dpo` in place of the token loss: a
micro-batch is a `PairBatch` (B pairs as 2B rows), its count is B pairs, and its loss is
the sum over pairs of `lmforge.model.loss.dpo_loss` — so the step's loss is the mean over
every pair of the step, whatever the accumulation and the number of ranks (P3). Chosen and
rejected are scored in one forward (`Transformer.forward(..., groups=batch.groups)`: the
summed log-probability of each side's completion, float32, through the same loss function as
pretraining and SFT), whether the sides are padded one a row or packed
(lmforge.data.preferences).

The reference (`reference_for`):
- LoRA ("live"): the model itself with its adapters disabled, under no_grad. Refused when
  any parameter besides the adapters trains (the "reference" would drift with the policy).
- full fine-tuning ("live"): a frozen copy of the initial weights, in eval mode.
- "precomputed": the reference's log-probabilities of every pair, computed once before
  training with the same model and runtime, looked up by pair index.
Dropout is never on in DPO: the model has none, and LoRA's dropout must be 0 (refused
otherwise by the stage), so policy == reference at step 0 gives exactly ln 2.

Logged per step (means over the step's pairs, all ranks; TRL's names): `rewards/chosen`,
`rewards/rejected` (beta x log-ratio to the reference), `rewards/margins`,
`rewards/accuracies` (chosen reward > rejected reward, strictly: 0 at step 0),
`logps/chosen`, `logps/rejected` (summed nats of the completion, negated). Validation adds the
same with `val_` in front, `val_loss`, and `val_pairwise_accuracy` (the policy alone prefers
the chosen reply: log p(chosen) > log p(rejected), comparable with any model, the SFT one
included), also per `mutation` kind when the pairs carry one.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Sequence

import torch

from lmforge.config import DPOConfig
from lmforge.data.preferences import PairBatch, PairSamples, pair_batches
from lmforge.errors import ConfigError
from lmforge.model import lora
from lmforge.model.loss import REFERENCE_FREE, dpo_loss, reference_free_loss
from lmforge.runtime import Runtime
from lmforge.train.distributed import DistInfo
from lmforge.train.trainer import TokenObjective

STATS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
         "logps/rejected")

#: (chosen log-probabilities (B,), rejected (B,)) of a pair batch under the reference, float32, no grad.
Reference = Callable[[PairBatch], tuple[torch.Tensor, torch.Tensor]]


def sequence_logps(model: torch.nn.Module, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen (P,), rejected (P,)) float32 log-probabilities of each completion: minus the
    summed nats over its side's loss mask (the final assistant turn and its end-of-turn token)."""
    P = batch.n_pairs
    nats = model(batch.tokens, batch.positions, batch.document_ids, targets=batch.targets,
                 loss_mask=batch.loss_mask, groups=batch.groups, n_groups=2 * P)
    logps = -nats
    return logps[:P], logps[P:]


def reference_model(model: torch.nn.Module, runtime: Runtime) -> Callable[[], contextlib.AbstractContextManager]:
    """The initial weights of a run from a checkpoint, to score with: a function whose context yields
    the reference module, with no gradient, under the runtime's autocast. With adapters: `model`
    itself, adapters disabled; without: a frozen copy of `model` as it is now, eval mode. DPO's
    sequence log-probabilities (`live_reference`) and RL's KL term (`train.rl.token_reference`)
    both score with it.

    Raises:
        ConfigError: `model` has adapters and some other parameter trains.
    """
    if lora.has_adapters(model):
        check_only_adapters_train(model)
        target, disable = model, lambda: lora.adapters_disabled(model)
    else:
        target = copy.deepcopy(model).to(runtime.device).eval()
        for p in target.parameters():
            p.requires_grad_(False)
        disable = contextlib.nullcontext

    @contextlib.contextmanager
    def scoring():
        with torch.no_grad(), disable(), runtime.autocast():
            yield target

    return scoring


def live_reference(model: torch.nn.Module, runtime: Runtime) -> Reference:
    """The reference computed at every step (`reference_model`): (chosen, rejected) log-probabilities
    of a pair batch.

    Raises:
        ConfigError: `model` has adapters and some other parameter trains.
    """
    scoring = reference_model(model, runtime)

    def ref(batch: PairBatch):
        with scoring() as reference:
            return sequence_logps(reference, batch)

    return ref


def check_only_adapters_train(model: torch.nn.Module) -> None:
    """The adapters-disabled model is the reference only if nothing but the adapters trains.

    Raises:
        ConfigError naming a trainable non-adapter parameter.
    """
    extra = [n for n, p in model.named_parameters() if p.requires_grad and not lora.is_adapter_key(n)]
    if extra:
        raise ConfigError(f"DPO with LoRA takes the model with its adapters disabled as the reference, but "
                          f"{extra[0]} (and {len(extra) - 1} more) also trains, so the reference would move with "
                          f"the policy. Train the adapters only (lora.rank > 0 freezes everything else), or use "
                          f"lora.rank = 0 (a frozen copy is the reference).")


@torch.no_grad()
def precompute(reference: Reference, samples: PairSamples, seq_len: int, batch_size: int, pad_id: int,
               runtime: Runtime, packing: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's (chosen, rejected) log-probabilities of every pair of `samples`, (N,) float32 each."""
    chosen, rejected = torch.zeros(len(samples)), torch.zeros(len(samples))
    for b in pair_batches(samples, seq_len, batch_size, pad_id, packing):
        c, r = reference(b.to(runtime.device))
        chosen[b.pair_index], rejected[b.pair_index] = c.float().cpu(), r.float().cpu()
    return chosen, rejected


def table_reference(chosen: torch.Tensor, rejected: torch.Tensor) -> Reference:
    """A reference read from precomputed tables (by `PairBatch.pair_index`)."""

    def ref(batch: PairBatch):
        device = batch.tokens.device
        return chosen[batch.pair_index].to(device), rejected[batch.pair_index].to(device)

    return ref


class DPOObjective(TokenObjective):
    """The trainer's objective for DPO (module docstring). `reference` scores the training
    pairs, `val_reference` the held-out ones (the same function when it is live);
    `val_mutations[i]` is held-out pair i's kind ("" when the data names none)."""

    zero_gradient_is_a_fault = False  # its gradient can be 0 (TokenObjective.zero_gradient_is_a_fault)

    stats = STATS
    unit = "pair"
    rows_per_sample = 2  # chosen and rejected, in one forward (packed: at most)
    packing = False

    def __init__(self, cfg: DPOConfig, reference: Reference, val_reference: Reference | None = None,
                 val_mutations: Sequence[str] = ()):
        self.beta, self.kind, self.gamma, self.packing = cfg.beta, cfg.loss, cfg.simpo_gamma, cfg.packing
        self.reference = reference
        self.val_reference = val_reference or reference
        self.kinds = sorted({k for k in val_mutations if k})
        self.val_kind = torch.tensor([self.kinds.index(k) if k else -1 for k in val_mutations], dtype=torch.int64)

    def count(self, batch: PairBatch) -> int:
        return batch.n_pairs

    def batch_shape(self, micro_batch_size: int) -> str:
        if not self.packing:
            return super().batch_shape(micro_batch_size)
        return f"{micro_batch_size} pairs (packed: at most {self.rows_per_sample * micro_batch_size} rows)"

    def _pairs(self, model, batch: PairBatch, reference: Reference | None):
        pc, pr = sequence_logps(model, batch)
        if self.kind in REFERENCE_FREE:  # length-normalised, no reference model
            n = batch.completion_tokens.to(pc.device).clamp(min=1).to(pc.dtype)  # (2P,)
            P = batch.n_pairs
            losses, rc, rr = reference_free_loss(pc / n[:P], pr / n[P:], self.beta, self.kind, self.gamma)
        else:
            ref_c, ref_r = reference(batch)
            losses, rc, rr = dpo_loss(pc, pr, ref_c.float(), ref_r.float(), self.beta, self.kind)
        stats = torch.stack([rc.sum(), rr.sum(), (rc - rr).sum(), (rc > rr).float().sum(), pc.detach().sum(),
                             pr.detach().sum()])
        return losses, stats, pc.detach(), pr.detach()

    def loss(self, model: torch.nn.Module, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        losses, stats, _, _ = self._pairs(model, batch, self.reference)
        return losses.sum(), stats

    @torch.no_grad()
    def validate(self, model: torch.nn.Module, batches: Iterable[PairBatch], runtime: Runtime,
                 dist: DistInfo) -> dict:
        """Means over every held-out pair (every rank scores all of them, so no reduction): `val_loss`, `val_` + each of STATS,
        `val_pairwise_accuracy` and, per kind, `val_pairwise_accuracy/KIND` (with `val_pairs/KIND`)."""
        was_training = model.training
        model.eval()
        K = len(self.kinds)
        # [loss, *stats, pairwise correct, pairs] then per kind [correct, pairs]
        totals = torch.zeros(3 + len(STATS) + 2 * K, dtype=torch.float64)
        for b in batches:
            b = b.to(runtime.device)
            with runtime.autocast():
                losses, stats, pc, pr = self._pairs(model, b, self.val_reference)
            correct = (pc > pr).double().cpu()
            totals[0] += losses.double().sum().cpu()
            totals[1: 1 + len(STATS)] += stats.double().cpu()
            totals[1 + len(STATS)] += correct.sum()
            totals[2 + len(STATS)] += b.n_pairs
            kind = self.val_kind[b.pair_index] if K else torch.empty(0, dtype=torch.int64)
            for k in range(K):
                sel = kind == k
                totals[3 + len(STATS) + 2 * k] += correct[sel].sum()
                totals[4 + len(STATS) + 2 * k] += sel.sum()
        model.train(was_training)
        n = max(float(totals[2 + len(STATS)]), 1.0)
        out = {"val_loss": float(totals[0]) / n}
        out.update({f"val_{name}": float(v) / n for name, v in zip(STATS, totals[1: 1 + len(STATS)])})
        out["val_pairwise_accuracy"] = float(totals[1 + len(STATS)]) / n
        for k, name in enumerate(self.kinds):
            c, m = float(totals[3 + len(STATS) + 2 * k]), float(totals[4 + len(STATS) + 2 * k])
            out[f"val_pairwise_accuracy/{name}"] = c / max(m, 1.0)
            out[f"val_pairs/{name}"] = int(m)
        return out


__all__ = ["DPOObjective", "STATS", "sequence_logps", "live_reference", "reference_model", "precompute", "table_reference",
           "check_only_adapters_train"]
