"""What the stages share: the log, the training-session preamble and tail that pretrain and
SFT both use, the start-up report, and loading a checkpoint for inference."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lmforge.config import AUTO_MICRO_BATCH, CONFIG_FILE, Config
from lmforge.errors import ConfigError, LmforgeError, require_package
from lmforge.fileio import OutputError, copy_file, make_folder, open_run_dir, output_lock, write_text
from lmforge.model import Transformer
from lmforge.model.transformer import check_fits_in_memory
from lmforge.model.attention import resolve_backend
from lmforge.model.io import CONTRACT_FILES, latest_checkpoint, list_checkpoints, read_checkpoint_meta
from lmforge.runtime import Runtime, training_runtime
from lmforge.tokenizer import Tokenizer
from lmforge.train.distributed import DistInfo, all_reduce_min, all_reduce_sum, barrier, init_distributed, shutdown
from lmforge.train.plan import PLAN_FILE, auto_micro_batch, available_memory, make_plan, measure_steps, plan_lines
from lmforge.train.trainer import TokenObjective, Trainer, seed_everything


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- training sessions (pretrain, sft) ----------------------------------------------------------
@dataclass
class TrainingSession:
    """What a training stage has decided before any work: ranks and device, the attention
    backend, the compute precision; `open_run()` then claims the run folder."""

    cfg: Config
    out: Path
    command: str
    resume: bool
    dry_run: bool
    info: DistInfo
    backend: str
    runtime: Runtime
    stack: contextlib.ExitStack

    def open_run(self) -> None:
        """Check, lock and mark the run folder (`fileio.open_run_dir`: refused unless absent,
        empty, or this command's own run, which needs `--resume` once it holds checkpoints).
        Call it after the stage's own input checks, so refused input leaves no folder behind."""
        if self.dry_run:
            return
        # Every rank checks the folder before rank 0 changes anything (a rank that checked
        # while rank 0 wrote the marker would see a half-made folder), then all agree: a
        # refusal on any rank is a refusal on every rank, never a rank left waiting.
        refusal: LmforgeError | None = None
        try:
            if self.info.is_main:
                self.stack.enter_context(output_lock(self.out))
            open_run_dir(self.out, self.command, self.resume, list_checkpoints, create=False)
        except LmforgeError as exc:
            refusal = exc
        refused = all_reduce_sum(torch.tensor([float(refusal is not None)]), self.info).item()
        if refusal is not None:
            raise refusal
        if refused:
            raise OutputError(f"--out {self.out}: another rank refused the run folder (its message is above); "
                              f"nothing was written.")
        if self.info.is_main:
            make_folder(self.out, self.command)
        barrier(self.info)


@contextlib.contextmanager
def training_session(cfg: Config, out: str | Path, command: str, resume: bool, dry_run: bool
                     ) -> Iterator[TrainingSession]:
    """The preamble of every training stage (pretrain, sft): validate the parallel degrees
    and start the process group, pick the attention backend and the precision (before any
    work), seed every RNG. The process group is shut down and the run folder's lock
    released on the way out.

    Raises:
        ConfigError: see `init_distributed`, `resolve_backend`.
    """
    if cfg.train.tensorboard:  # an optional package: refused before any work, not at the first step
        require_package("tensorboard", "tensorboard", "train.tensorboard = true", ConfigError)
    info = init_distributed(cfg)  # validates the parallel degrees against WORLD_SIZE first
    try:
        if cfg.train.micro_batch_size == AUTO_MICRO_BATCH:
            cfg = resolve_auto_batch(cfg, Path(out), resume, info)
        # the model's vocab is not resolved yet: the tokenizer's size bounds it from above
        check_fits_in_memory(replace(cfg.model, vocab_size=cfg.model.vocab_size or cfg.tokenizer.vocab_size),
                             cfg.train.micro_batch_size * cfg.data.seq_len)
        backend = resolve_backend(cfg.model.attention, info.device, training=True)
        runtime = training_runtime(cfg.train.precision, info.device)
        with contextlib.ExitStack() as stack:
            seed_everything(cfg.train.seed)
            yield TrainingSession(cfg, Path(out), command, resume, dry_run, info, backend, runtime, stack)
    except BaseException:
        shutdown(info)
        raise
    shutdown(info, together=True)


def resolve_auto_batch(cfg: Config, out: Path, resume: bool, info: DistInfo) -> Config:
    """`train.micro_batch_size = "auto"`: the micro-batch and accumulation that keep
    train.global_batch_size, decided once (`train.plan.auto_micro_batch`, the smallest choice
    over the ranks) and said in one line; a `--resume` takes the run's own numbers, so the run
    continues exactly whatever memory this machine has now."""
    t = cfg.train
    dp = max(1, info.world_size // t.context_parallel)
    rows = t.global_batch_size // dp
    latest = latest_checkpoint(out) if resume and out.is_dir() else None
    saved = read_checkpoint_meta(latest)[0].train.micro_batch_size if latest is not None else 0
    if saved and rows % saved == 0:
        micro, why = saved, f"as in {latest / CONFIG_FILE}, the run being resumed"
    else:
        model_cfg = replace(cfg.model, vocab_size=cfg.model.vocab_size or cfg.tokenizer.vocab_size)
        micro, why = auto_micro_batch(model_cfg, cfg.data.seq_len, rows, available_memory(info.device))
        micro = all_reduce_min(micro, info)
    if info.is_main:
        log(f'train.micro_batch_size = "auto": {micro} rows per micro-batch, train.grad_accum_steps = {rows // micro} '
            f"({why}); train.global_batch_size {t.global_batch_size} kept over {dp} rank(s)")
    return replace(cfg, train=replace(t, micro_batch_size=micro, grad_accum_steps=rows // micro))


#: steps timed for `train.time_budget_s` (after one warm-up): the median of 3 right after a compile
#: said 0.453 s where the run then took 0.378 s a step (the speedrun trained 17% fewer steps than
#: its budget held); 10 cost about 4 s at the speedrun's shape
BUDGET_TIMED_STEPS = 10


def budget_steps(budget_s: float, step_s: float) -> int:
    """The whole steps of `step_s` seconds that fit `budget_s` (at least 1; a quotient a rounding
    error below an integer counts as that integer)."""
    return max(1, int(budget_s / step_s + 1e-9))


def resolve_time_budget(session: TrainingSession, model: Transformer, stream, objective: TokenObjective,
                        rows_per_sample: int = 1) -> Config:
    """`train.time_budget_s`: the config with train.steps = the budget / the median step time,
    decided once and said in one line. A new run times steps on a throw-away copy of the model
    and optimizer (`train.plan.measure_steps`, as `--dry-run` does), then puts the data stream and
    every RNG back where they were, so the run is the one `train.steps = N` would give; the
    smallest step count over the ranks wins. A `--resume` takes the run's own step count from its
    newest checkpoint's config.toml: no new measurement, so the schedule of the steps taken stays.

    Raises:
        CheckpointError: (later, at the resume check) a budget other than the run's.
    """
    import copy
    import random

    import numpy as np

    cfg, out, info = session.cfg, session.out, session.info
    t = cfg.train
    latest = latest_checkpoint(out) if session.resume and out.is_dir() else None
    if latest is not None:
        saved = read_checkpoint_meta(latest)[0].train
        steps, why = saved.steps, f"as in {latest / CONFIG_FILE}, the run being resumed: no new measurement"
    else:
        rng = (torch.get_rng_state(), random.getstate(), np.random.get_state(), stream.state_dict())
        probe = Trainer(cfg, Path("."), Path("."), copy.deepcopy(model), stream, None, info, False, log,
                        runtime=session.runtime, objective=objective)
        tokens_per_step = t.micro_batch_size * rows_per_sample * t.grad_accum_steps * info.world_size \
            * cfg.data.seq_len
        measured = measure_steps(probe, BUDGET_TIMED_STEPS, tokens_per_step)
        del probe
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        stream.load_state_dict(rng[3])
        step_s = measured["step_seconds"]
        steps = all_reduce_min(budget_steps(t.time_budget_s, step_s), info)
        why = f"{step_s:.3f} s per step over {measured['measured_steps']} timed steps on a throw-away copy"
    if info.is_main:
        log(f"train.time_budget_s = {t.time_budget_s:g}: {steps:,} steps ({why}); warm-up {t.warmup_steps}, "
            f"{t.schedule} schedule over {steps:,} steps; written to {out / CONFIG_FILE}")
    return replace(cfg, train=replace(t, steps=steps))


def copy_contract_files(src: Path, dst: Path) -> None:
    """The contract and tokenizer files of `src` into `dst`, each atomically; a file already
    identical is not rewritten (a resumed run's folder keeps its bytes and times)."""
    for name in CONTRACT_FILES:
        copy_file(src / name, dst / name)


def startup_report(model: Transformer, tok: Tokenizer, data: dict, cfg: Config, world: int,
                   runtime: Runtime, unit: str = "") -> str:
    """The start-up lines of a training stage. `unit`: what a micro-batch counts when it is not
    rows ("pairs": DPO's two rows each)."""
    c, t = model.config, cfg.train
    rows = 2 if unit == "pairs" else 1
    per_step = t.micro_batch_size * rows * t.grad_accum_steps * world * cfg.data.seq_len
    lines = [
        f"model: dim {c.dim}, {c.n_layers} layers, {c.n_heads} heads / {c.n_kv_heads} kv heads, "
        f"ffn {c.resolved_ffn_dim()}, {model.num_parameters():,} parameters "
        f"({model.num_parameters(non_embedding=True):,} non-embedding), attention {model.layers[0].attention.backend}",
        f"vocab: tokenizer {tok.vocab_size}, model {model.model_vocab_size} (padded to 64); special ids "
        + ", ".join(f"{k}={v}" for k, v in tok.contract.special_tokens.items()),
    ]
    for split, m in data.items():
        lines.append(f"data {split}: {m['documents']:,} documents, {m['tokens']:,} tokens, max id {m['max_id']}")
    shape = f"{t.micro_batch_size} pairs (2 rows each)" if unit == "pairs" else f"{t.micro_batch_size}"
    lines.append(f"batch: {shape} x {cfg.data.seq_len} tokens x {t.grad_accum_steps} accumulation x "
                 f"{world} ranks = {per_step:,} tokens/step; {t.steps} steps = {per_step * t.steps:,} tokens; "
                 f"device {runtime.label}")
    return "\n".join(lines)


def run_training(session: TrainingSession, contract_dir: Path, model: Transformer, stream, val_batches,
                 resume: bool = False, dry_run: bool = False, progress: bool = True,
                 side_files: dict[str, str] | None = None, objective: TokenObjective | None = None) -> dict:
    """The common tail of every training stage (pretrain, sft): one dry-run step, or the one
    `Trainer.fit` into the session's run folder (continuing its newest checkpoint with
    `resume`). `contract_dir` holds the contract and tokenizer files copied into the run
    folder and its checkpoints; `side_files` ({name: text}) are written into the run folder
    only once `--resume` has been accepted (a refused resume changes no file). `objective`:
    the loss (default: the token loss of pretraining and SFT; DPO's for `dpo`)."""
    cfg, out, info = session.cfg, session.out, session.info
    objective = objective or TokenObjective()
    rows = 2 if objective.unit == "pair" else 1
    if dry_run:
        return dry_run_step(model, stream, session.runtime, objective, cfg, info, rows)
    if cfg.train.time_budget_s:
        cfg = session.cfg = resolve_time_budget(session, model, stream, objective, rows)
    trainer = Trainer(cfg, out, Path(contract_dir), model, stream, val_batches, info, progress, log,
                      runtime=session.runtime, objective=objective)
    # before any write: a refused --resume leaves the run folder as it was
    if resume and not trainer.resume(session.command):
        log(f"--resume: no checkpoint in {out} yet; starting from step 0")
    plan = make_plan(trainer, rows_per_sample=rows)
    if info.is_main:
        log(plan_lines(plan))
        # every text made first: a side file that cannot be written leaves no half-made run folder
        texts = {CONFIG_FILE: cfg.to_toml(), PLAN_FILE: json.dumps(plan, indent=2) + "\n", **(side_files or {})}
        copy_contract_files(Path(contract_dir), out)
        for name, text in texts.items():
            write_text(out / name, text, skip_same=True)
    return trainer.fit()


def dry_run_step(model: Transformer, stream, runtime: Runtime, objective: TokenObjective | None = None,
                 cfg: Config | None = None, info: DistInfo | None = None, rows_per_sample: int = 1,
                 steps: int = 3) -> dict:
    """The dry run: one micro-batch forward and backward (its loss reported), then, with `cfg`,
    the plan with measured figures (`lmforge.train.plan`: 1 + `steps` real optimizer steps on
    this model, which is thrown away after). Nothing is written."""
    objective = objective or TokenObjective()
    model.to(runtime.device).train()
    b = stream.next_batch().to(runtime.device)
    with runtime.autocast():
        total, _ = objective.loss(model, b)
    n = max(1, objective.count(b))
    (total / n).backward()
    loss = float(total.detach()) / n
    model.zero_grad(set_to_none=True)
    out = {"loss": loss, "dry_run": True}
    if cfg is not None:
        trainer = Trainer(cfg, Path("."), Path("."), model, stream, None, info or DistInfo(), False, log,
                          runtime=runtime, objective=objective)
        out["plan"] = make_plan(trainer, measure=True, steps=steps, rows_per_sample=rows_per_sample)
        if (info or DistInfo()).is_main:
            log(plan_lines(out["plan"]))
            if cfg.train.time_budget_s:
                n = budget_steps(cfg.train.time_budget_s, out["plan"]["step_seconds"])
                log(f"train.time_budget_s = {cfg.train.time_budget_s:g}: a run would take about {n:,} "
                    f"steps at this step time (measured again at the start of the run)")
    log(f"dry run: one micro-batch forward and backward, loss {loss:.4f} nats/{objective.unit}; all checks passed")
    return out


__all__ = ["log", "TrainingSession", "training_session", "run_training", "dry_run_step", "startup_report",
           "copy_contract_files"]
