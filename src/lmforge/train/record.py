"""What the training loop (`lmforge.train.trainer.Trainer.fit`) records and says: each step's
health warnings (lmforge.train.health), its row of metrics.jsonl, TensorBoard (`train.tensorboard`,
lmforge.train.tensorboard) and the progress bar (`StepRecord`); the line of a run stopped early;
and, on `--resume`, the health monitor's state read back from metrics.jsonl (`replay_health`)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from tqdm import tqdm

from lmforge.fileio import open_append
from lmforge.model.io import step_dir_name
from lmforge.train.resume import METRICS_FILE
from lmforge.train.tensorboard import TENSORBOARD_DIR, GuardedBoard


class StepRecord:
    """The record of each step of `trainer`'s loop (`Trainer.fit`; a context manager around it): the
    health monitor's warnings (every rank: they are in the returned metrics) and, on the main
    rank, metrics.jsonl, TensorBoard (train.tensorboard) and the progress bar."""

    def __init__(self, trainer):
        self.trainer = trainer
        main = trainer.dist.is_main
        self.file = open_append(trainer.run_dir / METRICS_FILE) if main else None
        try:
            self.board = self._tensorboard(trainer) if main else None
        except BaseException:  # its config or plan could not be written: the file goes too
            if self.file:
                self.file.close()
            raise
        self.bar = tqdm(total=trainer.cfg.train.steps, initial=trainer.step, desc="train", unit="step",
                        disable=not (trainer.progress and main), mininterval=1.0, dynamic_ncols=True)

    def __call__(self, m: dict, final: bool) -> dict:
        """Record step metrics `m` (`final`: the run's last step); returns them, warnings included."""
        t = self.trainer
        del m["step_tokens"]
        warnings = t.health.update(m)
        if warnings:
            m["health"] = [w.as_dict() for w in warnings]
            if t.dist.is_main:
                for w in warnings:
                    tqdm.write(w.line(), file=sys.stderr)
        if self.file:
            self.file.write(json.dumps(m) + "\n")
            self.file.flush()
        if self.board is not None:
            self.board.write(m)
        self.bar.update(1)
        if t.step % t.cfg.train.log_every == 0 or final:
            self.bar.set_postfix(loss=f"{m['loss']:.3f}", lr=f"{m['lr']:.2e}", tok_s=f"{m['tokens_per_s']:.0f}",
                                 refresh=False)
        return m

    def set_total(self, steps: int) -> None:
        """The run's step count changed (train.time_budget_s's revision): the health monitor and the
        bar take the new one."""
        self.trainer.health.total_steps = steps
        self.bar.total = steps
        self.bar.refresh()

    def stopped(self, last: dict, out_of_time: bool, signum: int | None) -> None:
        """A run stopped before its last step (its checkpoint written): say why and how to go on;
        `last` gets `interrupted` (by a signal, not the time limit) and the `signal`."""
        t = self.trainer
        why = "time limit reached" if out_of_time else (
            signal.Signals(signum).name if signum else "another rank was signalled")
        if t.dist.is_main:
            t.log(f"\nstopped at step {t.step} of {t.cfg.train.steps} ({why}); checkpoint written to "
                  f"{t.run_dir / step_dir_name(t.step)}. To continue, run the same "
                  f"command again with --resume (same --out {t.run_dir}).")
        last["interrupted"] = not out_of_time
        if signum is not None:
            last["signal"] = int(signum)

    def __enter__(self) -> StepRecord:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close the bar, the file and the board; a TensorBoard failure is said here unless another
        error is on its way out."""
        self.bar.close()
        if self.file:
            self.file.close()
        if self.board is not None:
            self.board.close(quiet=exc is not None)

    @staticmethod
    def _tensorboard(trainer) -> GuardedBoard | None:
        if not trainer.cfg.train.tensorboard:
            return None
        board = GuardedBoard(trainer.run_dir / TENSORBOARD_DIR, purge_step=trainer.step + 1 if trainer.step else None)
        try:
            board.text("config", "```\n" + trainer.cfg.to_toml() + "```")
            plan = trainer.run_dir / "plan.json"
            if plan.is_file():
                board.text("plan", "```\n" + plan.read_text(encoding="utf-8", errors="replace") + "\n```")
        except BaseException:
            board.close(quiet=True)
            raise
        return board


def replay_health(health, path: Path, step: int) -> None:
    """`health` (a HealthMonitor) as it stood after step `step` of a resumed run: the run's rows
    of metrics.jsonl (`path`) so far, replayed quietly."""
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
            if row["step"] <= step:  # another rank's run folder may still hold a killed run's later rows
                health.update(row)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            continue


__all__ = ["StepRecord", "replay_health"]
