"""R5: `lmforge.sandbox`, the verdicts a generated body cannot forge, and no side effect outside
its folder. Each body replaces difflib.IS_CHARACTER_JUNK (4 docstring examples) and is run as
the doctest scorer and the rewards run it, with and without bubblewrap; the caller's folder is
hashed before and after. The API refuses malformed jobs and limits before any process starts,
leaving nothing behind. (The forging bodies of issue 45: tests/test_sandbox_forgery.py.)"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from lmforge.sandbox import (ISOLATION_ENV, MAX_ERROR_SHARE, MIN_MEMORY_BYTES, Pool, Result, SandboxError,
                             check_errors, isolation, isolation_line, run_job)

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
    ("text-after", "    return ch in ws\nprint('module level')\n", "FAIL"),
    ("audit-hook", "    import sys\n    seen = []\n    sys.addaudithook(lambda e, a: seen.append(e))\n"  # not added
                   "    open('scratch.txt', 'w').close()\n    return (ch in ws) if not seen else None\n", "PASS"),
    ("write-tmp", "    open('/tmp/lmforge-sandbox-test.txt', 'w').write('x')\n    return ch in ws\n", "FAIL"),
]


@pytest.fixture(params=["process", "bubblewrap"])
def isolated(request, monkeypatch):
    """Each test with the plain isolation and with bubblewrap (LMFORGE_SANDBOX_BWRAP=0 / 1)."""
    if request.param == "bubblewrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed here")
    monkeypatch.setenv(ISOLATION_ENV, "1" if request.param == "bubblewrap" else "0")
    assert isolation() == request.param
    return request.param


@pytest.mark.parametrize("name,body,verdict", CASES, ids=[c[0] for c in CASES])
def test_the_sandbox_table(name, body, verdict, isolated, tmp_path, monkeypatch):
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


def test_an_endless_loop_is_killed_with_its_group_and_a_fork_is_refused(isolated, tmp_path, monkeypatch):
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


def test_cases_compare_return_values_and_exceptions(isolated):
    job = {"kind": "cases", "module": "", "function": "f", "source": "def f(a, b):\n    return a // b\n",
           "cases": [["(7, 2)", "3"], ["(1, 0)", "raise ZeroDivisionError"]]}
    assert run_job(job).verdict == "PASS"
    job["cases"][0][1] = "4"
    r = run_job(job)
    assert r.verdict == "FAIL" and r.detail == "case 1: got 3, expected 4", r


def test_the_verdict_is_decided_at_the_first_wrong_case_and_the_process_killed(isolated):
    """lmforge compares each reported case as it arrives: a wrong first case ends the job there,
    though the second would sleep for 10 s."""
    job = {"kind": "cases", "module": "", "function": "f", "cases": [["(1,)", "1"], ["(2,)", "2"]],
           "source": "def f(x):\n    if x == 2:\n        import time\n        time.sleep(10)\n    return -x\n"}
    r = run_job(job, timeout=8)
    assert r.verdict == "FAIL" and r.detail.startswith("case 1: got -1") and r.seconds < 3, r


def test_the_child_never_receives_an_expected_result():
    from lmforge.sandbox import plan_job

    case = {"kind": "cases", "module": "m", "function": "f", "source": "def f(x):\n    return x\n",
            "cases": [["(1,)", "'secret-want'", "('secret-after',)"]]}
    doc = {"kind": "doctest", "module": "", "function": "f", "source": "def f(x):\n    return x\n",
           "doc": ">>> f(1)\nsecret-output\n>>> f(0)\nTraceback (most recent call last):\nValueError: secret-exc\n"}
    for job in (case, doc):
        plan = plan_job(job)
        assert "secret" not in repr(plan.child) and "secret" in repr(plan.expected)
    assert plan_job(doc).child["examples"] == ["f(1)\n", "f(0)\n"]


def test_harness_errors_are_never_a_silent_zero(isolated):
    r = run_job({"kind": "doctest", "module": "no_such_module_here", "function": "f", "source": "def f(): pass\n"})
    assert r.verdict == "ERROR" and "no_such_module_here" in r.detail
    r = run_job({"kind": "cases", "module": "no_such_module_here", "function": "f", "source": "def f(): pass\n",
                 "cases": [["()", "None"]]})
    assert r.verdict == "ERROR" and "no_such_module_here" in r.detail
    ok = [Result("PASS", "", 0.0)] * 199
    check_errors(ok + [Result("ERROR", "x", 0.0)], "step 3")  # 0.5%: allowed
    with pytest.raises(SandboxError, match=r"step 3: 3 of 202 sandbox runs failed in the harness itself"):
        check_errors(ok + [Result("ERROR", "x", 0.0)] * 3, "step 3")
    assert MAX_ERROR_SHARE == 0.01


def test_the_isolation_is_said_in_one_line(monkeypatch):
    for value, expected in (("0", "process"), ("1", "bubblewrap"), ("auto", None)):
        if expected == "bubblewrap" and shutil.which("bwrap") is None:
            continue
        monkeypatch.setenv(ISOLATION_ENV, value)
        line = isolation_line()
        assert line.startswith("sandbox: ") and "\n" not in line
        how = isolation()
        assert how in ("process", "bubblewrap") and how == (expected or how)
        assert ("bubblewrap (read-only root" in line) == (how == "bubblewrap")
    monkeypatch.setenv(ISOLATION_ENV, "yes")
    with pytest.raises(SandboxError, match=r"LMFORGE_SANDBOX_BWRAP='yes': expected 1 .*, 0 .* or auto"):
        isolation()
    with pytest.raises(ValueError, match="isolation='docker'"):
        isolation("docker")


def _children() -> set[int]:
    out = set()
    for task in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            out |= {int(x) for x in Path(task).read_text().split()}
        except OSError:
            pass
    return out


def _fds() -> set[str]:
    return set(os.listdir(f"/proc/{os.getpid()}/fd"))


@pytest.fixture(autouse=True)
def own_temporary_folder(tmp_path, monkeypatch):
    """Each test's sandboxes make their folders in a temporary folder of the test's own: another
    process's (an xdist worker running another sandbox test) come and go in the system's at any
    time, and the no-leftover checks below compare folders (CI failed on it)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _folders() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "lmforge-sandbox-*")))


GOOD = {"kind": "cases", "module": "", "function": "f", "source": "def f(x):\n    return x\n", "cases": [["(1,)", "1"]]}
BAD_JOBS = [
    ([1, 2], TypeError, "job = \\[1, 2\\]: expected a dict"),
    ({**GOOD, "kind": "shell"}, ValueError, "job\\['kind'\\] = 'shell': expected one of"),
    ({**GOOD, "source": b"def f(x): return x"}, TypeError, "job\\['source'\\] = b'def f.*expected a str"),
    ({**GOOD, "cases": [[object(), "1"]]}, TypeError, "job\\['cases'\\]\\[0\\]\\[0\\] = <object.*expected a str"),
    ({**GOOD, "cases": [["(1,)", 1]]}, TypeError, "job\\['cases'\\]\\[0\\]\\[1\\] = 1: expected a str"),
    ({**GOOD, "cases": [["1", "1"]]}, ValueError, "= '1': expected the text of a tuple literal"),
    ({**GOOD, "cases": [["(1,)"]]}, ValueError,
     "job\\['cases'\\]\\[0\\] = \\['\\(1,\\)'\\]: expected \\[args, want\\]"),
    ({**GOOD, "cases": []}, ValueError, "job\\['cases'\\] is empty"),
    ({**GOOD, "function": "f; import os"}, ValueError, "job\\['function'\\] = 'f; import os': expected an identifier"),
    ({**GOOD, "module": "os; x"}, ValueError, "job\\['module'\\] = 'os; x': expected a dotted module name"),
    ({**GOOD, "nonce": "0"}, ValueError, "unknown field\\(s\\) \\['nonce'\\]"),
    ({"kind": "probe", "module": "time", "probes": {"sleep": ["(1,)"]}, "call_s": float("nan")}, ValueError,
     "job\\['call_s'\\] = nan: expected seconds in \\(0, 60\\]"),
]


@pytest.mark.parametrize("job,error,message", BAD_JOBS, ids=[str(i) for i in range(len(BAD_JOBS))])
def test_a_malformed_job_is_refused_before_any_process_starts_and_leaves_nothing(job, error, message):
    before = (_children(), _fds(), _folders())
    with pytest.raises(error, match=message):
        run_job(job)
    with Pool(workers=2) as pool:
        with pytest.raises(error, match=message):
            pool.map([GOOD, job])  # every job is checked before any runs
        assert pool._ready == []
    assert (_children(), _fds(), _folders()) == before


@pytest.mark.parametrize("timeout,memory,error,message", [
    (0, None, ValueError, r"timeout=0: expected seconds in \(0, 3600\]"),
    (-1, None, ValueError, r"timeout=-1: expected seconds in \(0, 3600\]"),
    (math.nan, None, ValueError, r"timeout=nan: expected"),
    (math.inf, None, ValueError, r"timeout=inf: expected"),
    (True, None, TypeError, r"timeout=True: expected seconds as a number"),
    ("5", None, TypeError, r"timeout='5': expected seconds as a number"),
    (5, 1 << 20, ValueError, r"memory_bytes=1048576: expected bytes in \[67108864 \(64 MiB\), 2\*\*63\)"),
    (5, 0, ValueError, r"memory_bytes=0: expected bytes in"),
    (5, -1, ValueError, r"memory_bytes=-1: expected bytes in"),
    (5, 2.5e9, TypeError, r"memory_bytes=2500000000.0: expected an int"),
])
def test_limits_outside_their_range_are_refused(timeout, memory, error, message):
    before = (_children(), _fds(), _folders())
    kw = {"timeout": timeout} if memory is None else {"timeout": timeout, "memory_bytes": memory}
    with pytest.raises(error, match=message):
        run_job(GOOD, **kw)
    with pytest.raises(error, match=message):
        Pool(**kw)
    if memory is None:
        with Pool() as pool, pytest.raises(error, match=message):
            pool.map([GOOD], timeout=timeout)
    assert (_children(), _fds(), _folders()) == before
    assert run_job(GOOD, timeout=0.5, memory_bytes=MIN_MEMORY_BYTES).verdict == "PASS"


def test_a_pool_leaves_no_process_folder_or_descriptor(isolated):
    before = (_children(), _fds(), _folders())
    with Pool(workers=2, timeout=2) as pool:
        got = [r.verdict for r in pool.map([GOOD] * 5 + [{**GOOD, "cases": [["(1,)", "2"]]}])]
        assert pool.map([GOOD], timeout=20)[0].verdict == "PASS"  # another time limit: the same interpreters
    assert got == ["PASS"] * 5 + ["FAIL"]
    time.sleep(0.1)
    assert (_children(), _fds(), _folders()) == before


def test_a_malformed_report_is_the_harness_fault_before_ready_and_the_candidates_after():
    from lmforge.sandbox import plan_job

    from lmforge.sandbox.jobs import Judge
    def judge():
        return Judge(plan_job(GOOD))

    j = judge()
    assert j.feed(["n", "obs", "value", "1", "(1,)"])[0] == "ERROR"  # before "ready": only the harness writes
    assert judge().feed(["n", "error", "no module"])[:2] == ("ERROR", "no module")
    for bad in (["n", "obs", "value"], ["n", "obs", "weird", "1"], ["n", "ready", ""],
                ["n", "kept", "f", "a", "b", "c"], ["n", "error", "forged"], ["n"]):
        j = judge()
        assert j.feed(["n", "ready", ""]) is None
        assert j.feed(bad)[0] == "FAIL", bad
    j = judge()
    j.feed(["n", "ready", ""])
    assert j.feed(["n", "done"])[:2] == ("FAIL", "the report ended after 0 of 1 cases")
    j = judge()
    j.feed(["n", "ready", ""])
    assert j.feed(["n", "obs", "value", "1", "(1,)"]) is None and j.feed(["n", "done"])[0] == "PASS"
