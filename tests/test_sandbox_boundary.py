"""The sandbox's boundary where CI runs: `.ci/run` installs bubblewrap (`make sandbox`) before
`make test`, so the bubblewrap half of the sandbox tests (tests/test_sandbox.py,
tests/test_sandbox_forgery.py, tests/test_behaviour.py) runs on every landing instead of skipping.
Outside CI (a developer's machine without bubblewrap) this test skips; in CI it fails if the
boundary is missing, so a lost install step cannot turn those tests into silent skips."""

from __future__ import annotations

import os
import shutil

import pytest

from lmforge.sandbox import isolation, isolation_line


@pytest.mark.skipif(os.environ.get("CI", "").lower() not in ("1", "true"), reason="CI installs bubblewrap (.ci/run)")
def test_ci_runs_generated_code_inside_bubblewrap():
    assert shutil.which("bwrap"), "bwrap is not installed: .ci/run must run `make sandbox` before `make test`"
    assert isolation() == "bubblewrap", isolation_line()
    assert isolation_line().startswith("sandbox: generated code runs in bubblewrap")


def test_the_start_up_line_names_the_install_where_bubblewrap_is_missing(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    from lmforge.sandbox import isolate

    isolate.bwrap_probe.cache_clear()
    try:
        line = isolation_line()
    finally:
        isolate.bwrap_probe.cache_clear()
    assert "a plain process (bwrap is not installed)" in line and "`make sandbox`" in line
