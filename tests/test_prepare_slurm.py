"""`lmforge prepare --executor slurm` without a cluster: `sbatch` and `scontrol` are stand-ins on
PATH that record what they are given. The test checks what would run, with which resources, in
which order (the job scripts datatrove writes, their arrays and `afterok` chain), then runs each
job's command as a Slurm node would (`SLURM_ARRAY_TASK_ID`, datatrove's `launch_pickled_pipeline`)
and compares the data folder the last job writes with one process's, to the byte."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from test_prepare_parallel import folder_digest  # noqa: E402

from lmforge.data.prepare import TASKS_MARKER, TASKS_SUFFIX, prepare

SBATCH = """#!/bin/sh
# a stand-in for Slurm's sbatch: records its arguments and script, answers a new job id
n=$(cat "{log}/counter" 2>/dev/null || echo 100)
n=$((n + 1))
echo $n > "{log}/counter"
for last; do :; done
echo "$n $*" >> "{log}/sbatch.log"
cp "$last" "{log}/script-$n.sh"
echo "Submitted batch job $n"
"""
SCONTROL = """#!/bin/sh
echo localhost
"""


def stand_in(folder: Path, name: str, text: str) -> None:
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.slow
def test_slurm_jobs_are_the_stages_chained_and_write_the_one_process_folder(tiny_run, tiny_corpus, tmp_path):
    cfg, tok = tiny_run
    bin_dir, log = tmp_path / "bin", tmp_path / "slurm"
    bin_dir.mkdir()
    log.mkdir()
    stand_in(bin_dir, "sbatch", SBATCH.format(log=log))
    stand_in(bin_dir, "scontrol", SCONTROL)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    cfg.save(tmp_path / "cfg.toml")
    out = tmp_path / "data"
    res = subprocess.run([sys.executable, "-m", "lmforge", "prepare", "--config", str(tmp_path / "cfg.toml"),
                          "--executor", "slurm", "--set", f"data.source={tiny_corpus}", "--set",
                          "data.executor.partition=debug", "--set", "data.executor.tasks=3", "--set",
                          "data.executor.cpus_per_task=4", "--set", "data.executor.time=\"00:30:00\"", "--out",
                          str(out), "--no-progress"], capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "3 tasks submitted to Slurm: hash job 101, plan job 102, tokenize job 103, finish job 104" in res.stderr
    assert not out.exists()  # written by the last job, not by the submission
    calls = (log / "sbatch.log").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["101", "102", "103", "104"]
    assert "--dependency" not in calls[0]
    for job, after in (("102", "101"), ("103", "102"), ("104", "103")):
        assert f"--dependency=afterok:{after}" in next(c for c in calls if c.startswith(job))
    work = tmp_path / f"data{TASKS_SUFFIX}"
    scripts = {stage: (work / "logs" / stage / "launch_script.slurm").read_text() for stage in ("hash", "plan", "tokenize")}
    scripts["finish"] = (work / "finish.slurm").read_text()
    assert (log / "script-104.sh").read_text() == scripts["finish"]  # what was submitted
    for stage, script in scripts.items():
        assert "#SBATCH --partition=debug" in script and "#SBATCH --cpus-per-task=4" in script
        assert "#SBATCH --time=00:30:00" in script and "#SBATCH --mem-per-cpu=2G" in script
        assert f"#SBATCH --job-name=lmforge-prepare-{stage}" in script and "--qos" not in script
    for stage in ("hash", "plan", "tokenize"):
        assert re.search(r"srun .*launch_pickled_pipeline .*logs/" + stage + "/executor.pik", scripts[stage])
    assert "#SBATCH --array=0-2" in scripts["hash"] and "#SBATCH --array=0-2" in scripts["tokenize"]
    assert "#SBATCH --array=0-0" in scripts["plan"] and "--array" not in scripts["finish"]
    assert f"-m lmforge prepare --config {work / 'config.toml'} --out {out} --no-progress" in scripts["finish"]
    assert f"#SBATCH --output={tmp_path / 'data.prepare-finish.log'}" in scripts["finish"]
    # the nodes' side: each array task runs the pickled pipeline with its rank, then the last job its script
    for stage, ranks in (("hash", 3), ("plan", 1), ("tokenize", 3)):
        for rank in range(ranks):
            node = {**env, "SLURM_ARRAY_TASK_ID": str(rank), "RUN_OFFSET": "0", "SLURM_NODELIST": "node1",
                    "SLURM_JOB_ID": "1"}
            run = subprocess.run(["launch_pickled_pipeline", str(work / "logs" / stage / "executor.pik")],
                                 capture_output=True, text=True, timeout=240, env=node)
            assert run.returncode == 0, (stage, rank, run.stderr[-3000:])
    assert not out.exists()
    run = subprocess.run(["bash", str(log / "script-104.sh")], capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert out.is_dir() and not work.exists()
    prepare(str(tiny_corpus), tok, tmp_path / "one", val_fraction=cfg.data.val_fraction, progress=False,
            seq_len=cfg.data.seq_len, extra_files={"config.toml": "x"})
    mine, one = folder_digest(out), folder_digest(tmp_path / "one")
    mine.pop("config.toml"), one.pop("config.toml")
    assert mine == one


@pytest.mark.parametrize("sets, expected", [
    (["data.executor.tasks=1"], r"data\.executor\.tasks = 1 \(or data\.workers\): one task needs no cluster"),
    ([], r"data\.executor\.partition is not set"),
    (["data.source=stdlib", "data.sources=[{source=\"stdlib\"}]"],
     r"data\.sources: a mixture of 1 sources; `lmforge prepare --executor slurm`"),
])
def test_what_slurm_cannot_run_is_refused_before_anything_is_submitted(tiny_run, tiny_corpus, tmp_path, sets, expected):
    cfg, _ = tiny_run
    cfg.save(tmp_path / "cfg.toml")
    partition = [] if not sets else ["--set", "data.executor.partition=debug"]
    args = [a for s in sets for a in ("--set", s)]
    res = subprocess.run([sys.executable, "-m", "lmforge", "prepare", "--config", str(tmp_path / "cfg.toml"),
                          "--executor", "slurm", "--set", f"data.source={tiny_corpus}", *partition, *args, "--out",
                          str(tmp_path / "data")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert res.returncode == 2, res.stderr[-2000:]
    assert re.search(expected, res.stderr), res.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.toml"]  # no tasks' folder, no data folder


SQUEUE = """#!/bin/sh
# a stand-in for Slurm's squeue: records its arguments, prints the queue the test wrote
echo "$*" >> "{log}/squeue.log"
if [ -s "{log}/invalid" ]; then echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; fi
cat "{log}/queue"
"""


def test_a_second_submission_is_refused_while_the_first_jobs_are_queued(tiny_run, tiny_corpus, tmp_path):
    """Submitting again while the jobs of the first submission still run would run their tasks twice
    at once: refused, naming the jobs and how to cancel them, nothing submitted or touched; once
    squeue lists none of them (or has forgotten them), the submission goes ahead."""
    sys.path.insert(0, str(Path(__file__).parent / "robustness"))
    from test_bad_inputs import tree_hash

    from lmforge.data.cluster import JOBS_FILE, still_queued

    cfg, _ = tiny_run
    bin_dir, log = tmp_path / "bin", tmp_path / "slurm"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in (("sbatch", SBATCH), ("scontrol", SCONTROL), ("squeue", SQUEUE)):
        stand_in(bin_dir, name, text.format(log=log))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    work = tmp_path / f"data{TASKS_SUFFIX}"
    work.mkdir()
    (work / TASKS_MARKER).write_text("{}\n")  # an earlier submission's tasks' folder (of other settings)
    (work / JOBS_FILE).write_text('{"jobs": {"hash": "201", "plan": "202", "tokenize": "203", "finish": "204"}}\n')
    (log / "queue").write_text("202 202\n203 203_[0-2]\n204 204\n")
    cfg.save(tmp_path / "cfg.toml")
    before = tree_hash(work)
    command = [sys.executable, "-m", "lmforge", "prepare", "--config", str(tmp_path / "cfg.toml"), "--executor", "slurm",
               "--set", f"data.source={tiny_corpus}", "--set", "data.executor.partition=debug", "--set",
               "data.executor.tasks=2", "--out", str(tmp_path / "data"), "--no-progress"]
    res = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "jobs 202 203 204 of the prepare submitted before" in res.stderr and "scancel 202 203 204" in res.stderr
    assert (log / "squeue.log").read_text().split() == ["-h", "-o", "%F", "%i", "-j", "201,202,203,204"]
    assert tree_hash(work) == before and not (log / "sbatch.log").exists() and not (tmp_path / "data").exists()
    (log / "invalid").write_text("1")  # squeue forgets ended jobs: "Invalid job id"
    os.environ["PATH"], old = env["PATH"], os.environ["PATH"]
    try:
        assert still_queued(work) == []
    finally:
        os.environ["PATH"] = old
    (log / "invalid").write_text("")
    (log / "queue").write_text("")
    res = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "2 tasks submitted to Slurm: hash job 101" in res.stderr
    assert '"hash": "101"' in (work / JOBS_FILE).read_text()
