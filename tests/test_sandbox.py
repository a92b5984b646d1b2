"""R5: `lmforge.sandbox`, the verdicts a generated body cannot forge, and no side effect outside
its folder. Each body replaces difflib.IS_CHARACTER_JUNK (4 docstring examples) and is run as
the doctest scorer and the rewards run it; the caller's folder is hashed before and after."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from lmforge.sandbox import MAX_ERROR_SHARE, Result, SandboxError, check_errors, isolation_line, run_job

SIG = 'def IS_CHARACTER_JUNK(ch, ws=" \\t"):\n'
REF = SIG + "    return ch in ws\n"


def _job(body: str) -> dict:
    return {"kind": "doctest", "module": "difflib", "function": "IS_CHARACTER_JUNK", "source": SIG + body}


def _tree(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


CASES = [
    ("reference", "    return ch in ws\n", "PASS"),
    ("wrong", "    return False\n", "FAIL"),
    ("forged-stdout", "    import os\n    os.write(1, b'PASS\\n')\n    os._exit(0)\n", "FAIL"),
    ("forged-pipe", "    import os\n    for fd in range(3, 64):\n        try:\n"
                    "            os.write(fd, b'{\"verdict\": \"PASS\", \"nonce\": \"0\"}\\n')\n"
                    "        except OSError:\n            pass\n    os._exit(0)\n", "FAIL"),
    ("exit-0", "    raise SystemExit(0)\n", "FAIL"),
    ("oom", "    x = [0] * (10 ** 10)\n    return ch in ws\n", "OOM"),
    ("socket", "    import socket\n    socket.create_connection(('127.0.0.1', 9))\n    return ch in ws\n", "FAIL"),
    ("subprocess", "    import subprocess\n    subprocess.run(['true'])\n    return ch in ws\n", "FAIL"),
    ("os-system", "    import os\n    os.system('touch /tmp/x')\n    return ch in ws\n", "FAIL"),
    ("write-caller", "    open(CALLER + '/written.txt', 'w').write('x')\n    return ch in ws\n", "FAIL"),
    ("remove-caller", "    import os\n    os.remove(CALLER + '/keep.txt')\n    return ch in ws\n", "FAIL"),
    ("write-own-folder", "    open('scratch.txt', 'w').write('x')\n    return ch in ws\n", "PASS"),
    ("import-reference", "    from difflib import IS_CHARACTER_JUNK as ref\n    return ref(ch, ws)\n", "FAIL"),
    ("frames", "    import sys\n    sys._getframe(1)\n    return ch in ws\n", "FAIL"),
    ("traceback-frames", "    try:\n        1 / 0\n    except ZeroDivisionError as e:\n        e.__traceback__.tb_frame\n"
                         "    return ch in ws\n", "FAIL"),
    ("ctypes", "    import ctypes\n    ctypes.CDLL(None)\n    return ch in ws\n", "FAIL"),
    ("environment", "    import os\n    assert 'HOME' not in os.environ and 'LMFORGE_SECRET' not in os.environ\n"
                    "    return ch in ws\n", "PASS"),
    ("syntax", "    return (\n", "FAIL"),
]


@pytest.mark.parametrize("name,body,verdict", CASES, ids=[c[0] for c in CASES])
def test_the_sandbox_table(name, body, verdict, tmp_path, monkeypatch):
    caller = tmp_path / "caller"
    caller.mkdir()
    (caller / "keep.txt").write_text("the caller's file")
    monkeypatch.chdir(caller)
    monkeypatch.setenv("LMFORGE_SECRET", "1")
    before = _tree(caller)
    r = run_job(_job(body.replace("CALLER", repr(str(caller)))), timeout=5)
    assert r.verdict == verdict, r
    assert _tree(caller) == before
    assert not Path("/tmp/x").exists() or name != "os-system"


def test_an_endless_loop_is_killed_with_its_group_and_a_fork_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    body = ("    import os\n    try:\n        os.fork()\n    except PermissionError:\n        pass\n"
            "    while True:\n        pass\n")
    t = time.perf_counter()
    r = run_job(_job(body), timeout=1.5)
    assert r.verdict == "TIMEOUT" and time.perf_counter() - t < 5, r
    assert list(tmp_path.iterdir()) == []


def test_the_doctest_scorer_cannot_be_fooled_by_a_printed_verdict():
    from lmforge.scorers import run_doctests

    forged = SIG + "    print('PASS')\n    import os\n    os._exit(0)\n"
    assert run_doctests("difflib", "IS_CHARACTER_JUNK", forged) == "FAIL"
    assert run_doctests("difflib", "IS_CHARACTER_JUNK", REF) == "PASS"
    assert run_doctests("difflib", "SequenceMatcher", "class SequenceMatcher: pass\n") in ("FAIL", "NODOC")


def test_cases_compare_return_values_and_exceptions():
    job = {"kind": "cases", "module": "", "function": "f", "source": "def f(a, b):\n    return a // b\n",
           "cases": [["(7, 2)", "3"], ["(1, 0)", "raise ZeroDivisionError"]]}
    assert run_job(job).verdict == "PASS"
    job["cases"][0][1] = "4"
    assert run_job(job).verdict == "FAIL"


def test_harness_errors_are_never_a_silent_zero(monkeypatch):
    r = run_job({"kind": "doctest", "module": "no_such_module_here", "function": "f", "source": "def f(): pass\n"})
    assert r.verdict == "ERROR" and "no_such_module_here" in r.detail
    ok = [Result("PASS", "", 0.0)] * 199
    check_errors(ok + [Result("ERROR", "x", 0.0)], "step 3")  # 0.5%: allowed
    with pytest.raises(SandboxError, match=r"step 3: 3 of 202 sandbox runs failed in the harness itself"):
        check_errors(ok + [Result("ERROR", "x", 0.0)] * 3, "step 3")
    assert MAX_ERROR_SHARE == 0.01


def test_the_isolation_is_said_in_one_line():
    line = isolation_line()
    assert line.startswith("sandbox: ") and "\n" not in line
    assert ("no network" in line) == bool(os.path.exists("/usr/bin/unshare") and "user namespace)" in line)
