"""Issue 53: a compiled run stopped by train.time_limit_s after step 1 and resumed in a new process
equals the straight run, bit for bit, with the inductor cache warm or cold.

The path a user takes, each command a new process running the CLI: `pretrain` straight to step 6;
`pretrain` with train.time_limit_s that stops it after step 1 (its step-1 checkpoint written by the
time-limit path); `pretrain --resume` to step 6. Under bf16 autocast (what train.precision = "auto"
takes on a CPU with bf16 units) inductor lowered the embedding's backward to a loop that OpenMP
threads `atomic_add` into the gradient in a racy order, so with more than one thread the runs
differed in the last bits of the embedding at step 3 and by 1e-4 at step 6. The trainer now runs a
compiled CPU step with deterministic kernels (`lmforge.runtime.deterministic_kernels`).
tests/test_resume.py's compiled resume test ran one thread (OMP_NUM_THREADS=1), where the race cannot
happen, and passed; this one runs two, and is the suite's one compiled resume test in a new process
(weights, optimizer state and data position compared, as tests/test_resume.py compares eager runs).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.model import io as mio
from test_resume import assert_same_state

STEPS = 6


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / mio.MODEL_FILE)), load_file(str(b / mio.MODEL_FILE))
    assert wa.keys() == wb.keys()
    differ = {k: float((wa[k].double() - wb[k].double()).abs().max()) for k in wa if not torch.equal(wa[k], wb[k])}
    assert not differ, f"{a.name}: weights differ from the straight run's (max |diff| per tensor): {differ}"


@pytest.mark.slow
def test_a_compiled_run_stopped_at_step_1_and_resumed_equals_the_straight_run(tiny_run, tmp_path):
    from lmforge.runtime import compiler_available

    if not compiler_available(torch.device("cpu")):
        pytest.skip("no C++ compiler: train.compile trains eagerly here")
    cfg, _ = tiny_run
    cfg = replace(cfg, train=replace(cfg.train, steps=STEPS, compile=True, precision="bf16", time_budget_s=0,
                                     eval_every=1000, checkpoint_every=3, keep_last=0))
    cfg.save(tmp_path / "cfg.toml")

    def pretrain(out: Path, *extra: str, cache: str) -> str:
        # two threads: the race needs more than one (torch takes one per core by default)
        env = dict(os.environ, OMP_NUM_THREADS="2", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / cache))
        res = subprocess.run([sys.executable, "-m", "lmforge", "pretrain", "--config", str(tmp_path / "cfg.toml"),
                              "--out", str(out), "--no-progress", *extra], capture_output=True, text=True, env=env,
                             timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stderr

    straight = tmp_path / "straight"
    pretrain(straight, cache="inductor")  # a cold cache: this process compiles and fills it
    a = _metrics(straight)
    assert a[-1]["loss"] < a[0]["loss"]  # it trained: the comparison is not vacuous

    warm = tmp_path / "warm"  # the user's path: the cache is warm for both commands
    err = pretrain(warm, "--set", "train.time_limit_s=0.001", cache="inductor")
    assert "stopped at step 1 of 6 (time limit reached)" in err, err[-2000:]
    assert [p.name for p in mio.list_checkpoints(warm)] == ["step_000001"]
    cold = tmp_path / "cold"  # the same stopped run continued on a machine that compiles afresh
    shutil.copytree(warm, cold)

    for split, cache in ((warm, "inductor"), (cold, "inductor-cold")):
        assert "resumed from" in pretrain(split, "--resume", cache=cache)
        b = _metrics(split)
        assert [m["step"] for m in b] == list(range(1, STEPS + 1))
        for key in ("loss", "grad_norm", "lr"):
            assert [m[key] for m in b] == [m[key] for m in a], (split.name, key)
        _assert_same_weights(straight / "step_000003", split / "step_000003")
        assert_same_state(straight / f"step_{STEPS:06d}", split / f"step_{STEPS:06d}")  # weights, optimizer, data


def test_deterministic_kernels_is_scoped():
    """The mode holds inside the block only: the process's own settings come back, an error or not."""
    import torch.utils.deterministic

    from lmforge.runtime import deterministic_kernels

    before = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    with pytest.raises(KeyError):
        with deterministic_kernels():
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.is_deterministic_algorithms_warn_only_enabled()
            assert not torch.utils.deterministic.fill_uninitialized_memory
            raise KeyError
    assert (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory) == before
    with deterministic_kernels(False):
        assert torch.are_deterministic_algorithms_enabled() == before[0]
