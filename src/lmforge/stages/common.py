"""What the stages share: the log, the training-session preamble and tail that every training
stage (pretrain, sft, dpo, rl) uses, a derived setting's check (`derived`), the start-up report,
the data inputs' fingerprints, and the dry run."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lmforge.config import AUTO_MICRO_BATCH, CONFIG_FILE, Config
from lmforge.errors import ConfigError, LmforgeError, require_package
from lmforge.fileio import (OutputError, copy_file, loads_json, make_folder, open_run_dir, output_lock, path_from_text,
                            path_text, shown_path, write_text)
from lmforge.model import Transformer
from lmforge.model.memory import available_memory, check_fits_in_memory
from lmforge.model.attention import resolve_backend
from lmforge.model.io import CONTRACT_FILES, latest_checkpoint, list_checkpoints, read_checkpoint_meta
from lmforge.runtime import Runtime, seed_everything, training_runtime
from lmforge.tokenizer import Tokenizer
from lmforge.train import budget as time_budget
from lmforge.train.distributed import DistInfo, all_reduce_min, all_reduce_sum, barrier, init_distributed, shutdown
from lmforge.data.mixture import MIXTURE_FILE, mixture_lines
from lmforge.train.objective import TokenObjective
from lmforge.train.plan import PLAN_FILE, auto_micro_batch, make_plan, mixture_plan, plan_lines
from lmforge.train.trainer import Trainer


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
    #: the command's start on the budget's clock (`lmforge.train.budget`): train.time_budget_s counts from here
    started: float = 0.0

    def place(self, model: Transformer) -> Transformer:
        """`model` with the session's attention backend, on its device, in training mode
        (resolved again for the model's own head_dim: a model read from a checkpoint or a
        Hugging Face folder may have other shapes than the config's).

        Raises:
            ConfigError: see `resolve_backend`.
        """
        self.backend = resolve_backend(self.cfg.model.attention, self.info.device, training=True,
                                       head_dim=model.config.resolved_head_dim(),
                                       softcap=model.config.attn_softcap)
        model.set_attention(self.backend)
        return model.to(self.runtime.device).train()

    def check_run(self) -> None:
        """The run folder's checks alone (`open_run_dir` with create=False): nothing locked or
        written. A dry run without --out (Path(".")) names no folder."""
        if not (self.dry_run and self.out == Path(".")):
            open_run_dir(self.out, self.command, self.resume, list_checkpoints, create=False)

    def open_run(self) -> None:
        """Check, lock and mark the run folder (`fileio.open_run_dir`: refused unless absent,
        empty, or this command's own run, which needs `--resume` once it holds checkpoints).
        Call it after the stage's own input checks, so refused input leaves no folder behind.
        A dry run never claims a folder: `run_training` gives it `check_run` alone."""
        # Every rank checks the folder before rank 0 changes anything (a rank that checked
        # while rank 0 wrote the marker would see a half-made folder), then all agree: a
        # refusal on any rank is a refusal on every rank, never a rank left waiting.
        refusal: LmforgeError | None = None
        try:
            if self.info.is_main:  # one lock for the run: rank 0 holds it
                self.stack.enter_context(output_lock(self.out))
            open_run_dir(self.out, self.command, self.resume, list_checkpoints, create=False)
        except LmforgeError as exc:
            refusal = exc
        refused = all_reduce_sum(torch.tensor([float(refusal is not None)]), self.info).item()
        if refusal is not None:  # this rank's own words
            raise refusal
        if refused:  # another rank's refusal: this one stops too
            raise OutputError(f"--out {self.out}: another rank refused the run folder (its message is above); "
                              f"nothing was written.")
        if self.info.is_main:
            make_folder(self.out, self.command)
        barrier(self.info)


@contextlib.contextmanager
def training_session(cfg: Config, out: str | Path, command: str, resume: bool, dry_run: bool,
                     started: float | None = None) -> Iterator[TrainingSession]:
    """The preamble of every training stage (pretrain, sft, dpo, rl): validate the parallel degrees
    and start the process group, pick the attention backend and the precision (before any
    work), seed every RNG. The process group is shut down and the run folder's lock
    released on the way out. `started`: the command's start on the budget's clock
    (`lmforge.train.budget.command_start`, passed down by the CLI); default: now.

    Raises:
        ConfigError: see `init_distributed`, `resolve_backend`.
    """
    if cfg.train.tensorboard:  # an optional package: refused before any work, not at the first step
        require_package("tensorboard", "tensorboard", "train.tensorboard = true", ConfigError)
    started = time_budget.budget_clock() if started is None else started  # a call from Python: from here
    info = init_distributed(cfg)  # validates the parallel degrees against WORLD_SIZE first
    try:
        if cfg.train.micro_batch_size == AUTO_MICRO_BATCH:  # decided from this machine's memory, once
            cfg = resolve_auto_batch(cfg, Path(out), resume, info)
        # the model's vocab is not resolved yet: the tokenizer's size bounds it from above
        check_fits_in_memory(replace(cfg.model, vocab_size=cfg.model.vocab_size or cfg.tokenizer.vocab_size),
                             cfg.train.micro_batch_size * cfg.data.seq_len)
        backend = resolve_backend(cfg.model.attention, info.device, training=True,
                                  head_dim=cfg.model.resolved_head_dim(), softcap=cfg.model.attn_softcap)
        runtime = training_runtime(cfg.train.precision, info.device)
        with contextlib.ExitStack() as stack:
            seed_everything(cfg.train.seed)
            yield TrainingSession(cfg, Path(out), command, resume, dry_run, info, backend, runtime, stack, started)
    except BaseException:  # a failed rank leaves without waiting for the others
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
    if saved and rows % saved == 0:  # a resumed run keeps its own micro-batch: the same steps
        micro, why = saved, f"as in {latest / CONFIG_FILE}, the run being resumed"
    else:
        model_cfg = replace(cfg.model, vocab_size=cfg.model.vocab_size or cfg.tokenizer.vocab_size)
        micro, why = auto_micro_batch(model_cfg, cfg.data.seq_len, rows, available_memory(info.device))
        micro = all_reduce_min(micro, info)
    derived(replace(cfg, train=replace(t, micro_batch_size=micro, grad_accum_steps=rows // micro)),
            "train.grad_accum_steps", f'train.micro_batch_size = "auto" ({micro} rows fit) with train.global_batch_size '
            f"= {t.global_batch_size}", "Lower train.global_batch_size")
    if info.is_main:
        log(f'train.micro_batch_size = "auto": {micro} rows per micro-batch, train.grad_accum_steps = {rows // micro} '
            f"({why}); train.global_batch_size {t.global_batch_size} kept over {dp} rank(s)")
    return replace(cfg, train=replace(t, micro_batch_size=micro, grad_accum_steps=rows // micro))


def derived(cfg: Config, name: str, source: str, fix: str) -> Config:
    """`cfg` after lmforge derived `name` from `source`: validated as a typed config is (every
    bound, every cross-field check), before any work; the error says where the value came from.

    Raises:
        ConfigError: the typed check's words, then "derived from SOURCE", then `fix`.
    """
    try:
        return cfg.validate()
    except ConfigError as exc:
        raise ConfigError(f"{exc} ({name} is derived from {source}.) {fix}.") from None


def _budgeted(session: TrainingSession, model: Transformer, stream, objective: TokenObjective, val_batches,
              contract_dir: Path) -> tuple[Config, time_budget.StepBudget | None]:
    """The config with the step count of `train.time_budget_s` (`lmforge.train.budget`), checked as a
    typed one and said in one line, and the `StepBudget` the trainer revises it with."""
    t = session.cfg.train
    steps, budget, why = time_budget.resolve_time_budget(session, model, stream, objective, val_batches,
                                                         contract_dir, log)
    cfg = replace(session.cfg, train=replace(t, steps=steps))
    if budget is not None:  # a measured N (not a resumed run's own): bounded like a typed one
        derived(cfg, "train.steps", f"train.time_budget_s = {t.time_budget_s:g} at {why}", "Lower train.time_budget_s")
    if session.info.is_main:
        log(f"train.time_budget_s = {t.time_budget_s:g} s for the whole stage: {steps:,} steps ({why}); warm-up "
            f"{t.warmup_steps}, {t.schedule} schedule over {steps:,} steps; written to {session.out / CONFIG_FILE}")
    return cfg, budget


def copy_contract_files(src: Path, dst: Path) -> None:
    """The contract and tokenizer files of `src` into `dst`, each atomically; a file already
    identical is not rewritten (a resumed run's folder keeps its bytes and times)."""
    for name in CONTRACT_FILES:
        copy_file(src / name, dst / name)


def startup_report(model: Transformer, tok: Tokenizer, data: dict, cfg: Config, world: int,
                   runtime: Runtime, objective: TokenObjective | None = None) -> str:
    """The start-up lines of a training stage; the batch line in the words of its `objective`
    (default: the token objective of pretraining and SFT)."""
    c, t = model.config, cfg.train
    objective = objective or TokenObjective()
    per_step = objective.tokens_per_step(t.micro_batch_size, t.grad_accum_steps, world, cfg.data.seq_len)
    lines = [
        f"model: dim {c.dim}, {c.n_layers} layers, {c.n_heads} heads / {c.n_kv_heads} kv heads, "
        f"ffn {c.resolved_ffn_dim()}, {model.num_parameters():,} parameters "
        f"({model.num_parameters(non_embedding=True):,} non-embedding), attention {model.layers[0].attention.backend}",
        f"vocab: tokenizer {tok.vocab_size}, model {model.model_vocab_size} (padded to 64); special ids "
        + ", ".join(f"{k}={v}" for k, v in tok.contract.special_tokens.items()),
    ]
    for split, m in data.items():
        lines.append(f"data {split}: {m['documents']:,} documents, {m['tokens']:,} tokens, max id {m['max_id']}")
    shape = objective.batch_shape(t.micro_batch_size)
    steps = (f"the steps from train.time_budget_s = {t.time_budget_s:g} s (below)" if t.time_budget_s else
             f"{t.steps} steps = {per_step * t.steps:,} tokens")
    lines.append(f"batch: {shape} x {cfg.data.seq_len} tokens x {t.grad_accum_steps} accumulation x "
                 f"{world} ranks = {per_step:,} tokens/step; {steps}; device {runtime.label}")
    return "\n".join(lines)


#: The content hashes of a run's data inputs (data.dir, sft.data, dpo.data), recorded when it
#: starts; `--resume` refuses an input whose content changed under the same name.
INPUTS_FILE = "data_inputs.json"
#: The files of a prepared data folder that change with its documents (the .bin files are not
#: read: {split}.hashes (hashes.json before 2026-11-26) hold every document's hash, the .idx files
#: every boundary); a mixture's (mixture.json) are those of each source's folder.
DATA_DIR_FINGERPRINT = ("meta.json", "hashes.json", "train.hashes", "val.hashes", "train.idx", "val.idx")


def data_fingerprints(inputs: dict[str, Path]) -> dict[str, dict]:
    """{key: {"path", "sha256"}} for each data input (a file, or a prepared data folder by
    DATA_DIR_FINGERPRINT). Read in 1 MiB chunks: memory stays flat for any size."""
    import hashlib

    out = {}
    for key, path in inputs.items():
        path = Path(path)
        files = [path]
        if path.is_dir():
            folders = [path]
            if (path / MIXTURE_FILE).is_file():
                folders += sorted(p for p in path.iterdir() if p.is_dir())
            files = [f / n for f in folders for n in (MIXTURE_FILE, *DATA_DIR_FINGERPRINT) if (f / n).is_file()]
        h = hashlib.sha256()
        for f in files:
            h.update(os.fsencode(f.relative_to(path) if f != path else f.name) + b"\0")
            try:
                with open(f, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        h.update(chunk)
            except OSError:
                continue  # the stage's own reader has already said why it cannot be read
        out[key] = {"path": path_text(str(path)), "sha256": h.hexdigest()}
    return out


def check_same_inputs(out: Path, fingerprints: dict[str, dict]) -> None:
    """`--resume`: every data input whose recorded path is the same must have the same content.

    Raises:
        CheckpointError: naming the field, the file, both hashes and INPUTS_FILE.
    """
    from lmforge.errors import CheckpointError

    path = out / INPUTS_FILE
    if not path.is_file():
        return  # a run started before inputs were recorded: nothing to compare with
    try:
        saved = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc}). Restore it, or start a new run with another "
                              f"--out.") from None
    for key, now in fingerprints.items():
        then = saved.get(key) if isinstance(saved, dict) else None
        if not isinstance(then, dict) or then.get("path") != now["path"]:
            continue  # another path is the resume rules' to refuse
        if then.get("sha256") != now["sha256"]:
            shown = shown_path(path_from_text(now["path"]))
            raise CheckpointError(
                f"{key} = {shown!r} changed since the run started: its sha256 is now {now['sha256'][:16]}..., the "
                f"run recorded {str(then.get('sha256'))[:16]}... ({path}). Resuming would train the remaining steps "
                f"on other data than the steps before. Restore the original, or start a new run with another --out.")


def run_training(session: TrainingSession, contract_dir: Path, model: Transformer, stream, val_batches,
                 resume: bool = False, dry_run: bool = False, progress: bool = True,
                 side_files: dict[str, str] | None = None, objective: TokenObjective | None = None,
                 inputs: dict[str, Path] | None = None) -> dict:
    """The shared tail of a training stage: check the run folder, derive the settings that are
    measured (train.time_budget_s), claim the folder (`session.open_run`), build the trainer,
    resume (or start), write the side files, fit. A dry run makes every check of the run,
    `--resume` included (the checkpoint is loaded; nothing is written), then measures.
    `contract_dir` holds the contract and tokenizer files copied into the run folder and its
    checkpoints; `side_files` ({name: text}) are written into the run folder; `inputs`
    ({config key: file or data folder}) are hashed and recorded (INPUTS_FILE), and `--resume`
    refuses one that changed. `objective` (default `TokenObjective`) is what the trainer minimises.
    """
    cfg, out, info = session.cfg, session.out, session.info
    objective = objective or TokenObjective()
    session.check_run()  # refused here, a dry run and a run say the same words
    if cfg.train.eval_tasks:  # a bad task file is refused before the run folder is claimed, named by its key
        from lmforge.evals.resolve import check_task_files

        check_task_files(cfg.train.eval_tasks, Tokenizer.load(Path(contract_dir)), model.config.max_seq_len)
    fingerprints = data_fingerprints(inputs or {})
    if resume:  # the data the run started on, or a refusal
        check_same_inputs(out, fingerprints)
    if dry_run:  # every check above, then a measured plan; nothing written
        if resume:  # the resume rules, the checkpoint's files and weights, as the run would load them
            probe = Trainer(cfg, out, Path(contract_dir), model, stream, None, info, False, log,
                            runtime=session.runtime, objective=objective)
            if not probe.resume(session.command, dry_run=True):
                log(f"--resume: no checkpoint in {out} yet; a run would start from step 0")
            del probe
        return dry_run_step(model, stream, session.runtime, objective, cfg, info)
    budget = None
    if cfg.train.time_budget_s:  # measured and checked before the folder is claimed
        cfg, budget = _budgeted(session, model, stream, objective, val_batches, Path(contract_dir))
        session.cfg = cfg
    session.open_run()
    trainer = Trainer(cfg, out, Path(contract_dir), model, stream, val_batches, info, progress, log,
                      runtime=session.runtime, objective=objective, budget=budget)

    def on_steps(revised: Config) -> None:  # the budget's revision: the run folder says the count it trains
        session.cfg = revised
        plan["steps"] = revised.train.steps
        mixture_plan(plan, stream, revised, info.world_size)
        write_text(out / CONFIG_FILE, revised.to_toml())
        write_text(out / PLAN_FILE, json.dumps(plan, indent=2) + "\n")

    trainer.on_steps = on_steps
    # before any write: a refused --resume leaves the run folder as it was
    if resume and not trainer.resume(session.command):
        log(f"--resume: no checkpoint in {out} yet; starting from step 0")
    plan = make_plan(trainer)
    mixture_plan(plan, stream, cfg, info.world_size)
    if info.is_main:  # rank 0 alone says the plan and writes the run folder's files
        _start_run_folder(out, Path(contract_dir), cfg, plan, side_files, fingerprints)
    return trainer.fit()


def _start_run_folder(out: Path, contract_dir: Path, cfg: Config, plan: dict, side_files: dict[str, str] | None,
                      fingerprints: dict[str, dict]) -> None:
    """Say the plan; write config.toml, plan.json, the side files, INPUTS_FILE and the contract files."""
    log(plan_lines(plan))
    if "mixture" in plan:
        log(mixture_lines(plan["mixture"], cfg.data.seq_len))
    # every text made first: a side file that cannot be written leaves no half-made run folder
    texts = {CONFIG_FILE: cfg.to_toml(), PLAN_FILE: json.dumps(plan, indent=2) + "\n", **(side_files or {})}
    if fingerprints:  # a stage with data inputs records them for --resume
        texts[INPUTS_FILE] = json.dumps(fingerprints, indent=2) + "\n"
    copy_contract_files(contract_dir, out)
    for name, text in texts.items():
        write_text(out / name, text, skip_same=True)


def dry_run_step(model: Transformer, stream, runtime: Runtime, objective: TokenObjective | None = None,
                 cfg: Config | None = None, info: DistInfo | None = None,
                 steps: int = 3) -> dict:
    """The dry run: one micro-batch forward and backward (its loss reported), then, with `cfg`,
    the plan with measured figures (`lmforge.train.plan`: 1 + `steps` real optimizer steps on
    this model, which is thrown away after). Nothing is written."""
    objective = objective or TokenObjective()
    model.to(runtime.device).train()
    b = objective.next_batch(stream, model).to(runtime.device)  # a rollout, for an objective that makes its own
    with runtime.autocast():
        total, _ = objective.loss(model, b)
    n = max(1, objective.count(b))
    (total / n).backward()
    loss = float(total.detach()) / n
    model.zero_grad(set_to_none=True)
    out = {"loss": loss, "dry_run": True}
    if cfg is not None:
        # the measuring trainer has no contract folder: train.eval_tasks were checked by run_training
        # (check_task_files); built here they would load a tokenizer from "." and blame it
        measured = replace(cfg, train=replace(cfg.train, eval_tasks=[]))
        trainer = Trainer(measured, Path("."), Path("."), model, stream, None, info or DistInfo(), False, log,
                          runtime=runtime, objective=objective)
        out["plan"] = make_plan(trainer, measure=True, steps=steps)
        if (info or DistInfo()).is_main:
            log(plan_lines(out["plan"]))
            if cfg.train.time_budget_s:
                n = time_budget.budget_steps(cfg.train.time_budget_s, out["plan"]["step_seconds"])
                log(f"train.time_budget_s = {cfg.train.time_budget_s:g}: a run would take about {n:,} "
                    f"steps at this step time (measured again at the start of the run)")
    log(f"dry run: one micro-batch forward and backward, loss {loss:.4f} nats/{objective.unit}; all checks passed")
    return out


__all__ = ["log", "TrainingSession", "training_session", "run_training", "dry_run_step", "startup_report",
           "copy_contract_files"]
