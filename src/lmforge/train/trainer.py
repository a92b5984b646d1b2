"""The one training loop. Pretraining, SFT, DPO and RL differ only in their data (a RowStream), their initial
weights and their objective (lmforge.train.objective; train/dpo.py, train/rl.py); all run `Trainer.fit`: the
loop (step records: lmforge.train.record; train.time_budget_s: lmforge.train.budget; SIGINT: lmforge.signals).

One optimizer step:
  1. draw `grad_accum_steps` micro-batches, count their supervised targets, all-reduce that count
     over data-parallel ranks (count first, then backward);
  2. for each micro-batch: loss = summed nats (model(..., targets=, loss_mask=), i.e.
     lmforge.model.loss.linear_cross_entropy_sum) / global_count (* world_size, since
     DDP/FSDP average gradients over ranks), backward;
  3. clip the gradient norm, an optimizer step (Muon + AdamW by default, or AdamW: lmforge.train.optim)
     with the schedule's learning rate.
The logged `loss` is the same per-token mean (nats), whatever the accumulation (P3).

Data parallel (torchrun): each rank draws its own rows (`RowStream`: W ranks x A micro-batches use the
rows one process with W x A micro-batches uses), so N ranks give the loss and the gradients of one
process with N times the accumulation. `raw_model` is the module itself (FSDP2 shards it in place; DDP
wraps it), `model` what runs forward (its blocks recomputed in backward: train.activation_checkpointing).

A checkpoint (every `checkpoint_every` steps, at the end, and on SIGINT/SIGTERM after the
current step) holds full weights, the optimizer state, the data position and every rank's
RNG states; `resume()` continues the run bit for bit on CPU.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from lmforge.config import Config
from lmforge.contract import CONTRACT_FILE, Contract, check_match
from lmforge.data.packing import Batch, RowStream
from lmforge.errors import CheckpointError, LmforgeError
from lmforge.model.memory import release_free_memory
from lmforge.model.io import (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STEP_RE, is_sharded, latest_checkpoint,
                              load_weights, read_checkpoint_meta, step_dir_name)
from lmforge.runtime import Runtime, compiler_available, deterministic_kernels, training_runtime
from lmforge.signals import TrainingStop
from lmforge.train import checkpoint as ckpt
from lmforge.train.distributed import DistInfo, all_reduce_sum, gather_to_main, wrap_model
from lmforge.train.health import (UPDATE_RATIO_EVERY, HealthMonitor, broken_backward_error, divergence_error,
                                  update_ratio, verdict_line, weights_snapshot)
from lmforge.train.optim import build_optimizer
from lmforge.train.objective import TokenObjective
from lmforge.train.resume import (METRICS_FILE, check_optimizer_state, check_resume_config, check_rng_state,
                                 check_training_state, truncate_metrics)
from lmforge.train.record import StepRecord, replay_health
from lmforge.train.schedule import lr_at


@dataclass
class Trainer:
    """Runs `cfg.train.steps` optimizer steps of `model` over `stream` into `run_dir`.

    `contract_dir` holds contract.json + tokenizer files copied into each checkpoint. `val_batches()` returns
    the validation micro-batches (or None to skip validation). `dist` comes from `init_distributed(cfg)`,
    which validated the parallel degrees against the world size; `runtime` (the device and the autocast
    dtype of the steps, the validation, Newton-Schulz) is the command's, by default `training_runtime(...)`.

    Three steps of a one-layer model on a document that repeats 0..7 (`fit()` would also validate,
    record and checkpoint into `run_dir`; a step alone writes nothing):

    >>> import numpy as np
    >>> from dataclasses import replace
    >>> from lmforge.config import Config
    >>> from lmforge.data.packing import RowStream
    >>> from lmforge.model import Transformer
    >>> from lmforge.train.trainer import Trainer
    >>> cfg = Config()
    >>> cfg = replace(cfg, model=replace(cfg.model, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64),
    ...               train=replace(cfg.train, steps=3, warmup_steps=0, micro_batch_size=2, compile=False))
    >>> doc = np.arange(100) % 8
    >>> stream = RowStream(np.array([99]), lambda i, start, stop: doc[start:stop], None, seq_len=16,
    ...                    micro_batch_size=2, pad_id=0, seed=0)
    >>> trainer = Trainer(cfg, "run", ".", Transformer(cfg.model), stream, progress=False)
    >>> losses = [trainer.train_step()["loss"] for _ in range(3)]
    >>> trainer.step, trainer.tokens, losses[2] < losses[0]
    (3, 96, True)
    """

    cfg: Config
    run_dir: Path
    contract_dir: Path
    model: torch.nn.Module
    stream: RowStream
    val_batches: Callable[[], Iterable[Batch]] | None = None
    dist: DistInfo = field(default_factory=DistInfo)
    progress: bool = True
    log: Callable[[str], None] = print
    runtime: Runtime | None = None
    objective: TokenObjective = field(default_factory=TokenObjective)
    #: train.time_budget_s's costs, deadline and clock (lmforge.train.budget.StepBudget, not imported: its probe
    #: builds a Trainer): the step count is revised after step `budget.revise_at` (wsd: once more before the
    #: decay); `on_steps(cfg)` then rewrites the run folder's files
    budget: "StepBudget | None" = None
    on_steps: Callable[[Config], None] | None = None

    def __post_init__(self):
        self.run_dir = Path(self.run_dir)
        self.runtime = self.runtime or training_runtime(self.cfg.train.precision, self.dist.device)
        self.runtime.check_model(self.model)  # no float16 compute for (offset + w) norms
        self.device = self.runtime.device
        self.raw_model = self.model.to(self.device)
        self.raw_model.activation_checkpointing = self.cfg.train.activation_checkpointing
        self.model = wrap_model(self.raw_model, self.cfg.train.data_parallel, self.dist)
        # validation runs this one, never the compiled graph (a second graph: 20 s of the speedrun's pretraining)
        self.eval_model = self.model
        # a compiled CPU step runs with deterministic kernels (runtime.deterministic_kernels says why)
        self._deterministic = False
        if self.cfg.train.compile and compiler_available(self.device, self.log if self.dist.is_main else None):
            self.model = torch.compile(self.model)
            self._deterministic = self.device.type == "cpu"
        self.optimizer = build_optimizer(self.raw_model, self.cfg.train, self.runtime)
        # train.activation_checkpointing on CPU: free heap pages back to the kernel after each forward and backward
        recompute = self.cfg.train.activation_checkpointing and self.device.type == "cpu"
        self._trim = release_free_memory if recompute else lambda: None
        self.step = 0
        self.tokens = 0
        self.supervised = 0
        self.elapsed = 0.0
        self._gradient_checked = False
        self._fsdp = self.dist.distributed and is_sharded(self.raw_model)
        self.health = HealthMonitor(self.cfg.train.steps, self.cfg.train.warmup_steps)
        self.eval_tasks = self._eval_tasks()

    def _eval_tasks(self) -> tuple | None:
        """(tokenizer, tasks) of train.eval_tasks, built before the first step (a bad task file
        stops the run before any work); None without them."""
        if not self.cfg.train.eval_tasks:
            return None
        from lmforge.evals.resolve import fit_tasks, resolve_tasks
        from lmforge.tokenizer import Tokenizer

        tok = Tokenizer.load(self.contract_dir)
        tasks = resolve_tasks(self.cfg.train.eval_tasks, self.cfg, 0, self.cfg.train.eval_tasks_limit, tok)
        return tok, fit_tasks(tasks, tok, self.raw_model.config.max_seq_len)

    def evaluate_tasks(self) -> dict:
        """train.eval_tasks scored now (lmforge.evals.suite, under the run's precision): eval/NAME/accuracy,
        eval/NAME/centred and eval/suite. Every rank scores with a sharded model (its forward is
        collective), only the main rank otherwise; the figures are the main rank's."""
        if self.eval_tasks is None or not (self.dist.is_main or self._fsdp):
            return {}
        from lmforge.evals.suite import run_suite

        tok, tasks = self.eval_tasks
        model = self.eval_model if self._fsdp else self.raw_model
        with self.runtime.autocast():  # the scorer puts the model in eval mode and back
            res = run_suite(model, tok, tasks, device=self.device)
        out = {"eval/suite": res["suite"]}
        for name, r in res["tasks"].items():
            out[f"eval/{name}/accuracy"], out[f"eval/{name}/centred"] = r["accuracy"], r["centred"]
        return out if self.dist.is_main else {}

    # -- state ------------------------------------------------------------------
    def training_state(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "supervised": self.supervised,
                "elapsed_s": round(self.elapsed, 3), "data": self.stream.state_dict()}

    def save(self) -> Path:
        """Write step_NNNNNN (a collective: every rank calls it; rank 0 writes), prune old ones."""
        weights = ckpt.gather_model_state(self.raw_model)
        opt_state = ckpt.gather_optimizer_state(self.raw_model, self.optimizer)
        rngs = gather_to_main(ckpt.rng_state(), self.dist)
        path, error = self.run_dir / step_dir_name(self.step), None
        if self.dist.is_main:  # every rank gathered its part above; one writes
            try:
                path = ckpt.save_checkpoint(self.run_dir, self.step, self.raw_model, self.cfg, self.contract_dir,
                                            state=self.training_state(), model_weights=weights,
                                            optimizer_state=opt_state, rng_states=rngs)
                ckpt.prune_checkpoints(self.run_dir, self.cfg.train.keep_last)
            except BaseException as exc:  # tell the other ranks instead of leaving them in a collective
                error = exc
        failed = all_reduce_sum(torch.tensor([1.0 if error else 0.0], device=self.device), self.dist)
        if error is not None:  # rank 0 says its own error
            raise error
        if failed.item():  # the other ranks say rank 0 failed
            raise CheckpointError(f"rank 0 could not write the checkpoint {path} (see its error); stopping.")
        return path

    def _check_run_folder(self) -> None:
        """A `step_NNNNNN` entry that is not a real folder (a file, a link) is not lmforge's: it
        would be replaced by the next checkpoint of that step. Refused before any write."""
        for p in self.run_dir.glob("step_*") if self.run_dir.is_dir() else ():
            if STEP_RE.match(p.name) and (p.is_symlink() or not p.is_dir()):
                raise CheckpointError(f"{p} is {'a link' if p.is_symlink() else 'not a folder'}; a run folder's "
                                      f"step_NNNNNN entries are checkpoints lmforge wrote. Move it away, or use "
                                      f"another --out.")

    def resume(self, stage: str = "pretrain", dry_run: bool = False) -> bool:
        """Continue from the newest complete checkpoint in run_dir. False if there is none.

        Exact or refused (lmforge.train.resume): the tokenizer contract, every config field
        (`RESUME_RULES`, for `stage` "pretrain" or "sft"), state.json, optimizer.pt and rng.pt are
        checked before anything is loaded; nothing is written here. `dry_run`: the checks and the
        loads only (metrics.jsonl is not cut back to the checkpoint's step).

        Raises:
            CheckpointError / ContractError: naming the file and the field.
        """
        self._check_run_folder()
        latest = latest_checkpoint(self.run_dir)
        if latest is None:  # nothing to continue: the caller starts from step 0
            return False
        saved_cfg, saved_contract = read_checkpoint_meta(latest)
        check_match(Contract.load(self.contract_dir, what="tokenizer folder"), self.contract_dir / CONTRACT_FILE,
                    saved_contract, latest / CONTRACT_FILE)  # --resume with another tokenizer stops here
        state, opt_state, rng = ckpt.load_training_state(latest)  # all of it, or refuse: resume is exact
        steps_key = "train.steps" if stage == "pretrain" else f"{stage}.steps"  # a fine-tuning stage's own section
        check_training_state(state, latest, self.cfg.train.steps, self.run_dir / METRICS_FILE, steps_key)  # the step first
        ranks = check_rng_state(rng, latest / RNG_FILE)
        notes = check_resume_config(saved_cfg, self.cfg, stage, int(state["step"]), latest / "config.toml",
                                    saved_world_size=len(ranks), world_size=self.dist.world_size)
        check_optimizer_state(self.raw_model, self.optimizer, opt_state, latest / OPTIMIZER_FILE)
        load_weights(self.raw_model, latest / MODEL_FILE)  # every rank: full weights -> its shard
        ckpt.load_optimizer_state(self.raw_model, self.optimizer, opt_state, latest / OPTIMIZER_FILE)
        if len(ranks) == self.dist.world_size:  # the same ranks: each takes its own generators back
            ckpt.set_rng_state(ranks[self.dist.rank])
        elif self.dist.is_main:
            self.log(f"note: {latest} was written by {len(ranks)} rank(s), this run has {self.dist.world_size}: "
                     f"weights, optimizer and data position continue, the RNG states start afresh.")
        for note in notes if self.dist.is_main else ():
            self.log(f"note: {note}")
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.supervised, self.elapsed = int(state.get("supervised", 0)), float(state.get("elapsed_s", 0.0))
        try:
            self.stream.load_state_dict(state["data"])
        except (LmforgeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{latest / 'state.json'}: its data position does not fit this run's data "
                                  f"({exc}). Resume from another checkpoint.") from None
        if not dry_run and self.dist.is_main:  # the rows past the checkpoint will be trained again
            truncate_metrics(self.run_dir / METRICS_FILE, self.step)
        replay_health(self.health, self.run_dir / METRICS_FILE, self.step)  # its warnings see the run so far
        if self.dist.is_main:
            self.log(f"resumed from {latest} at step {self.step}")
        return True

    # -- the step -----------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step; returns its metrics."""
        cfg = self.cfg.train
        lr = lr_at(self.step, cfg)  # the schedule at the step about to be taken (0-based)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batches = [self.objective.next_batch(self.stream, self.model) for _ in range(cfg.grad_accum_steps)]  # all first
        local = torch.tensor(float(sum(self.objective.count(b) for b in batches)), dtype=torch.float64)
        n_global = float(all_reduce_sum(local.to(self.device), self.dist).item())  # the step's denominator (P3)
        scale = self.dist.world_size / max(n_global, 1.0)  # x world_size: DDP/FSDP average the ranks' gradients
        loss_sum, stat_sums = self._backward(batches, scale)
        # the norm over all (for FSDP2: DTensor-sharded) gradients; the same on every rank
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(),
                                                   cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor, made whole
            grad_norm = grad_norm.full_tensor()
        # the loss and the norm are global (all-reduced), so every rank takes the same decision
        loss = float(all_reduce_sum(loss_sum.to(self.device), self.dist).item()) / max(n_global, 1.0)
        if not (math.isfinite(loss) and math.isfinite(float(grad_norm))):  # stop before the weights take it
            self.optimizer.zero_grad(set_to_none=True)
            self._non_finite(loss, float(grad_norm))
        if not self._gradient_checked:  # the first step of this process (a resume's too)
            self._gradient_checked = True
            if self.objective.zero_gradient_is_a_fault and n_global > 0 and loss > 0 and float(grad_norm) == 0.0:
                self.optimizer.zero_grad(set_to_none=True)
                raise broken_backward_error(self.step + 1, loss, n_global, self.cfg.train.compile, self.device.type)
        # every UPDATE_RATIO_EVERY steps: |delta W| / |W| of this step, for the health monitor
        # (a copy of the trainable weights; not for FSDP2's DTensor shards)
        trained = [p for p in self.raw_model.parameters() if p.requires_grad]
        before = weights_snapshot(trained) if (self.step + 1) % UPDATE_RATIO_EVERY == 0 and not self._fsdp else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        step_tokens = sum(b.tokens.numel() for b in batches) * self.dist.world_size
        self.tokens += step_tokens
        self.supervised += int(n_global)
        m = {"step": self.step, "loss": loss, "grad_norm": float(grad_norm), "lr": lr,
             "tokens": self.tokens, "supervised": self.supervised, "step_tokens": step_tokens}
        if before is not None:  # a step of the ratio's period
            m["update_ratio"] = update_ratio(trained, before)
        m.update(self.objective.step_metrics(self.dist))  # the objective's own figures (RL's rewards)
        if self.objective.stats:  # per-unit means over every micro-batch and rank
            totals = all_reduce_sum(stat_sums.to(self.device), self.dist).cpu() / max(n_global, 1.0)
            m.update({name: float(v) for name, v in zip(self.objective.stats, totals)})
        return m

    def _backward(self, batches: list, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of the micro-batches (gradients x `scale`): (summed nats, summed stats), float64."""
        loss_sum = torch.zeros((), dtype=torch.float64)
        stat_sums = torch.zeros(len(self.objective.stats), dtype=torch.float64)
        self.model.train()
        for i, b in enumerate(batches):
            b = b.to(self.device)
            sync = i == len(batches) - 1  # gradients cross ranks once a step
            ctx = contextlib.nullcontext()
            if self._fsdp:  # FSDP2: reduce-scatter once, after the last micro-batch
                self.raw_model.set_requires_gradient_sync(sync)
            elif not sync and hasattr(self.model, "no_sync"):  # DDP: all-reduce once, likewise
                ctx = self.model.no_sync()
            with ctx, deterministic_kernels(self._deterministic):  # compiled and run (backward too) under it
                with self.runtime.autocast():
                    nats, stats = self.objective.loss(self.model, b)
                self._trim()
                (nats * scale).backward()
                self._trim()
            loss_sum += nats.detach().double().cpu()
            if stats is not None:  # an objective with figures of its own (DPO's rewards)
                stat_sums += stats.double().cpu()
        return loss_sum, stat_sums

    def _non_finite(self, loss: float, grad_norm: float) -> None:
        """Stop before the optimizer step that would take non-finite values into the weights."""
        raise divergence_error(self.step + 1, loss, grad_norm, lr_at(self.step, self.cfg.train),
                               self.cfg.train.grad_clip, latest_checkpoint(self.run_dir))

    def validate(self) -> dict:
        """The objective's validation figures ({"val_loss": ...}; {"val_loss": None} without
        validation data)."""
        if self.val_batches is None:
            return {"val_loss": None}
        return self.objective.validate(self.eval_model, self.val_batches(), self.runtime, self.dist)

    # -- the loop -------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to cfg.train.steps (from wherever the run stands); return the last metrics. Each
        step: the step, the budget's clock (`budget.after_step`: may revise cfg.train.steps), the
        stop agreed over the ranks, validation, its record (`StepRecord`), its checkpoint."""
        self._check_run_folder()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.is_main:
            ckpt.remove_unfinished(self.run_dir)  # a killed write's leftovers (this process holds the run's lock)
            truncate_metrics(self.run_dir / METRICS_FILE, self.step)  # rows past our checkpoint (a killed run's) go
        last: dict = {}
        start_step = self.step
        if self.budget is not None:
            self.budget.start(self.step)
        # SIGINT/SIGTERM: the step ends, its checkpoint is written, then the loop stops (signals.TrainingStop)
        with TrainingStop() as stop, StepRecord(self) as record:
            while self.step < self.cfg.train.steps:
                t0 = time.perf_counter()
                m = self.train_step()
                dt = time.perf_counter() - t0
                self.elapsed += dt
                m["tokens_per_s"] = m["step_tokens"] / dt
                m["elapsed_s"] = round(self.elapsed, 3)
                revised = self.budget.after_step(self.cfg.train, self.step, self.dist) if self.budget else None
                if revised:  # train.time_budget_s decided N again after this step (lmforge.train.budget)
                    self._set_steps(*revised, record)
                cfg = self.cfg.train
                final = self.step == cfg.steps
                out_of_time, signalled = self._agree_to_stop(cfg.time_limit_s > 0 and self.elapsed >= cfg.time_limit_s,
                                                             stop.signum)
                if (cfg.eval_every and self.step % cfg.eval_every == 0) or final or out_of_time:  # the last step's too
                    with self._aside():
                        m.update(self.validate())
                        m.update(self.evaluate_tasks())
                last = record(m, final)
                halt = (signalled or out_of_time) and not final  # the final step ends the run anyway
                if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or final or halt:
                    with self._aside():
                        self.save()
                if halt:
                    record.stopped(last, out_of_time, stop.signum)  # why, and how to continue
                    break
        last["steps_run"] = self.step - start_step
        last["health"] = self.health.verdict()
        if self.dist.is_main and last["steps_run"]:
            self.log(verdict_line(last["health"]))
        return last

    def _aside(self):
        """A validation or a checkpoint: left out of the budget's step times (lmforge.train.budget)."""
        return self.budget.aside() if self.budget is not None else contextlib.nullcontext()

    def _set_steps(self, steps: int, line: str, record: StepRecord) -> None:
        """train.time_budget_s's revised step count (`budget.after_step`): the run trains `steps`
        steps; its health monitor, progress bar and run folder (`on_steps`) say so, and `line` why."""
        if steps != self.cfg.train.steps:  # the same count changes nothing but is said
            self.cfg = replace(self.cfg, train=replace(self.cfg.train, steps=steps))
            record.set_total(steps)
            if self.on_steps is not None and self.dist.is_main:
                self.on_steps(self.cfg)
        if self.dist.is_main:
            tqdm.write(line, file=sys.stderr)

    def _agree_to_stop(self, out_of_time: bool, signum: int | None) -> tuple[bool, bool]:
        """(out of time, signalled) as every rank sees it: a signal or a clock on one rank
        stops all of them after the same step (the checkpoint is a collective)."""
        flags = torch.tensor([float(out_of_time), float(signum is not None)], device=self.device)
        flags = all_reduce_sum(flags, self.dist)
        return bool(flags[0].item()), bool(flags[1].item())


__all__ = ["Trainer"]
