"""`lmforge prepare --executor ray` on a real Ray cluster started on this machine (`ray.init`,
2 workers): the data folder is the local executor's and one process's, to the byte. Skipped where
Ray is not installed (`make test-ray` installs it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_prepare_parallel import folder_digest  # noqa: E402

from lmforge.data.prepare import TASKS_SUFFIX, prepare

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_a_local_ray_cluster_writes_the_one_process_folder(tiny_run, tiny_corpus, tmp_path):
    cfg, tok = tiny_run
    cfg.save(tmp_path / "cfg.toml")
    out = tmp_path / "ray"
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    res = subprocess.run([sys.executable, "-m", "lmforge", "prepare", "--config", str(tmp_path / "cfg.toml"),
                          "--executor", "ray", "--set", f"data.source={tiny_corpus}", "--set", "data.executor.tasks=2",
                          "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (tmp_path / f"ray{TASKS_SUFFIX}").exists()
    for name, workers in (("local", 2), ("one", 1)):
        prepare(str(tiny_corpus), tok, tmp_path / name, val_fraction=cfg.data.val_fraction, progress=False,
                seq_len=cfg.data.seq_len, extra_files={"config.toml": "x"}, workers=workers)
    digests = {name: folder_digest(tmp_path / name) for name in ("ray", "local", "one")}
    for d in digests.values():
        d.pop("config.toml")
    assert digests["ray"] == digests["one"] and digests["local"] == digests["one"]
