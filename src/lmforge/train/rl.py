"""Reinforcement learning with verifiable rewards on the one training loop: `RLObjective`.

`RLObjective` is what `Trainer` runs for `lmforge rl`: a group-relative policy gradient ("GRPO",
as TRL and nanochat call it) in its simplest exact form:

1. Rollouts (`next_batch`, `rollout`): `group_size` completions of each prompt a `PromptStream`
   draws, sampled at `rl.temperature` and nothing else (no top-k, top-p or repetition penalty:
   the loss differentiates exactly the distribution sampled from, TRL PR #3029), the sampled stop
   token kept as a target; a group lives in one micro-batch, so on one rank.
2. Rewards from `scorers.rewards`; a completion cut off by the token budget scores 0 (counted).
3. Advantages A = r - group mean, no division by the spread (Dr. GRPO).
4. On policy: one optimizer step per batch of rollouts, so the importance ratio is exactly 1 and
   nothing is clipped. The loss is `model.loss.policy_gradient_loss` at the sampling temperature
   over the trainer's all-reduced sum of `policy_gradient_count` (Dr. GRPO's constant rows x
   max_new_tokens by default): ranks and accumulation cannot change the step (P3).
5. Sampling seeded from (train.seed, where the micro-batch starts in the global prompt order):
   the same completions whatever the ranks or the accumulation, and after a resume.

Left out: a value model (the group mean is the baseline), several steps per batch of rollouts
(and with them PPO's clipping), z-scored advantages, a learned reward model, and a KL term unless
`rl.beta` > 0 (then k3 to `rl.init`: LoRA's model with its adapters disabled, else a frozen copy).

Logged per step: `figures` (TRL's names where one exists; `mismatch_kl`, sampler log p - trainer
log p per sampled token, shows precision or kernels making on-policy into off-policy); at
validation, greedy completions' val_* figures (`validate`).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from lmforge.config import RLConfig, SamplingConfig
from lmforge.data.packing import Batch, build_row, collate, plan_packed
from lmforge.data.prompts import Prompt, PromptStream
from lmforge.generate import generate
from lmforge.model import lora
from lmforge.model.loss import group_advantages, policy_gradient_count, policy_gradient_loss
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
    T = max(int(n.max(initial=0)), 1)  # as wide as the longest rollout, not data.seq_len
    tokens = torch.full((R, T), pad_id, dtype=torch.long)
    targets = torch.zeros((R, T), dtype=torch.long)
    mask = torch.zeros((R, T), dtype=torch.bool)
    sampler = torch.zeros((R, T), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompt_ids, completions, logps)):
        row = seqs[i]
        tokens[i, :n[i]] = torch.as_tensor(row[:-1], dtype=torch.long)
        targets[i, :n[i]] = torch.as_tensor(row[1:], dtype=torch.long)
        a, b = len(p) - 1, len(p) - 1 + len(c)  # the positions whose targets are the completion's tokens
        mask[i, a:b] = True  # the stop token included: ending the turn is trained too
        sampler[i, a:b] = torch.as_tensor(list(lp), dtype=torch.float32)
    positions = torch.arange(T).expand(R, T).clone()
    batch = RLBatch(tokens, targets, mask, positions, sampler, advantages.double(), rewards.double(),
                    slots=(R * T - int(n.sum()), R * T))
    if packing:  # the forward's rows only: every (R, T) field above keeps the padded layout, and so the loss
        layout = plan_packed(n, np.argsort(-n, kind="stable"), T)  # longest first, stable: the same on any rank
        batch.rows = collate([build_row(pieces, lambda j, a, b: seqs[j][a:b], None, T, pad_id) for pieces in layout])
        batch.unpack = torch.zeros((R, T), dtype=torch.long)
        for r, pieces in enumerate(layout):
            at = r * T
            for j, _, m in pieces:
                batch.unpack[j, :m] = torch.arange(at, at + m)
                at += m
        batch.slots = (len(layout) * T - int(n.sum()), len(layout) * T)
    return batch


class Figure(NamedTuple):
    """How `step_metrics` logs a figure the step sums: divided by the step's sum of `per` (at least
    1; None: the sum itself), as `shown` ("" = its key), rounded to `digits` (None: not; 0: an int)."""

    per: str | None
    shown: str = ""
    digits: int | None = None


#: The sums a step's figures are divided by (`Figure.per`); not logged themselves.
DENOMINATORS = ("prompts", "rows", "tokens", "row_slots")
#: The figures a step sums (`next_batch`, `loss`) and how each is logged; `figures` adds the rewards'.
FIGURES = {**dict.fromkeys(("reward", "completions/mean_length", "completions/clipped_ratio", "stop_rate",
                             "trivial_rate"), Figure("rows")),  # means per rollout
           "reward_std": Figure("prompts"), "frac_reward_zero_std": Figure("prompts"),  # per group
           "mismatch_kl": Figure("tokens"),  # per sampled token
           "pad_slots": Figure("row_slots", "padding", 4),  # the share of the forward's row slots left empty
           "rollout_s": Figure(None, digits=3)}  # seconds, summed over micro-batches and ranks


def figures(reward_names: Sequence[str]) -> dict[str, Figure | None]:
    """`FIGURES`, the rewards' (`rewards/NAME` over the completions NAME applies to), the sandbox's verdict
    counts and the `DENOMINATORS` (None), sorted: every rank reduces the same figures in the same order."""
    table: dict[str, Figure | None] = {**FIGURES, **dict.fromkeys(DENOMINATORS)}
    for name in reward_names:
        table[f"rewards/{name}"] = Figure(f"applies/{name}")
        table[f"applies/{name}"] = Figure("rows")
    if SANDBOXED & set(reward_names):
        table.update({f"sandbox/{v}": Figure(None, digits=0) for v in (*VERDICTS, "NODOC")})
    return dict(sorted(table.items()))


class Rollout(NamedTuple):
    """Scored completions (`RLObjective.rollout`): new ids (a sampled stop token included), their
    sampler log-probabilities (or None), whether each stopped, its text without the stop, the scores."""

    ids: list[list[int]]
    logps: list[list[float]] | None
    stopped: list[bool]
    texts: list[str]
    scored: object


class RLObjective(TokenObjective):
    """The trainer's objective for `lmforge rl` (module docstring).

    `policy`: the model being trained (the raw Transformer: rollouts decode with it);
    `prompts` / `prompt_ids`: the training prompts and their rendered ids; `val_prompts` /
    `val_ids`: the held-out ones; `stop_ids`: the ids that end a completion; `reference`: a
    function (RLBatch) -> (R, T) log-probabilities under `rl.init` (rl.beta > 0), else None.

    One step by hand, as `Trainer` runs it (a random tiny model; the static reward: 1 for a body
    that passes the static check and ends its turn — this tokenizer decodes every one to a pass):

    >>> from types import SimpleNamespace
    >>> from lmforge.config import ModelConfig
    >>> from lmforge.model import Transformer
    >>> from lmforge.runtime import CPU_FP32
    >>> model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, max_seq_len=32))
    >>> tok = SimpleNamespace(pad_id=0, eos_id=1, im_end_id=2, decode=lambda ids: "    return x")
    >>> prompt = Prompt([{"role": "user", "content": "def f(x):"}], "example:1", "f", {"signature": "def f(x):"})
    >>> rl = RLObjective(RLConfig(group_size=4, max_new_tokens=6, loss_type="dapo"), model, tok, [prompt],
    ...                  [[3, 4, 5]], Rewards(["static"]), CPU_FP32, seed=0)
    >>> batch = rl.next_batch(PromptStream(1, 1, seed=0), model)  # 1 prompt x 4 sampled completions
    >>> batch.tokens.shape[0], batch.advantages.sum().item()  # advantages: reward - its group's mean
    (4, 0.0)
    >>> rl.count(batch) == batch.loss_mask.sum().item()  # "dapo": the step divides by its completion tokens
    True
    >>> numerator, _ = rl.loss(model, batch)
    >>> numerator.backward()  # the trainer's backward, before dividing by the step's summed counts
    >>> sorted(rl.step_metrics(DistInfo()))[:4]
    ['applies/static', 'completions/clipped_ratio', 'completions/mean_length', 'frac_reward_zero_std']
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
        self.figures = figures(rewards.names)  # what step_metrics reduces and logs

    # -- rollouts ---------------------------------------------------------------------------------
    def rollout(self, rows: Sequence[Sequence[int]], records: Sequence[Prompt], sampling: SamplingConfig,
                generator: torch.Generator | None = None, logprobs: bool = False) -> Rollout:
        """Generate -> decode -> score: the policy's completions of the prompt ids `rows` (`records`: what
        the rewards read) under `sampling`; with `logprobs`, the sampler's log-probabilities too."""
        with decoding(self.policy):
            out = generate(self.policy, rows, self.stop_ids, sampling, self.tok.pad_id, generator=generator,
                           runtime=self.decode, return_logprobs=logprobs)
        ids, logps = out if logprobs else (out, None)
        stopped = [bool(x) and x[-1] in self.stop_ids for x in ids]
        texts = [self.tok.decode(x[:-1] if s else x) for x, s in zip(ids, stopped)]  # the reward never sees the stop
        return Rollout(ids, logps, stopped, texts, self.rewards.score(records, texts, stopped))

    def next_batch(self, stream: PromptStream, model: torch.nn.Module) -> RLBatch:
        draw = stream.next_batch()
        G = self.cfg.group_size
        rows = [self.prompt_ids[i] for i in draw.indices for _ in range(G)]  # a group's rows side by side
        records = [self.prompts[i] for i in draw.indices for _ in range(G)]
        seed = sampling_seed(self.seed, draw.epoch, draw.start)  # by its place in the global order: any rank count
        generator = torch.Generator(device=self.decode.device).manual_seed(seed)
        t0 = time.perf_counter()
        ids, logps, stopped, _, scored = self.rollout(rows, records, self.sampling, generator, logprobs=True)
        check_errors(scored.results, f"rl: the rollouts of prompts {draw.indices}")  # a harness fault is no 0
        rewards = torch.tensor(scored.total, dtype=torch.float64)
        advantages = group_advantages(rewards, G)
        batch = build_batch(rows, ids, logps, advantages, rewards, self.tok.pad_id, packing=self.cfg.packing)
        groups = rewards.view(-1, G)
        std = groups.std(1, unbiased=False)  # the population's: a group of equal rewards is exactly 0
        stats = Counter({"prompts": len(draw.indices), "rows": len(rows), "reward": float(rewards.sum()),
                         "reward_std": float(std.sum()), "frac_reward_zero_std": float((std == 0).sum()),
                         "completions/mean_length": float(sum(len(x) for x in ids)),
                         "completions/clipped_ratio": float(sum(not s for s in stopped)),
                         "stop_rate": float(sum(stopped)),
                         "trivial_rate": float(sum(r == "trivial" for r in scored.reasons)),
                         "rollout_s": time.perf_counter() - t0,
                         "pad_slots": float(batch.slots[0]), "row_slots": float(batch.slots[1])})
        for name, values in scored.each.items():  # sums over the completions each reward applies to
            stats[f"rewards/{name}"] = float(sum(v for v in values if v is not None))
            stats[f"applies/{name}"] = float(sum(v is not None for v in values))
        for r in scored.results:
            stats[f"sandbox/{r.verdict}"] += 1
        batch.stats = dict(stats)
        self._acc.update(stats)
        return batch

    # -- the loss ---------------------------------------------------------------------------------
    def count(self, batch: RLBatch) -> float:
        """What the step's loss is divided by (summed over micro-batches and ranks):
        `policy_gradient_count` of `rl.loss_type`."""
        return policy_gradient_count(batch.loss_mask, self.cfg.loss_type, self.cfg.max_new_tokens)

    def loss(self, model: torch.nn.Module, batch: RLBatch) -> tuple[torch.Tensor, None]:
        lp = batch.logps(model, self.cfg.temperature)  # at the sampler's temperature: the distribution sampled
        ref = self.reference(batch) if self.cfg.beta > 0 else None
        num = policy_gradient_loss(lp, batch.advantages, batch.loss_mask, self.cfg.loss_type, ref, self.cfg.beta)
        m = batch.loss_mask
        self._acc["mismatch_kl"] += float(((batch.sampler_logps - lp.detach()) * m).sum())
        self._acc["tokens"] += float(m.sum())
        return num, None

    def step_metrics(self, dist: DistInfo) -> dict:
        """The step's figures (every micro-batch and rank) as `figures` says; resets the sums."""
        keys = list(self.figures)
        totals = all_reduce_sum(torch.tensor([self._acc[k] for k in keys], dtype=torch.float64,
                                             device=dist.device), dist).cpu().tolist()
        self._acc = Counter()
        t = dict(zip(keys, totals))
        out = {}
        for k, how in self.figures.items():
            if how is None:  # a denominator
                continue
            v = t[k] if how.per is None else t[k] / max(t[how.per], 1.0)  # at least 1: a figure none met is 0
            out[how.shown or k] = v if how.digits is None else round(v, how.digits or None)  # digits 0: an int
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
                                compile=self.compile_decode)  # a figure that moves with the weights, not luck
        n = reward = static = parse_end = trivial = b_pass = b_n = 0.0
        for chunk in batches:
            rows = [self.val_ids[i] for i in chunk]
            recs = [self.val_prompts[i] for i in chunk]
            _, _, stopped, texts, scored = self.rollout(rows, recs, greedy)
            n += len(rows)
            reward += sum(scored.total)
            static += sum(s and not why for s, why in zip(stopped, scored.reasons))  # a cut-off body never passes
            parse_end += sum(s and why not in ("does not parse", "text after the function")  # the format alone
                             for s, why in zip(stopped, scored.reasons))
            trivial += sum(why == "trivial" for why in scored.reasons)
            behaviour, results = scored.each.get("behaviour"), scored.results
            if behaviour is None and all(Behaviour.key(r) for r in recs):  # measured even when not a reward
                behaviour, found = self.rewards.behaviour(recs, texts, scored.reasons)
                results = results + found
            check_errors(results, "rl: the held-out prompts' completions")
            for v in behaviour or ():
                if v is not None:  # None: a function the behaviour cases cannot call
                    b_n += 1
                    b_pass += v
        lo, hi = wilson_interval(int(static), int(n))  # the held-out set is small: say how sure the figure is
        d = max(n, 1.0)
        out = {"val_reward": reward / d, "val_static": static / d, "val_static_lo": lo, "val_static_hi": hi,
               "val_parse_end": parse_end / d, "val_trivial_rate": trivial / d, "val_n": int(n)}
        if b_n:  # only where some held-out function has behaviour cases
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


__all__ = ["DENOMINATORS", "FIGURES", "Figure", "RLBatch", "RLObjective", "Rollout", "build_batch", "figures",
           "sampling_seed", "token_reference"]
