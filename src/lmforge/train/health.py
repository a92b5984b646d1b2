"""Training health: one-line warnings while a run goes wrong, and a verdict at its end.

`HealthMonitor.update(row)` reads each step's metrics row (`step`, `loss`, `grad_norm`, `lr`,
`tokens_per_s`, and `update_ratio` on the steps that measure it) and returns the warnings that
step raises. Each detector compares the step with the recent past of the run itself — a
running median and a robust spread (the median absolute deviation, MAD, scaled by 1.4826 to a
standard deviation for normal noise) over the last `WINDOW` steps — so it adapts to the run's
own noise instead of fixed thresholds:

    loss_spike       loss > median + 6 spreads and > 1.1 x median (over the last WINDOW steps); a
                     median under COPY_LOSS nats/token is named as a sign of repeated data
    grad_norm_spike  grad_norm > median + 6 spreads and > 3 x median
    loss_rising      the mean loss of the last third of the last 3 x WINDOW steps is 3% above
                     that of the first third (after warm-up)
    loss_stalled     the three thirds' means lie within 0.1% of each other while the learning rate is
                     still above a tenth of its peak (a plateau is expected only in the last tail of
                     the decay, where the learning rate nears zero)
    lr_band          the peak learning rate (at the end of warm-up) outside [1e-6, 3e-2]
    update_ratio     |delta W| / |W| of one optimizer step above 3e-2, or below 1e-5 while the
                     learning rate is above a tenth of its peak (the usual band is around 1e-3: A.
                     Karpathy, "A Recipe for Training Neural Networks", 2019; measured by the trainer
                     every `UPDATE_RATIO_EVERY` steps; a decay's last steps update next to nothing)
    slow_steps       the median tokens per second of the last 5 steps below half the running
                     median (a sustained slowdown, not one late step)

Reinforcement learning (a row with `reward`, lmforge.train.rl): its loss sits near 0 whatever
happens (the advantages are centred), so the loss detectors do not read it; instead:

    all_groups_equal every group of the last EQUAL_RUN steps had equal rewards
                     (`frac_reward_zero_std` = 1): no advantage, no gradient
    reward_stalled   the mean reward of the last third of the last 3 x RL_WINDOW steps is not
                     above that of the first third (by REWARD_GAIN) while the learning rate is
                     still above a tenth of its peak

A detector that fired stays quiet for `COOLDOWN` steps (the same trouble is one line, not a
hundred). A non-finite loss is not a warning: the trainer stops before such a step.
Warnings go to the progress output (one line each) and into that step's row of
metrics.jsonl (`health`: a list of {kind, step, figure, message}); `verdict()` is the
summary of the run: "healthy" or the warnings' count per kind. The monitor's state is the
rows it has seen, so `--resume` rebuilds it by replaying metrics.jsonl (quietly).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import torch

from lmforge.errors import TrainingError

WINDOW = 50
COOLDOWN = 50
UPDATE_RATIO_EVERY = 25
SLOW_RUN = 5
LR_BAND = (1e-6, 3e-2)
UPDATE_BAND = (1e-5, 3e-2)
MAD_TO_SIGMA = 1.4826
STALL_LR_FRACTION = 0.1
COPY_LOSS = 0.1
RL_WINDOW = 10
EQUAL_RUN = 5
REWARD_GAIN = 0.005

CAUSES = {
    "loss_spike": "usually a learning rate too high for this batch, a bad batch (a long repeated stretch, "
                  "binary data), or gradient clipping off",
    "grad_norm_spike": "usually a learning rate too high, an outlier batch, or train.grad_clip = 0",
    "loss_rising": "usually divergence (learning rate too high, or warm-up too short), or data whose "
                   "distribution changes along the run",
    "loss_stalled": "usually a learning rate far too low, frozen weights, or labels that carry no signal "
                    "(a loss mask that selects nothing useful)",
    "lr_band": "the usual peak learning rates of AdamW / Muon lie between 1e-4 and 1e-2; check train.lr "
               "(sft.lr, dpo.lr)",
    "update_ratio": "|update| / |weights| of one step is usually near 1e-3; far above, the learning rate is "
                    "too high; far below, too low (or the weights barely train)",
    "slow_steps": "usually another process on the same cores, memory swapping, or thermal throttling",
    "all_groups_equal": "every completion of a prompt scores alike: the task is too hard or too easy for the "
                        "model, the reward cannot tell completions apart, or rl.temperature is too low to vary them",
    "reward_stalled": "usually a learning rate too low, rewards too sparse to move (all 0 or all 1), or a reward "
                      "that does not depend on what the model controls",
}


@dataclass
class HealthWarning:
    kind: str
    step: int
    figure: float
    message: str

    def as_dict(self) -> dict:
        return {"kind": self.kind, "step": self.step, "figure": self.figure, "message": self.message}

    def line(self) -> str:
        return f"health: step {self.step}: {self.message} ({CAUSES[self.kind]})"


def _median_spread(values) -> tuple[float, float]:
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    return med, MAD_TO_SIGMA * mad


class HealthMonitor:
    """The detectors of the module docstring over a run of `total_steps` steps whose warm-up is
    `warmup_steps`; `update(row)` after each step."""

    def __init__(self, total_steps: int, warmup_steps: int = 0):
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        self.loss: deque[float] = deque(maxlen=3 * WINDOW)
        self.grad: deque[float] = deque(maxlen=WINDOW)
        self.speed: deque[float] = deque(maxlen=WINDOW)
        self.last_fired: dict[str, int] = {}
        self.warnings: list[HealthWarning] = []
        self.peak_lr = 0.0
        self.lr_checked = False
        self.reward: deque[float] = deque(maxlen=3 * RL_WINDOW)
        self.equal_run = 0

    def _fire(self, kind: str, step: int, figure: float, message: str, out: list[HealthWarning]) -> None:
        if step - self.last_fired.get(kind, -10**9) < COOLDOWN:
            return
        self.last_fired[kind] = step
        w = HealthWarning(kind, step, float(figure), message)
        self.warnings.append(w)
        out.append(w)

    def update(self, row: dict) -> list[HealthWarning]:
        """The warnings of one step's metrics row (see the module docstring)."""
        out: list[HealthWarning] = []
        step, loss, grad, lr = int(row["step"]), float(row["loss"]), float(row["grad_norm"]), float(row["lr"])
        if not (math.isfinite(loss) and math.isfinite(grad)):
            return out
        self.peak_lr = max(self.peak_lr, lr)
        if "reward" in row:  # reinforcement learning: the rewards, not the loss (module docstring)
            self._rewards(row, step, lr, out)
        elif len(self.loss) >= WINDOW // 2:
            recent = list(self.loss)[-WINDOW:]
            med, spread = _median_spread(recent)
            if loss > med + 6 * spread and loss > 1.1 * med:
                copying = (f"; a median under {COPY_LOSS} nats means most batches are text the model now copies "
                           f"(repeated or duplicated data)" if med < COPY_LOSS else "")
                self._fire("loss_spike", step, loss, f"loss {loss:.4g} against a running median of {med:.4g} "
                           f"(spread {spread:.2g}) over the last {len(recent)} steps{copying}", out)
        if len(self.grad) >= WINDOW // 2:
            med, spread = _median_spread(self.grad)
            if grad > med + 6 * spread and grad > 3 * med:
                self._fire("grad_norm_spike", step, grad, f"gradient norm {grad:.4g} against a running median of "
                           f"{med:.4g} over the last {len(self.grad)} steps", out)
        if "reward" not in row:
            self.loss.append(loss)
        self.grad.append(grad)
        if step > self.warmup_steps and len(self.loss) == self.loss.maxlen:
            third = self.loss.maxlen // 3
            first = statistics.fmean(list(self.loss)[:third])
            middle = statistics.fmean(list(self.loss)[third:-third])
            last = statistics.fmean(list(self.loss)[-third:])
            if last > 1.03 * first:
                self._fire("loss_rising", step, last / first, f"the mean loss of the last {third} steps is "
                           f"{last / first - 1:.1%} above that of the {third} before the {third} before them "
                           f"({first:.4g} -> {last:.4g})", out)
            elif max(first, middle, last) - min(first, middle, last) < 1e-3 * abs(first) \
                    and lr > STALL_LR_FRACTION * self.peak_lr > 0:
                self._fire("loss_stalled", step, last / first, f"the mean loss moved by {last / first - 1:+.2%} over "
                           f"the last {self.loss.maxlen} steps at learning rate {lr:.3g}", out)
        if not self.lr_checked and step >= max(self.warmup_steps, 1):
            self.lr_checked = True
            low, high = LR_BAND
            if not low <= self.peak_lr <= high:
                self._fire("lr_band", step, self.peak_lr, f"the peak learning rate {self.peak_lr:.3g} is outside "
                           f"[{low:g}, {high:g}]", out)
        ratio = row.get("update_ratio")
        if ratio is not None and math.isfinite(ratio) and step > self.warmup_steps:
            low, high = UPDATE_BAND
            # the low end only while the learning rate is up: a decay ends with updates near zero
            if ratio > high or (ratio < low and lr > 0.1 * self.peak_lr):
                self._fire("update_ratio", step, ratio, f"|update| / |weights| = {ratio:.3g}, outside [{low:g}, "
                           f"{high:g}]", out)
        speed = row.get("tokens_per_s")
        if speed is not None and math.isfinite(speed) and speed > 0:
            self.speed.append(speed)
            if len(self.speed) >= WINDOW // 2:  # a sustained slowdown: the last SLOW_RUN steps' median
                med, now = statistics.median(self.speed), statistics.median(list(self.speed)[-SLOW_RUN:])
                if now < 0.5 * med:
                    self._fire("slow_steps", step, now, f"{now:,.0f} tokens/s over the last {SLOW_RUN} steps against "
                               f"a running median of {med:,.0f}", out)
        return out

    def _rewards(self, row: dict, step: int, lr: float, out: list[HealthWarning]) -> None:
        reward, equal = float(row["reward"]), float(row.get("frac_reward_zero_std", 0.0))
        self.equal_run = self.equal_run + 1 if equal >= 1.0 else 0
        if self.equal_run >= EQUAL_RUN:
            self._fire("all_groups_equal", step, self.equal_run, f"every group's rewards were equal for the last "
                       f"{self.equal_run} steps (reward {reward:.3g}): no advantage, no gradient", out)
        self.reward.append(reward)
        if step > self.warmup_steps and len(self.reward) == self.reward.maxlen \
                and lr > STALL_LR_FRACTION * self.peak_lr > 0:
            third = RL_WINDOW
            first = statistics.fmean(list(self.reward)[:third])
            last = statistics.fmean(list(self.reward)[-third:])
            if last <= first + REWARD_GAIN:
                self._fire("reward_stalled", step, last - first, f"the mean reward of the last {third} steps is "
                           f"{last:.3g}, against {first:.3g} {2 * third} steps before", out)

    def verdict(self) -> dict:
        """{"verdict": "healthy" | "N warnings", "warnings": {kind: count}, "first": [the first of each]}."""
        if not self.warnings:
            return {"verdict": "healthy", "warnings": {}}
        counts = Counter(w.kind for w in self.warnings)
        first = {}
        for w in self.warnings:
            first.setdefault(w.kind, w.as_dict())
        return {"verdict": f"{len(self.warnings)} warning(s): " + ", ".join(f"{k} x{n}" for k, n in counts.items()),
                "warnings": dict(counts), "first": list(first.values())}


def weights_snapshot(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of the trainable `params` before an optimizer step, for `update_ratio` (one more
    copy of those weights, in their own dtype and device, held until that step is taken)."""
    return [p.detach().clone() for p in params]


def update_ratio(params: list[torch.Tensor], before: list[torch.Tensor]) -> float:
    """|W - W_before| / |W| of one optimizer step: Frobenius norms over all of `params` as one
    vector, in float32. Per tensor a subtraction and two norms, then one copy to the host.

    Cost, counted (not timed): every UPDATE_RATIO_EVERY = 25 steps, about 4 passes over the N
    trainable weights (the snapshot's copy, the subtraction, two norms), i.e. 4N / 25 element
    operations per step against a step's ~6N operations per trained token (Kaplan et al. 2020):
    a fraction 1 / (37.5 x tokens per step), 6.5e-6 for the speedrun's 4,096-token step, and
    under 0.1% even if a memory-bound element operation costs 100 matmul operations. Memory: one
    more copy of the trainable weights during that one step, while the activations are freed.
    """
    with torch.no_grad():
        deltas = torch.stack([torch.linalg.vector_norm(p.detach().float() - b.float()) for p, b in zip(params, before)])
        norms = torch.stack([torch.linalg.vector_norm(p.detach().float()) for p in params])
        delta, norm = torch.stack([torch.linalg.vector_norm(deltas), torch.linalg.vector_norm(norms)]).tolist()
    return delta / max(norm, 1e-30)


def verdict_line(verdict: dict) -> str:
    if not verdict.get("warnings"):
        return "health: healthy (no warning)"
    lines = [f"health: {verdict['verdict']}"]
    for w in verdict.get("first", []):
        lines.append(f"  first {w['kind']} at step {w['step']}: {w['message']}")
    return "\n".join(lines)


def broken_backward_error(step: int, loss: float, n_global: float, compile: bool, device_type: str) -> TrainingError:
    """What stops step `step` (1-based), a process's first, when its loss (nats/token over `n_global`
    supervised targets) is > 0 but its gradient norm exactly 0: the backward pass is broken."""
    return TrainingError(
        f"step {step}: the loss is {loss:.4f} nats/token over {int(n_global)} supervised "
        f"targets but the gradient norm is exactly 0: the backward pass is broken, and every step "
        f"would leave the weights as they are. train.compile = {str(compile).lower()} "
        f"(torch {torch.__version__}, {device_type}): with true, set train.compile=false and run "
        f"again; nothing was saved for this step.")


def divergence_error(step: int, loss: float, grad_norm: float, lr: float, grad_clip: float,
                     last: Path | None) -> TrainingError:
    """What stops step `step` (1-based) before its optimizer step when its loss or gradient norm is
    not finite (`lr`: the step's learning rate; `last`: the run's newest checkpoint, or None)."""
    keep = (f"The newest finite checkpoint is {last}; --resume continues from it, and diverges again "
            f"unless the recipe changes." if last else "No checkpoint of this run was written yet.")
    return TrainingError(
        f"step {step}: the loss is {loss} and the gradient norm {grad_norm}: training diverged "
        f"(lr {lr:.3g}, train.grad_clip {grad_clip}). The step "
        f"was not taken and nothing was saved for it. {keep} Lower train.lr or set train.grad_clip > 0.")


__all__ = ["HealthMonitor", "HealthWarning", "verdict_line", "update_ratio", "weights_snapshot", "CAUSES", "WINDOW",
           "COOLDOWN", "UPDATE_RATIO_EVERY", "broken_backward_error", "divergence_error"]
