"""`lmforge prepare --executor slurm`: the stages of a parallel prepare (`lmforge.data.parallel`) as
Slurm job arrays, submitted by datatrove's `SlurmPipelineExecutor` and chained `afterok`: "hash"
(an array of `tasks`), with data.dedup = "minhash" "buckets" (an array of 14), "plan" (one job), "tokenize" (an array), then "finish" (one job, its log beside
data.dir), which runs `lmforge prepare` itself with the config as submitted: it finds every task complete
(datatrove's completion markers, in the tasks' folder beside data.dir) and joins their shards into
data.dir as on one machine. The folder is the same, to the byte, as one process writes.

The submitting command returns once the jobs are queued (their ids and scripts printed); the
tasks' folder and data.dir must be on a file system every node sees. A job that fails leaves the
later ones pending (`afterok`); the same command again submits only the tasks not complete, and is
refused while a job it submitted before is still queued or running (`squeue`: the tasks' folder
records the job ids), so no task runs twice at once.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from datatrove.executor.slurm import SlurmPipelineExecutor, launch_slurm_job

from lmforge.data.parallel import make_job, task_count
from lmforge.data.shard_writer import TASKS_SUFFIX
from lmforge.data.quality import Quality
from lmforge.data.stream_tasks import TASKS
from lmforge.errors import ConfigError, LmforgeError
from lmforge.fileio import OutputError, shown_path

#: The tasks' folder's record of the jobs submitted last (their ids), for `still_queued`.
JOBS_FILE = "slurm-jobs.json"

#: data.executor's defaults (lmforge.config.sources.EXECUTOR_OPTIONS); `tasks`: data.workers when
#: set, else DEFAULT_TASKS.
DEFAULTS = {"time": "04:00:00", "cpus_per_task": 2, "mem_per_cpu_gb": 2, "qos": "", "venv_path": ""}
DEFAULT_TASKS = 64


class LmforgeSlurmExecutor(SlurmPipelineExecutor):
    """datatrove's SlurmPipelineExecutor without its stats-merging job (lmforge's report is in data.dir)."""

    def launch_merge_stats(self):
        pass


def submit_slurm(cfg, out: Path, tokenizer) -> dict:
    """Submit the prepare of `cfg.data.source` into `out` as Slurm jobs (module docstring).
    Returns {"tasks", "jobs": {stage: job id}, "scripts": {stage: launch script path}, "work"}.

    Raises:
        ConfigError: data.executor.partition not set.
        DataError / OutputError: as `lmforge prepare` (the source listed, the tasks' folder).
    """
    from datatrove.utils.logging import logger

    d = cfg.data
    opts = {**DEFAULTS, **d.executor}
    if d.sources:
        raise ConfigError(f"data.sources: a mixture of {len(d.sources)} sources; `lmforge prepare --executor slurm` "
                          f"prepares one data.source. Prepare each source into its own folder with it, or the mixture "
                          f"on one machine (without --executor).")
    if not opts.get("partition"):
        raise ConfigError("data.executor.partition is not set: `lmforge prepare --executor slurm` needs the Slurm "
                          "partition to run on (--set data.executor.partition=NAME, or [data.executor] partition = "
                          "\"NAME\" in the config).")
    tasks = opts.get("tasks") or d.workers or max(2, task_count(d.source, d.include_tests, DEFAULT_TASKS))
    if tasks < 2:
        raise ConfigError(f"data.executor.tasks = {tasks} (or data.workers): one task needs no cluster. Run `lmforge "
                          f"prepare` without --executor, or ask for 2 tasks or more.")
    work = out.parent / f"{out.name}{TASKS_SUFFIX}"
    refuse_if_queued(work, out)
    quality = Quality(tuple(d.filters), d.dedup)
    quality.require()
    job, _ = make_job(work, d.source, tokenizer, d.val_fraction, d.include_tests, d.on_bad_utf8, d.text_field, tasks,
                      int(opts["cpus_per_task"]), quality)
    import copy

    final = copy.deepcopy(cfg)  # the finish job's config: these tasks, this folder (set as values, never parsed)
    final.data.workers, final.data.dir = tasks, str(out)
    config_path = work / "config.toml"
    final.save(config_path)
    logger.remove()  # datatrove's lines: in the tasks' folder; lmforge prints the jobs itself
    common = {"time": str(opts["time"]), "partition": opts["partition"], "cpus_per_task": int(opts["cpus_per_task"]),
              "mem_per_cpu_gb": int(opts["mem_per_cpu_gb"]), "qos": opts["qos"] or None,
              "venv_path": opts["venv_path"] or None, "skip_completed": True}
    previous, executors = None, {}
    for stage in job.stages:
        previous = executors[stage] = LmforgeSlurmExecutor(
            pipeline=[TASKS[stage](job)], tasks=job.stage_tasks(stage), job_name=f"lmforge-prepare-{stage}", logging_dir=str(work / "logs" / stage),
            depends=previous, **common)
    previous.run()  # submits its dependencies first, each afterok the one before
    jobs = {stage: ex.job_id for stage, ex in executors.items()}
    # the last job: `lmforge prepare` itself (every task found complete, the folder joined), its log beside data.dir
    log = out.parent / f"{out.name}.prepare-finish.log"
    args = {**previous.get_sbatch_args(1), "job-name": "lmforge-prepare-finish", "output": str(log), "error": str(log)}
    args.pop("array")
    script = previous.get_launch_file_contents(args, shlex.join(
        [sys.executable, "-m", "lmforge", "prepare", "--config", str(config_path), "--out", str(out), "--no-progress"]))
    (work / "finish.slurm").write_text(script)
    after = [f"--dependency=afterok:{jobs['tokenize']}"] if jobs["tokenize"] not in (None, -1) else []
    jobs["finish"] = launch_slurm_job(script, previous.job_id_retriever, *after)
    (work / JOBS_FILE).write_text(json.dumps({"jobs": {k: str(v) for k, v in jobs.items()}}) + "\n")
    return {"tasks": tasks, "work": str(work), "jobs": jobs, "log": str(log),
            "scripts": {**{stage: str(work / "logs" / stage / "launch_script.slurm") for stage in executors},
                        "finish": str(work / "finish.slurm")}}


def refuse_if_queued(work: Path, out: Path) -> None:
    """OutputError when a job of the submission recorded in `work` is still queued or running: a
    second submission would run its tasks again at the same time."""
    queued = still_queued(work)
    if queued:
        ids = " ".join(queued)
        raise OutputError(f"jobs {ids} of the prepare submitted before into {shown_path(out)} are still queued or "
                          f"running (squeue): a second submission would run their tasks again at the same time. Wait "
                          f"for them to end, or cancel them (scancel {ids}) and submit again.")


def still_queued(work: Path) -> list[str]:
    """The job ids recorded in `work`'s JOBS_FILE that `squeue` still lists (pending or running),
    in order; [] when none was recorded or none is listed.

    Raises:
        LmforgeError: jobs were recorded and `squeue` cannot be run or fails.
    """
    import subprocess

    try:
        ids = [str(i) for i in json.loads((work / JOBS_FILE).read_text())["jobs"].values() if str(i) not in ("", "-1")]
    except (OSError, ValueError, KeyError, AttributeError):
        return []
    try:
        res = subprocess.run(["squeue", "-h", "-o", "%F %i", "-j", ",".join(ids)], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LmforgeError(f"{shown_path(work / JOBS_FILE)} records Slurm jobs {', '.join(ids)}, and squeue cannot be "
                           f"run to see whether they still run ({exc}). Run it where Slurm's commands are.") from None
    if res.returncode != 0 and "invalid job id" not in res.stderr.lower():  # ended jobs may be forgotten by squeue
        raise LmforgeError(f"squeue -j {','.join(ids)} failed (exit {res.returncode}: {res.stderr.strip()[:300]}).")
    listed = {word.split("_")[0] for line in res.stdout.splitlines() for word in line.split()}
    return [i for i in ids if i in listed]


__all__ = ["DEFAULTS", "DEFAULT_TASKS", "JOBS_FILE", "LmforgeSlurmExecutor", "refuse_if_queued", "still_queued", "submit_slurm"]
