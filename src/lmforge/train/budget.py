"""`train.time_budget_s`: the pretraining stage planned for seconds of wall clock, not steps.

The budget covers the whole stage, from the start of the command's training session to its
end: start-up, the budget's own measurement (and the compile it pays, once: the run reuses the
compiled graph), the steps, the validations and the checkpoints. The step count N is decided
twice, each time from what is left of the budget:

1. before the run (`StepBudget.steps_for`, from `stages.common.resolve_time_budget`): a few
   steps timed on a throw-away copy of the model and optimizer (their median, seconds), one
   validation and one checkpoint timed on that copy (a temporary folder), then
       N = done + floor((deadline - now - last) / per_step)
       per_step = step_s + val_s / eval_every + save_s / checkpoint_every
       last = val_s + save_s   (the validation and the checkpoint of the final step)
   with a term left out where eval_every or checkpoint_every is 0;
2. in the run, after step `revise_at` (`Trainer`), from the run's own mean step over its
   steps so far (`run_step_seconds`: 10 timed steps said 0.382 s where 1,100 steps of the same
   run took 0.403 s on average: step times drift by a few percent over a run). A step over
   ONE_TIME x the median (a graph compiled for a new shape of mask) is a one-time cost, already
   paid by `now`, and left out of the mean;
3. wsd only: once more before the decay (`next_revision`), from the mean of the steps since the
   first revision: a VM whose steps slowed from 0.29 to 0.32 s after the first revision ended
   the recipe's 460 s stage at 480 s (bench/RESULTS.md, session 14).

A revision never changes a step already taken: `revise_at` is at most the last step whose
learning rate does not depend on N (cosine: the warm-up; wsd: 80% of the way to the decay
start, and N is kept high enough that the decay starts after it); the first is at most the
first checkpoint's step, so every checkpoint holds a revised N; a revision is skipped
(`revise_at = 0`) when it would average fewer than `MIN_REVISE_STEPS` steps. A `--resume`
takes N from its checkpoint and decides nothing (the schedule of the steps taken stays; from a
checkpoint older than the last revision the run ends at that checkpoint's N).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from lmforge.train.schedule import decay_start

#: The revision needs at least this many steps of the run to average (else it is skipped).
MIN_REVISE_STEPS = 20
#: wsd: the revision comes at this fraction of the first decision's decay start, so that a
#: revised N a little smaller still starts its decay after the steps already taken.
REVISE_BEFORE_DECAY = 0.8
#: At most this many revisions in a run (wsd: the first at the first checkpoint, one before the decay).
MAX_REVISIONS = 2


@dataclass
class StepBudget:
    """The measured costs and the deadline of a budgeted run (module docstring). Times are
    `time.perf_counter()` seconds; `step_s`, `val_s`, `save_s` seconds each."""

    deadline: float
    step_s: float
    val_s: float
    save_s: float
    revise_at: int = 0
    revisions: int = 0

    def per_step(self, train, step_s: float | None = None) -> float:
        """Seconds a step costs, its share of the periodic validations and checkpoints included."""
        s = self.step_s if step_s is None else step_s
        return (s + (self.val_s / train.eval_every if train.eval_every else 0.0)
                + (self.save_s / train.checkpoint_every if train.checkpoint_every else 0.0))

    def steps_for(self, train, now: float, done: int = 0, step_s: float | None = None) -> int:
        """N, the run's whole step count, after `done` steps at `now`: the steps that fit the time
        left after the final validation and checkpoint (at least done + 1)."""
        left = self.deadline - now - self.val_s - self.save_s
        return max(done + 1, done + int(max(0.0, left) / self.per_step(train, step_s) + 1e-9))

    def plan_revision(self, train, steps: int) -> None:
        """Set `revise_at` for a run of `steps` steps of `train` (module docstring)."""
        if train.schedule == "wsd":
            safe = int(REVISE_BEFORE_DECAY * decay_start(steps, train.decay_fraction))
        else:  # cosine's learning rate after the warm-up depends on N
            safe = train.warmup_steps
        at = min(safe, train.checkpoint_every) if train.checkpoint_every else safe
        self.revise_at = at if MIN_REVISE_STEPS <= at < steps else 0

    def next_revision(self, train, steps: int, done: int) -> int:
        """The step of the revision after the one at `done` that made N = `steps` (wsd: at
        REVISE_BEFORE_DECAY of the decay start, MIN_REVISE_STEPS after `done` at least; at most
        MAX_REVISIONS in all), or 0 for none. Counts the revision at `done`."""
        self.revisions += 1
        if train.schedule != "wsd" or self.revisions >= MAX_REVISIONS:
            return 0
        at = int(REVISE_BEFORE_DECAY * decay_start(steps, train.decay_fraction))
        return at if done + MIN_REVISE_STEPS <= at < steps else 0

    def revised_steps(self, train, now: float, done: int, step_s: float) -> int:
        """N again after `done` (= revise_at) steps of the run at `step_s` seconds a step on
        average, kept where no step taken changes its learning rate: wsd's decay starts at or
        after `done` (cosine revises within the warm-up, where N plays no part)."""
        n = self.steps_for(train, now, done, step_s)
        if train.schedule == "wsd":
            while decay_start(n, train.decay_fraction) < done:
                n += 1
        return n


#: A step this many times the median is a one-time cost (a compile), not the run's pace.
ONE_TIME = 5.0


def run_step_seconds(times: list[float]) -> float:
    """The mean of the run's step times (seconds each; a sum of steps is what the budget spends,
    the median hides the steady slow ones), steps over ONE_TIME x the median left out."""
    median = statistics.median(times)
    kept = [t for t in times if t <= ONE_TIME * median]
    return math.fsum(kept) / len(kept)


__all__ = ["StepBudget", "decay_start", "run_step_seconds", "MIN_REVISE_STEPS", "REVISE_BEFORE_DECAY", "ONE_TIME"]
