"""Reinforcement learning with verifiable rewards on the one training loop: the objective.

`RLObjective` is what `Trainer` runs for `lmforge rl`. It makes its own batches (`next_batch`, the
rollout hook of `TokenObjective`): for each of `micro_batch_size` prompts drawn from a
`PromptStream` it samples `group_size` completions with lmforge's KV-cache decoding at
`rl.temperature` (no top-k, top-p or repetition penalty: the loss differentiates exactly the
distribution sampled from, TRL PR #3029), keeps the sampled stop token, scores each completion
(`scorers.rewards`: a completion cut off by the token budget scores 0 and is counted), and turns
the rewards into advantages A = r - group mean (no division by the spread, Dr. GRPO). A whole
group lives in one micro-batch, so on one rank. The sampling generator is seeded from (train.seed,
where the micro-batch starts in the global prompt order): the same prompts get the same
completions whatever the number of ranks or the accumulation, and a resumed run the same rollouts.

Its loss is `model.loss.policy_gradient_loss` on the tokens' log-probabilities at the sampling
temperature, one optimizer step per batch of rollouts (importance ratio 1); its count (Dr. GRPO's
constant rows x max_new_tokens by default) goes through the trainer's all-reduced denominator, so
ranks and accumulation cannot change the step (P3). With `rl.beta` > 0 a k3 KL term to `rl.init`
joins the sum (LoRA: the model with its adapters disabled; full fine-tuning: a frozen copy).

Logged per step (TRL's names where one exists; `step_metrics`): `reward` and `rewards/NAME`,
`reward_std` (the mean of the groups' standard deviations), `frac_reward_zero_std`,
`completions/mean_length`, `completions/clipped_ratio`, `stop_rate`, `trivial_rate`,
`mismatch_kl` (mean over sampled tokens of sampler log p - trainer log p: precision or kernels
making on-policy into off-policy), `sandbox/VERDICT` counts, `rollout_s`. Validation writes
greedy completions' `val_reward`, `val_static` (with its 95% Wilson interval: the held-out set
is small), `val_parse_end` and `val_trivial_rate`.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lmforge.config import RLConfig, SamplingConfig
from lmforge.data.packing import Batch, build_row, collate, plan_packed
from lmforge.data.prompts import Prompt, PromptStream
from lmforge.generate import generate
from lmforge.model import lora
from lmforge.model.loss import group_advantages, policy_gradient_loss
from lmforge.runtime import Runtime
from lmforge.sandbox import VERDICTS, check_errors
from lmforge.scorers.intervals import wilson_interval
from lmforge.scorers.behaviour import Behaviour
from lmforge.scorers.rewards import SANDBOXED, Rewards
from lmforge.train.distributed import DistInfo, all_reduce_sum
from lmforge.train.objective import TokenObjective


@dataclass
class RLBatch:
    """A micro-batch of rollouts: R = prompts x group_size rollouts, (R, T) right-padded prompt +
    completion. `loss_mask`: the completion's tokens (the sampled stop token included) as
    targets; `sampler_logps` (R, T) float32: the sampler's log-probabilities there (0 elsewhere);
    `advantages` (R,) float64; `rewards` (R,) float64; `stats`: the rollout's sums for the log.

    With `rows` (rl.packing): the forward runs on `rows`, the rollouts packed into R' <= R rows
    of T (best fit, longest first; each its own attention segment with positions from 0, so
    exactly as alone in a row), and `unpack` (R, T) int64 maps each rollout's position to its
    slot in the flattened rows (0 past its end: masked out); every other field keeps the (R, T)
    layout, so the loss is the padded one's."""

    tokens: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    positions: torch.Tensor
    sampler_logps: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    stats: dict = field(default_factory=dict)
    rows: Batch | None = None
    unpack: torch.Tensor | None = None
    #: (padding slots, all slots) of the rows the forward runs on
    slots: tuple[int, int] = (0, 0)

    @property
    def n_supervised(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device) -> "RLBatch":
        moved = {f: getattr(self, f).to(device) for f in ("tokens", "targets", "loss_mask", "positions",
                                                          "sampler_logps", "advantages", "rewards")}
        packed = {} if self.rows is None else {"rows": self.rows.to(device), "unpack": self.unpack.to(device)}
        return RLBatch(**moved, stats=self.stats, slots=self.slots, **packed)

    def logps(self, model: torch.nn.Module, temperature: float) -> torch.Tensor:
        """(R, T) float32 log-probabilities of the targets under `model` at `temperature`
        (`token_logps`' numbers, 0 where a row has no target), from one forward over the rows as
        laid out (packed or padded)."""
        if self.rows is None:
            return fused_token_logps(model, self.tokens, self.positions, None, self.targets, temperature)
        r = self.rows
        lp = fused_token_logps(model, r.tokens, r.positions, r.document_ids, r.targets, temperature)  # (R', T)
        return lp.reshape(-1)[self.unpack]


def fused_token_logps(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                      document_ids: torch.Tensor | None, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at `targets` ((R, T) int64, negative = none: 0 there), (R, T)
    float32 nats, through the model's fused loss with one group per position: the (R, T, V) logits
    are never materialised (a 262k vocabulary's rollouts would need gigabytes for them). Equal to
    `token_logps` of the logits up to float32 summation order (tests/test_rl.py)."""
    R, T = targets.shape
    groups = torch.arange(R * T, device=targets.device).view(R, T)
    ce = model(tokens, positions, document_ids, targets=targets.clamp(min=0), loss_mask=targets >= 0,
               groups=groups, n_groups=R * T, temperature=temperature)  # (R*T,) nats
    return -ce.view(R, T)


@contextlib.contextmanager
def decoding(model: torch.nn.Module):
    """`model` ready for the fused decode path and back: LoRA adapters merged into their weights
    (restored bit for bit after, `lora.unmerge`), its train/eval mode kept."""
    was_training = model.training
    merged = lora.has_adapters(model)
    if merged:
        lora.merge(model)
    try:
        yield model
    finally:
        if merged:
            lora.unmerge(model)
        model.train(was_training)


def sampling_seed(seed: int, epoch: int, start: int) -> int:
    """The seed of a micro-batch's sampler: a hash of (train.seed, its start in the global prompt order)."""
    digest = hashlib.sha256(f"lmforge-rl:{seed}:{epoch}:{start}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def build_batch(prompt_ids: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                logps: Sequence[Sequence[float]], advantages: torch.Tensor, rewards: torch.Tensor,
                pad_id: int, packing: bool = False) -> RLBatch:
    """Rows prompt + completion, right-padded to the longest; the completion's tokens are the
    targets of the positions before them (`loss_mask`), with the sampler's log-probabilities.
    With `packing`, the forward's rows too (`RLBatch.rows`: `plan_packed` into rows as wide as
    the longest rollout, longest first; deterministic, the same on every rank count)."""
    R = len(prompt_ids)
    seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completions)]
    n = np.array([len(x) - 1 for x in seqs], dtype=np.int64)  # each rollout's positions
    T = max(int(n.max(initial=0)), 1)
    tokens = torch.full((R, T), pad_id, dtype=torch.long)
    targets = torch.zeros((R, T), dtype=torch.long)
    mask = torch.zeros((R, T), dtype=torch.bool)
    sampler = torch.zeros((R, T), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompt_ids, completions, logps)):
        row = seqs[i]
        tokens[i, :n[i]] = torch.as_tensor(row[:-1], dtype=torch.long)
        targets[i, :n[i]] = torch.as_tensor(row[1:], dtype=torch.long)
        a, b = len(p) - 1, len(p) - 1 + len(c)
        mask[i, a:b] = True
        sampler[i, a:b] = torch.as_tensor(list(lp), dtype=torch.float32)
    positions = torch.arange(T).expand(R, T).clone()
    batch = RLBatch(tokens, targets, mask, positions, sampler, advantages.double(), rewards.double(),
                    slots=(R * T - int(n.sum()), R * T))
    if packing:
        layout = plan_packed(n, np.argsort(-n, kind="stable"), T)
        batch.rows = collate([build_row(pieces, lambda j, a, b: seqs[j][a:b], None, T, pad_id) for pieces in layout])
        batch.unpack = torch.zeros((R, T), dtype=torch.long)
        for r, pieces in enumerate(layout):
            at = r * T
            for j, _, m in pieces:
                batch.unpack[j, :m] = torch.arange(at, at + m)
                at += m
        batch.slots = (len(layout) * T - int(n.sum()), len(layout) * T)
    return batch


class RLObjective(TokenObjective):
    """The trainer's objective for `lmforge rl` (module docstring).

    `policy`: the model being trained (the raw Transformer: rollouts decode with it);
    `prompts` / `prompt_ids`: the training prompts and their rendered ids; `val_prompts` /
    `val_ids`: the held-out ones; `stop_ids`: the ids that end a completion; `reference`: a
    function (RLBatch) -> (R, T) log-probabilities under `rl.init` (rl.beta > 0), else None.
    """

    zero_gradient_is_a_fault = False  # its gradient can be 0 (TokenObjective.zero_gradient_is_a_fault)

    unit = "prompt"

    def __init__(self, cfg: RLConfig, policy: torch.nn.Module, tok, prompts: Sequence[Prompt],
                 prompt_ids: Sequence[Sequence[int]], rewards: Rewards, decode: Runtime, seed: int,
                 val_prompts: Sequence[Prompt] = (), val_ids: Sequence[Sequence[int]] = (), reference=None,
                 compile_decode: bool = False):
        self.cfg, self.policy, self.tok, self.rewards, self.decode, self.seed = cfg, policy, tok, rewards, decode, seed
        self.prompts, self.prompt_ids = list(prompts), [list(x) for x in prompt_ids]
        self.val_prompts, self.val_ids = list(val_prompts), [list(x) for x in val_ids]
        self.rows_per_sample = cfg.group_size
        self.stop_ids = [tok.im_end_id, tok.eos_id]
        self.reference = reference
        self.compile_decode = compile_decode  # generate.compile: the rollouts' decode step compiled
        self.sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=0,
                                       top_p=1.0, repetition_penalty=1.0, greedy=False, compile=compile_decode)
        self._acc: Counter = Counter()
        # every rank reduces the same figures in the same order, whatever its own rollouts gave
        self._keys = sorted({"prompts", "rows", "reward", "reward_std", "frac_reward_zero_std",
                             "completions/mean_length", "completions/clipped_ratio", "stop_rate", "trivial_rate",
                             "rollout_s", "mismatch_kl", "tokens", "pad_slots", "row_slots", *(f"rewards/{n}" for n in rewards.names),
                             *(f"applies/{n}" for n in rewards.names),
                             *(f"sandbox/{v}" for v in (*VERDICTS, "NODOC") if SANDBOXED & set(rewards.names))})

    # -- rollouts ---------------------------------------------------------------------------------
    def next_batch(self, stream: PromptStream, model: torch.nn.Module) -> RLBatch:
        draw = stream.next_batch()
        G = self.cfg.group_size
        rows = [self.prompt_ids[i] for i in draw.indices for _ in range(G)]
        records = [self.prompts[i] for i in draw.indices for _ in range(G)]
        generator = torch.Generator(device=self.decode.device).manual_seed(sampling_seed(self.seed, draw.epoch,
                                                                                         draw.start))
        t0 = time.perf_counter()
        with decoding(self.policy):
            ids, logps = generate(self.policy, rows, self.stop_ids, self.sampling, self.tok.pad_id,
                                  generator=generator, runtime=self.decode, return_logprobs=True)
        stopped = [bool(x) and x[-1] in self.stop_ids for x in ids]
        texts = [self.tok.decode(x[:-1] if s else x) for x, s in zip(ids, stopped)]
        scored = self.rewards.score(records, texts, stopped)
        check_errors(scored.results, f"rl: the rollouts of prompts {draw.indices}")
        rewards = torch.tensor(scored.total, dtype=torch.float64)
        advantages = group_advantages(rewards, G)
        batch = build_batch(rows, ids, logps, advantages, rewards, self.tok.pad_id, packing=self.cfg.packing)
        groups = rewards.view(-1, G)
        std = groups.std(1, unbiased=False)
        stats = Counter({"prompts": len(draw.indices), "rows": len(rows), "reward": float(rewards.sum()),
                         "reward_std": float(std.sum()), "frac_reward_zero_std": float((std == 0).sum()),
                         "completions/mean_length": float(sum(len(x) for x in ids)),
                         "completions/clipped_ratio": float(sum(not s for s in stopped)),
                         "stop_rate": float(sum(stopped)),
                         "trivial_rate": float(sum(r == "trivial" for r in scored.reasons)),
                         "rollout_s": time.perf_counter() - t0,
                         "pad_slots": float(batch.slots[0]), "row_slots": float(batch.slots[1])})
        for name, values in scored.each.items():
            stats[f"rewards/{name}"] = float(sum(v for v in values if v is not None))
            stats[f"applies/{name}"] = float(sum(v is not None for v in values))
        for r in scored.results:
            stats[f"sandbox/{r.verdict}"] += 1
        batch.stats = dict(stats)
        self._acc.update(stats)
        return batch

    # -- the loss ---------------------------------------------------------------------------------
    def count(self, batch: RLBatch) -> float:
        """What the step's loss is divided by (summed over micro-batches and ranks): see
        `policy_gradient_loss`'s loss types."""
        R = batch.tokens.shape[0]
        kind = self.cfg.loss_type
        return float(R * self.cfg.max_new_tokens if kind == "dr_grpo" else R if kind == "grpo" else batch.n_supervised)

    def loss(self, model: torch.nn.Module, batch: RLBatch) -> tuple[torch.Tensor, None]:
        lp = batch.logps(model, self.cfg.temperature)
        ref = self.reference(batch) if self.cfg.beta > 0 else None
        num, _ = policy_gradient_loss(lp, batch.advantages, batch.loss_mask, self.cfg.loss_type,
                                      self.cfg.max_new_tokens, ref, self.cfg.beta)
        m = batch.loss_mask
        self._acc["mismatch_kl"] += float(((batch.sampler_logps - lp.detach()) * m).sum())
        self._acc["tokens"] += float(m.sum())
        return num, None

    def step_metrics(self, dist: DistInfo) -> dict:
        """The rollouts' means over the step (every micro-batch and rank); resets the sums."""
        keys = self._keys
        totals = all_reduce_sum(torch.tensor([self._acc[k] for k in keys], dtype=torch.float64,
                                             device=dist.device), dist).cpu().tolist()
        self._acc = Counter()
        t = dict(zip(keys, totals))
        rows, prompts, tokens = max(t.get("rows", 0.0), 1.0), max(t.get("prompts", 0.0), 1.0), max(t.get("tokens", 0.0), 1.0)
        out = {}
        for k, v in t.items():
            if k in ("rows", "prompts", "tokens", "row_slots"):
                continue
            if k == "pad_slots":  # the share of the forward's row slots that held no rollout
                out["padding"] = round(v / max(t.get("row_slots", 0.0), 1.0), 4)
                continue
            if k in ("reward_std", "frac_reward_zero_std"):
                out[k] = v / prompts
            elif k == "mismatch_kl":
                out[k] = v / tokens
            elif k.startswith("sandbox/"):
                out[k] = int(v)
            elif k.startswith("rewards/"):  # over the completions the reward applies to
                n = t.get("applies/" + k.split("/", 1)[1], rows)
                out[k] = v / n if n else 0.0  # applies/NAME = 0 says it met no prompt it covers
            elif k == "rollout_s":
                out[k] = round(v, 3)
            else:
                out[k] = v / rows
        return out

    # -- validation -------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self, model: torch.nn.Module, batches: Iterable[Sequence[int]], runtime: Runtime,
                 dist: DistInfo) -> dict:
        """Greedy completions of the held-out prompts (every rank scores all of them): `val_reward`,
        `val_static` with `val_static_lo` / `val_static_hi` (95% Wilson), `val_parse_end` (parses and
        ends its turn), `val_trivial_rate`, `val_n`; for standard-library prompts also
        `val_behaviour` (with `_lo`, `_hi` and `_n`: the held-out functions it applies to)."""
        greedy = SamplingConfig(max_new_tokens=self.cfg.max_new_tokens, greedy=True, repetition_penalty=1.0,
                                compile=self.compile_decode)
        n = reward = static = parse_end = trivial = b_pass = b_n = 0.0
        for chunk in batches:
            rows = [self.val_ids[i] for i in chunk]
            recs = [self.val_prompts[i] for i in chunk]
            with decoding(self.policy):
                ids = generate(self.policy, rows, self.stop_ids, greedy, self.tok.pad_id, runtime=self.decode)
            stopped = [bool(x) and x[-1] in self.stop_ids for x in ids]
            texts = [self.tok.decode(x[:-1] if s else x) for x, s in zip(ids, stopped)]
            scored = self.rewards.score(recs, texts, stopped)
            n += len(rows)
            reward += sum(scored.total)
            static += sum(s and not why for s, why in zip(stopped, scored.reasons))
            parse_end += sum(s and why not in ("does not parse", "text after the function")
                             for s, why in zip(stopped, scored.reasons))
            trivial += sum(why == "trivial" for why in scored.reasons)
            behaviour, results = scored.each.get("behaviour"), scored.results
            if behaviour is None and all(Behaviour.key(r) for r in recs):
                behaviour, found = self.rewards.behaviour(recs, texts, scored.reasons)
                results = results + found
            check_errors(results, "rl: the held-out prompts' completions")
            for v in behaviour or ():
                if v is not None:
                    b_n += 1
                    b_pass += v
        lo, hi = wilson_interval(int(static), int(n))
        d = max(n, 1.0)
        out = {"val_reward": reward / d, "val_static": static / d, "val_static_lo": lo, "val_static_hi": hi,
               "val_parse_end": parse_end / d, "val_trivial_rate": trivial / d, "val_n": int(n)}
        if b_n:
            lo, hi = wilson_interval(int(b_pass), int(b_n))
            out.update(val_behaviour=b_pass / b_n, val_behaviour_lo=lo, val_behaviour_hi=hi, val_behaviour_n=int(b_n))
        return out


def token_reference(model: torch.nn.Module, runtime: Runtime, temperature: float):
    """(RLBatch) -> (R, T) float32 log-probabilities under the initial weights, no grad
    (`train.dpo.reference_model`: with adapters, `model` itself with them disabled; without, a
    frozen copy of `model` as it is now)."""
    from lmforge.train.dpo import reference_model

    scoring = reference_model(model, runtime)

    def ref(batch: RLBatch) -> torch.Tensor:
        with scoring() as reference:
            return batch.logps(reference, temperature)

    return ref


__all__ = ["RLBatch", "RLObjective", "build_batch", "sampling_seed", "token_reference"]
