"""Issue 45: the sandbox's verdict is out of the generated code's reach.

Each forging body below is a WRONG body for difflib.IS_CHARACTER_JUNK (it returns `ch not in
ws`, or is right on one input only) that passes the static check, and tries to turn its verdict
into PASS (or ERROR, which stops an RL run), or to write a canary file outside the job's folder,
by one of the routes the issue found:

- harness: the objects the harness calls after the body returns and the modules they live in
  (the comparison, `repr`, the JSON encoder, the pipe's `os.write`, the harness's own functions,
  `os.path.realpath` under the audit hook's folder check);
- frames: a signal handler's frame, walked up to the harness's locals (its report function, its
  guard, the hook's closure);
- later: code that runs after the body returned (atexit, `__del__` at shutdown, weakref
  finalizers, gc callbacks, threads);
- after: text after the function's body in the completion (module-level statements, a second
  definition, a decorator, a class body);
- and the reference itself, called under another name or brought back by reloading its module
  (the body would "pass" by calling what it should replace).

Each runs through `run_job` (a doctest job and a cases job, with and without bubblewrap),
`Pool`, the doctests and behaviour rewards and the `functions` eval task; the verdict is never
PASS, a forged ERROR is a FAIL, and the canary (in pytest's folder, outside the job's) stays
unwritten.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from lmforge.data.prompts import Prompt
from lmforge.data.stdlib_functions import place_body
from lmforge.sandbox import Pool, run_job
from lmforge.scorers.doctests import doctest_job
from lmforge.scorers.static import static_verdict

SIG = 'def IS_CHARACTER_JUNK(ch, ws=" \\t"):'
WRONG = "    return ch not in ws\n"
#: a cases job's cases (the first one is (' ',): a body right there only is wrong on the others)
CASES = [["(' ',)", "True", "(' ',)"], ["('x',)", "False", "('x',)"], ["('\\t',)", "True", "('\\t',)"],
         ["('a', 'ab')", "True", "('a', 'ab')"], ["(' ', 'x')", "False", "(' ', 'x')"]]
ISOLATIONS = ["process", "bubblewrap"]

# an always-equal string: what a forged comparison returns
SAME = ("    class Same(str):\n"
        "        def __eq__(self, other):\n            return True\n"
        "        def __ne__(self, other):\n            return False\n"
        "        __hash__ = str.__hash__\n")
# walks a signal handler's frame up through the harness, calling what it finds
FRAMES = ("    import signal\n"
          "    def grab(signum, frame):\n"
          "        f = frame\n"
          "        while f is not None:\n"
          "            ACTION\n"
          "            f = f.f_back\n"
          "    signal.signal(signal.SIGUSR1, grab)\n"
          "    signal.raise_signal(signal.SIGUSR1)\n")
# from each frame: every function that may send the report: a forged verdict (the old protocol),
# then a full report of guessed observations (this one), then the process ends
SAY = ("for v in list(f.f_locals.values()):\n"
       "                if callable(v) and getattr(v, '__name__', '') in ('say', 'report', 'send', 'emit'):\n"
       "                    for args, kw in (((), {'verdict': 'VERDICT', 'detail': 'forged', 'data': None}),\n"
       "                                     (('VERDICT', 'forged'), {}), (('obs', 'out', 'True\\n'), {}),\n"
       "                                     (('obs', 'value', 'True', \"(' ',)\"), {}), (('done',), {})):\n"
       "                        try:\n"
       "                            v(*args, **kw)\n"
       "                        except Exception:\n"
       "                            pass\n"
       "            if f.f_back is None:\n"
       "                __import__('os')._exit(0)")
# from each frame: switch the guard off, point the hook's folder (closure or defaults) at /
DISARM = ("home = __import__('os').getcwd()\n"
          "            for v in list(f.f_locals.values()):\n"
          "                if isinstance(v, list) and v == [True]:\n"
          "                    v[0] = False\n"
          "                try:\n"
          "                    for c in (getattr(v, '__closure__', None) or ()):\n"
          "                        if c.cell_contents == home:\n"
          "                            c.cell_contents = '/'\n"
          "                    d = getattr(v, '__defaults__', None)\n"
          "                    if d and home in d:\n"
          "                        v.__defaults__ = tuple('/' if x == home else x for x in d)\n"
          "                except (ValueError, PermissionError):\n"
          "                    pass")
WRITE = "    open(CANARY, 'w').write('forged')\n"
# code that keeps trying to write the canary, quietly
TRY_WRITE = ("        for _ in range(100):\n"
             "            try:\n"
             "                open(CANARY, 'w').write('forged')\n"
             "                return\n"
             "            except OSError:\n"
             "                __import__('time').sleep(0.002)\n")
# module-level: every message the harness encodes says PASS
JSON_AT_TOP = ("def _forge(obj, *a, _real=__import__('json').dumps, **k):\n"
               "    if isinstance(obj, dict) and 'verdict' in obj:\n"
               "        obj = dict(obj, verdict='PASS')\n"
               "    return _real(obj, *a, **k)\n")

# (name, the job kinds it aims at, body: CANARY stands for the canary's path)
FORGERIES = [
    ("harness-checker", "doctest",
     "    import doctest\n    doctest.OutputChecker.check_output = lambda *a: True\n" + WRONG),
    ("harness-repr", "cases",
     "    import builtins\n" + SAME + "    builtins.repr = lambda o: Same()\n" + WRONG),
    ("harness-json", "doctest cases",
     "    import json\n    real = json.dumps\n"
     "    def dumps(obj, *a, **k):\n"
     "        if isinstance(obj, dict) and 'verdict' in obj:\n            obj = dict(obj, verdict='PASS')\n"
     "        return real(obj, *a, **k)\n"
     "    json.dumps = dumps\n" + WRONG),
    ("harness-pipe-write", "doctest cases",
     "    import os\n    real = os.write\n"
     "    def write(fd, data):\n"
     "        return real(fd, bytes(data).replace(b'\"verdict\": \"FAIL\"', b'\"verdict\": \"PASS\"'))\n"
     "    os.write = write\n" + WRONG),
    ("harness-functions", "cases",  # right on the first case; then the harness's own function is replaced
     "    import __main__\n" + SAME + "    __main__._outcome = lambda fn, args: (Same(), Same())\n"
     "    return ch == ' '\n"),
    ("harness-realpath", "doctest cases",  # the hook's folder check asks os.path.realpath
     "    import os\n    home = os.getcwd()\n    os.path.realpath = lambda p, *a, **k: home\n" + WRITE + WRONG),
    ("hook-dir-fd", "doctest cases",  # a relative path, opened relative to an outside folder's descriptor
     "    import os\n    d = os.open(os.path.dirname(CANARY), os.O_RDONLY)\n"
     "    fd = os.open(os.path.basename(CANARY), os.O_WRONLY | os.O_CREAT, dir_fd=d)\n"
     "    os.write(fd, b'forged')\n" + WRONG),
    ("frames-report-pass", "doctest cases", FRAMES.replace("ACTION", SAY.replace("VERDICT", "PASS")) + WRONG),
    ("frames-report-error", "doctest cases",
     FRAMES.replace("ACTION", SAY.replace("'VERDICT', 'forged'", "'error', 'forged'").replace("VERDICT", "ERROR"))
     + WRONG),
    ("frames-disarm-guard", "doctest cases", FRAMES.replace("ACTION", DISARM) + WRITE + WRONG),
    ("later-atexit", "doctest cases",
     "    import atexit\n    atexit.register(lambda: open(CANARY, 'w').write('forged'))\n" + WRONG),
    ("later-del-at-shutdown", "doctest cases",
     "    import sys\n    class Late:\n        def __init__(self):\n            self.open = open\n"
     "        def __del__(self):\n            try:\n                self.open(CANARY, 'w').write('forged')\n"
     "            except OSError:\n                pass\n"
     "    sys.modules['difflib'].late = Late()\n" + WRONG),
    ("later-weakref-finalize", "doctest cases",
     "    import sys, weakref\n    class Kept:\n        pass\n    k = Kept()\n"
     "    sys.modules['difflib'].kept = k\n"
     "    weakref.finalize(k, lambda: open(CANARY, 'w').write('forged'))\n" + WRONG),
    ("later-gc-callback", "doctest cases",
     "    import gc\n    def cb(phase, info):\n" + TRY_WRITE.replace("range(100)", "range(1)")
     .replace("__import__('time').sleep(0.002)", "pass")
     + "    gc.callbacks.append(cb)\n    gc.set_threshold(1)\n" + WRONG),
    ("later-thread", "doctest cases",
     "    import threading\n    def later():\n" + TRY_WRITE + "    threading.Thread(target=later).start()\n" + WRONG),
    ("later-timer", "doctest cases",
     "    import threading\n    def later():\n" + TRY_WRITE + "    threading.Timer(0.01, later).start()\n" + WRONG),
    ("after-statements", "doctest cases",
     WRONG + JSON_AT_TOP + "import json\njson.dumps = _forge\n"),
    ("after-second-def", "doctest",  # the static check reads the first definition, the second one runs
     WRONG + "def IS_CHARACTER_JUNK(ch, ws=' \\t'):\n    return {' ': True, '\\t': True}.get(ch, False)\n"),
    ("after-decorator", "doctest cases",
     WRONG + JSON_AT_TOP + "@(lambda f: setattr(__import__('json'), 'dumps', _forge) or f)\ndef _helper():\n"
                           "    pass\n"),
    ("after-class-body", "doctest cases",
     WRONG + JSON_AT_TOP + "class _Late:\n    __import__('json').dumps = _forge\n"),
]
FORGED = {name: body for name, _, body in FORGERIES}
#: every (forgery, job kind) it aims at
AIMS = [(name, kind) for name, kinds, _ in FORGERIES for kind in kinds.split()]


def _body(name: str, canary: Path) -> str:
    return FORGED[name].replace("CANARY", repr(str(canary)))


def _job(kind: str, body: str) -> dict:
    source = place_body(SIG, body)
    if kind == "doctest":
        return doctest_job("difflib", "IS_CHARACTER_JUNK", source)
    return {"kind": "cases", "module": "difflib", "function": "IS_CHARACTER_JUNK", "source": source, "cases": CASES}


@pytest.fixture(params=ISOLATIONS)
def isolation(request, monkeypatch):
    """Each test with the plain isolation and with bubblewrap (LMFORGE_SANDBOX_BWRAP=0 / 1)."""
    if request.param == "bubblewrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed here")
    monkeypatch.setenv("LMFORGE_SANDBOX_BWRAP", "1" if request.param == "bubblewrap" else "0")
    return request.param


def _untouched(canary: Path) -> None:
    time.sleep(0.05)  # what a late thread would have written
    if canary.exists():
        raise AssertionError(f"the canary {canary} was written: {canary.read_text()!r}")


def test_every_forging_body_passes_the_static_gate_but_text_after_the_function():
    for name, _, body in FORGERIES:
        v = static_verdict(SIG, body.replace("CANARY", "'/x'"), module="difflib")
        assert v.ok == (not name.startswith("after-")), (name, v)
        if name.startswith("after-"):
            assert v.reason == "text after the function", (name, v)


@pytest.mark.parametrize("name,kind", AIMS, ids=[f"{n}-{k}" for n, k in AIMS])
def test_run_job_never_passes_a_forging_body(name, kind, isolation, tmp_path):
    canary = tmp_path / "canary.txt"
    r = run_job(_job(kind, _body(name, canary)), timeout=5)
    assert r.verdict in ("FAIL", "TIMEOUT", "OOM"), r  # never PASS; a forged ERROR is the body's doing: FAIL
    _untouched(canary)


def test_a_pool_never_passes_a_forging_body(isolation, tmp_path):
    jobs = [_job(kind, _body(name, tmp_path / f"{name}-{kind}.txt")) for name, kind in AIMS]
    where = [f"{name}/{kind}" for name, kind in AIMS]
    with Pool(workers=2, timeout=5) as pool:
        got = pool.map(jobs)
    assert [w for w, r in zip(where, got) if r.verdict not in ("FAIL", "TIMEOUT", "OOM")] == [], got
    _untouched_all(tmp_path)


def _untouched_all(folder: Path) -> None:
    time.sleep(0.05)
    written = sorted(p.name for p in folder.iterdir())
    if written:
        raise AssertionError(f"canaries written: {written}")


def _prompt() -> Prompt:
    where = "difflib:IS_CHARACTER_JUNK"
    doc = ('    """Junk.\n\n    >>> IS_CHARACTER_JUNK(\' \')\n    True\n'
           '    >>> IS_CHARACTER_JUNK(\'x\')\n    False\n    """')
    return Prompt([{"role": "user", "content": "Write the body of this Python function:\n" + SIG + "\n" + doc}],
                  where, where, {"module": "difflib", "qualname": "IS_CHARACTER_JUNK", "signature": SIG,
                                 "reference": "    return ch in ws"})


@pytest.mark.parametrize("reward,kind", [("doctests", "doctest"), ("behaviour", "cases")])
def test_the_sandboxed_rewards_give_a_forging_body_nothing(reward, kind, isolation, tmp_path):
    from lmforge.scorers.rewards import Rewards

    names = [n for n, kinds, _ in FORGERIES if kind in kinds.split()]
    bodies = ["    return ch in ws"] + [_body(n, tmp_path / f"{n}.txt") for n in names]
    rewards = Rewards([reward])
    try:
        scored = rewards.score([_prompt()] * len(bodies), bodies, [True] * len(bodies))
    finally:
        rewards.close()
    got = dict(zip(["reference"] + names, scored.each[reward]))
    assert got.pop("reference") == 1.0  # the rewards do run here
    assert {n: v for n, v in got.items() if v != 0.0} == {}
    _untouched_all(tmp_path)


def test_the_functions_eval_task_passes_no_forging_body(isolation, tmp_path, monkeypatch):
    from lmforge.evals import generation

    names = [n for n, kinds, _ in FORGERIES if "cases" in kinds.split()]
    bodies = ["    return ch in ws"] + [_body(n, tmp_path / f"{n}.txt") for n in names]
    checked = []

    def forged_bodies(model, tok, ids, sampling, runtime, generator=None):
        return list(bodies), [True] * len(ids)

    class Rendered:
        ids = [1, 2, 3]

    class Tok:
        def render_chat(self, messages, add_generation_prompt=False):
            return Rendered()

    real_passes = generation.Checker.passes

    def passes(self, prompts, bodies_, stopped):
        out = real_passes(self, prompts, bodies_, stopped)
        checked.append(out)
        return out

    monkeypatch.setattr(generation, "_bodies", forged_bodies)
    monkeypatch.setattr(generation.Checker, "passes", passes)
    r = generation.functions_task(None, Tok(), [_prompt()] * len(bodies))
    assert r["checked_by"] == {"behaviour": len(bodies), "doctests": 0}
    got = dict(zip(["reference"] + names, checked[0]))
    assert got.pop("reference") is True
    assert [n for n, ok in got.items() if ok] == []
    assert r["accuracy"] == 1 / len(bodies)
    _untouched_all(tmp_path)


REFERENCE = [
    ("alias", "def commonprefix(m):\n    import posixpath\n    return posixpath.commonprefix(m)\n", "RecursionError"),
    ("reload", "def commonprefix(m):\n    import importlib, genericpath\n"
               "    return importlib.reload(genericpath).commonprefix(m)\n", "PermissionError"),
]


@pytest.mark.parametrize("name,source,why", REFERENCE, ids=[r[0] for r in REFERENCE])
def test_the_reference_under_another_name_is_the_candidate_too(name, source, why, isolation):
    """posixpath imports genericpath's commonprefix: a body for genericpath.commonprefix that calls
    posixpath's calls itself, and reloading genericpath (the reference back) is refused."""
    job = {"kind": "cases", "module": "genericpath", "function": "commonprefix", "source": source,
           "cases": [["(['abc', 'abd'],)", "'ab'"], ["([],)", "''"]]}
    r = run_job(job)
    assert r.verdict == "FAIL" and why in r.detail, r
    real = ("def commonprefix(m):\n    if not m:\n        return ''\n    s1, s2 = min(m), max(m)\n"
            "    for i, c in enumerate(s1):\n        if c != s2[i]:\n            return s1[:i]\n    return s1\n")
    assert run_job({**job, "source": real}).verdict == "PASS"


def test_a_prompts_module_name_never_imports_a_package_in_lmforges_process(tmp_path, monkeypatch):
    """The static check reads a module's names from its source (`static.module_names`); a prompt
    file's "module" naming a submodule of an installed package must not run that package's
    `__init__` in lmforge's own process (`importlib.util.find_spec("a.b")` imports `a`)."""
    import sys

    from lmforge.scorers import static

    canary = tmp_path / "canary"
    pkg = tmp_path / "site" / "lmforge_forgery_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"open({str(canary)!r}, 'w').write('imported')\n", encoding="utf-8")
    (pkg / "sub.py").write_text("VALUE = 1\ndef helper():\n    return VALUE\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert static.module_names("lmforge_forgery_pkg.sub") == {"VALUE", "helper"}
    assert not canary.exists() and "lmforge_forgery_pkg" not in sys.modules
