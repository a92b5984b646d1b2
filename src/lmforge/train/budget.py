"""`train.time_budget_s`: the pretraining stage planned for seconds of wall clock, not steps.

The budget covers the whole stage, from the command's start to its end: start-up (`lmforge
pretrain`: from the process's start, `command_start`, which the CLI passes down as `started`; a
call from Python: from its training session's start), the budget's own measurement (and the
compile it pays, once: the run reuses the compiled graph), the steps, the validations and the
checkpoints. All of it on one clock, `budget_clock`. The step count N is decided twice, each time
from what is left of the budget:

1. before the run (`resolve_time_budget`, from `stages.common.run_training`): a few steps
   (`BUDGET_TIMED_STEPS`) timed on a throw-away copy of the model and optimizer (their median,
   seconds), one validation and one checkpoint timed on that copy (a temporary folder:
   `probe_costs`), then
       N = done + floor((deadline - now - last) / per_step)
       per_step = step_s + val_s / eval_every + save_s / checkpoint_every
       last = val_s + save_s   (the validation and the checkpoint of the final step)
   with a term left out where eval_every or checkpoint_every is 0;
2. in the run, after step `revise_at` (`StepBudget.after_step`, which `Trainer.fit` calls after
   each step: the revision's clock), from the run's own mean step over its steps so far
   (`run_step_seconds`: 10 timed steps said 0.382 s where 1,100 steps of the same run took
   0.403 s on average: step times drift by a few percent over a run). A step over ONE_TIME x the
   median (a graph compiled for a new shape of mask) is a one-time cost, already paid by `now`,
   and left out of the mean; validations and checkpoints (`StepBudget.aside`) are left out too;
3. wsd only: once more before the decay (`next_revision`), from the mean of the steps since the
   first revision: a VM whose steps slowed from 0.29 to 0.32 s after the first revision ended
   the recipe's 460 s stage at 480 s (bench/RESULTS.md, 2026-11-26).

A revision never changes a step already taken: `revise_at` is at most the last step whose
learning rate does not depend on N (cosine: the warm-up; wsd: 80% of the way to the decay
start, and N is kept high enough that the decay starts after it); the first is at most the
first checkpoint's step, so every checkpoint holds a revised N; a revision is skipped
(`revise_at = 0`) when it would average fewer than `MIN_REVISE_STEPS` steps. A `--resume`
takes N from its checkpoint and decides nothing (the schedule of the steps taken stays; from a
checkpoint older than the last revision the run ends at that checkpoint's N).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.config import CONFIG_FILE, TrainConfig
from lmforge.errors import ConfigError
from lmforge.model.io import latest_checkpoint, read_checkpoint_meta
from lmforge.train.checkpoint import rng_state, set_rng_state
from lmforge.train.distributed import DistInfo, all_reduce_min
from lmforge.train.objective import TokenObjective
from lmforge.train.plan import measure_steps
from lmforge.train.schedule import decay_start
from lmforge.train.trainer import Trainer

#: The revision needs at least this many steps of the run to average (else it is skipped).
MIN_REVISE_STEPS = 20
#: wsd: the revision comes at this fraction of the first decision's decay start, so that a
#: revised N a little smaller still starts its decay after the steps already taken.
REVISE_BEFORE_DECAY = 0.8
#: At most this many revisions in a run (wsd: the first at the first checkpoint, one before the decay).
MAX_REVISIONS = 2


@dataclass
class StepBudget:
    """The measured costs and the deadline of a budgeted run, and the clock of its revisions
    (module docstring). Times are `budget_clock()` seconds; `step_s`, `val_s`, `save_s` seconds each."""

    deadline: float
    step_s: float
    val_s: float
    save_s: float
    revise_at: int = 0
    revisions: int = 0
    #: the revision's clock (`start`, `after_step`, `aside`): whether the run's steps are timed, the
    #: seconds each loop of the run took (its step and the rest; validations and saves left out),
    #: the end of the last loop and the seconds set aside since
    timing: bool = field(default=False, repr=False)
    walls: list[float] = field(default_factory=list, repr=False)
    last_end: float | None = field(default=None, repr=False)
    side_s: float = field(default=0.0, repr=False)

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

    # -- the revision's clock (Trainer.fit) ------------------------------------------------------
    def start(self, done: int) -> None:
        """The run starts after `done` steps: its steps are timed while a revision is ahead."""
        self.timing, self.walls, self.last_end, self.side_s = self.revise_at > done + 1, [], None, 0.0

    def after_step(self, train: TrainConfig, step: int, dist: DistInfo) -> tuple[int, str] | None:
        """After step `step` of the run of `train`: at `revise_at`, the revised N (the smallest over
        the ranks: a collective) and the line that says it; None at any other step."""
        if not self.timing:  # no revision ahead: nothing to time
            return None
        now = budget_clock()
        if self.last_end is not None:  # from the end of the first step (the compile's) on
            self.walls.append(now - self.last_end - self.side_s)
        self.last_end, self.side_s = now, 0.0
        if step != self.revise_at:  # timed, not yet due
            return None
        step_s, first = run_step_seconds(self.walls), step - len(self.walls) + 1
        steps = all_reduce_min(self.revised_steps(train, now, step, step_s), dist)
        line = (f"train.time_budget_s: {steps:,} steps (was {train.steps:,}): {step_s:.3f} s a step over the "
                f"run's steps {first}-{step}, {max(0.0, self.deadline - now):.1f} s of the budget left")
        self.revise_at = self.next_revision(train, steps, step)
        self.timing, self.walls = self.revise_at > step, []  # the next from the pace since
        return steps, line

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """A validation or a checkpoint: its time is left out of the step it follows."""
        t = budget_clock()
        yield
        self.side_s += budget_clock() - t


#: A step this many times the median is a one-time cost (a compile), not the run's pace.
ONE_TIME = 5.0


def run_step_seconds(times: list[float]) -> float:
    """The mean of the run's step times (seconds each; a sum of steps is what the budget spends,
    the median hides the steady slow ones), steps over ONE_TIME x the median left out."""
    median = statistics.median(times)
    kept = [t for t in times if t <= ONE_TIME * median]
    return math.fsum(kept) / len(kept)


# -- the decision before the run (stages.common.run_training) ----------------------------------
#: steps timed for `train.time_budget_s` (after one warm-up): the median of 3 right after a compile
#: said 0.453 s where the run then took 0.378 s a step (the speedrun trained 17% fewer steps than
#: its budget held); 10 cost about 4 s at the speedrun's shape. The run revises the count from its
#: own steps (`StepBudget.after_step`).
BUDGET_TIMED_STEPS = 10


def budget_steps(budget_s: float, step_s: float) -> int:
    """The whole steps of `step_s` seconds that fit `budget_s` (at least 1; a quotient a rounding
    error below an integer counts as that integer)."""
    return max(1, int(budget_s / step_s + 1e-9))


def probe_costs(session, model, stream, val_batches, contract_dir: Path, objective: TokenObjective,
                log: Callable[[str], None] = print) -> dict:
    """The budget's measurement on a throw-away copy of the model and optimizer: BUDGET_TIMED_STEPS
    steps after a warm-up (`train.plan.measure_steps`; the compile is paid here, the run reuses
    its graph), one validation and one checkpoint into a temporary folder; the data stream and
    every RNG are put back where they were, so the run is the one `train.steps = N` would give.
    `session` is the stage's `TrainingSession` (its cfg, info and runtime).
    Returns {"step_s" (the median: a second graph compiled during the timed steps made their mean
    1.87 s where the run's steps took 0.48 s), "val_s", "save_s", "measured_steps"}."""
    cfg, info = session.cfg, session.info
    t = cfg.train
    rng, position = rng_state(), stream.state_dict()  # every generator, CUDA's included
    with tempfile.TemporaryDirectory(prefix="lmforge-budget-") as tmp:
        probe = Trainer(cfg, Path(tmp), Path(contract_dir), copy.deepcopy(model), stream, val_batches, info, False,
                        log, runtime=session.runtime, objective=objective)  # a copy: the run's weights stay
        tokens_per_step = objective.tokens_per_step(t.micro_batch_size, t.grad_accum_steps, info.world_size,
                                                    cfg.data.seq_len)
        measured = measure_steps(probe, BUDGET_TIMED_STEPS, tokens_per_step)
        t0 = time.perf_counter()
        probe.validate()  # without validation data or tasks: next to nothing
        probe.evaluate_tasks()
        val_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        probe.save()
        save_s = time.perf_counter() - t0
        del probe
    set_rng_state(rng)  # the run draws what it would have drawn without the probe
    stream.load_state_dict(position)
    return {"step_s": measured["step_seconds"], "val_s": val_s, "save_s": save_s,
            "measured_steps": measured["measured_steps"]}


def resolve_time_budget(session, model, stream, objective: TokenObjective, val_batches=None,
                        contract_dir: Path | None = None, log: Callable[[str], None] = print
                        ) -> tuple[int, StepBudget | None, str]:
    """`train.time_budget_s` of `session` (the stage's `TrainingSession`): the step count N decided
    from what is left of the budget (counted from `session.started`), the `StepBudget` the trainer
    revises N with (None on --resume) and why, in words (for the stage's line). A new run measures
    on a throw-away copy (`probe_costs`); the smallest step count over the ranks wins. A `--resume`
    takes the run's own step count from its newest checkpoint's config.toml: no new measurement,
    no revision, so the schedule of the steps taken stays.

    Raises:
        ConfigError: a budget already spent by the start-up and the measurement.
        CheckpointError: (later, at the resume check) a budget other than the run's.
    """
    cfg, out, info = session.cfg, session.out, session.info
    t = cfg.train
    latest = latest_checkpoint(out) if session.resume and out.is_dir() else None
    if latest is not None:  # --resume: the run's own N, never a new measurement
        saved = read_checkpoint_meta(latest)[0].train
        return saved.steps, None, f"as in {latest / CONFIG_FILE}, the run being resumed: no new measurement"
    costs = probe_costs(session, model, stream, val_batches, Path(contract_dir or cfg.tokenizer.dir), objective, log)
    budget = StepBudget(deadline=session.started + t.time_budget_s, step_s=costs["step_s"], val_s=costs["val_s"],
                        save_s=costs["save_s"])
    now = budget_clock()
    spent = now - session.started
    if budget.deadline - now - costs["val_s"] - costs["save_s"] < costs["step_s"]:  # not one step fits
        raise ConfigError(f"train.time_budget_s = {t.time_budget_s:g}: the start-up and the measurement took "
                          f"{spent:.1f} s, which leaves no time for one {costs['step_s']:.3f} s step and the "
                          f"final validation and checkpoint. Raise train.time_budget_s, or set "
                          f"train.time_budget_s = 0 and train.steps.")
    steps = all_reduce_min(budget.steps_for(t, now), info)  # the slowest rank's count: every rank the same
    budget.plan_revision(t, steps)
    why = (f"{spent:.1f} s spent on start-up and measurement (the compile included), then "
           f"{costs['step_s']:.3f} s a step (median of {costs['measured_steps']} timed steps on a throw-away copy), "
           f"{costs['val_s']:.2f} s a validation, {costs['save_s']:.2f} s a checkpoint"
           + (f"; revised after step {budget.revise_at} from the run's own steps" if budget.revise_at else ""))
    return steps, budget, why


# -- the clock and the command's start ----------------------------------------------------------
def budget_clock() -> float:
    """The clock of the budget (`time.perf_counter`; tests replace it to test the arithmetic)."""
    return time.perf_counter()


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start time against
    /proc/uptime, 10 ms ticks); None where the system does not say."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, after the (comm)
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def command_start() -> float:
    """The start of the process's own command (`lmforge pretrain ...`) on the budget's clock: the
    process's start, so the budget counts the interpreter's start and the imports (~4 s: the wall
    clock around the command); now where the system does not say. The CLI passes it to the stage
    as `started`."""
    age, now = process_age_s(), budget_clock()
    return now - age if age else now


__all__ = ["StepBudget", "decay_start", "run_step_seconds", "MIN_REVISE_STEPS", "REVISE_BEFORE_DECAY", "ONE_TIME",
           "BUDGET_TIMED_STEPS", "budget_steps", "probe_costs", "resolve_time_budget", "budget_clock",
           "process_age_s", "command_start"]
