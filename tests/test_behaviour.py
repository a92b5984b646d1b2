"""The behaviour reward (lmforge.scorers.behaviour) and the sandbox's pool of pre-started
interpreters: differential testing against the real standard-library function, on inputs from
its doctests, their mutations and typed pools; reward hacks score 0 (R6); a function whose
results hang on the process is dropped; the pool gives run_job's verdicts and leaves nothing;
each with and without bubblewrap."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

import pytest

from lmforge.data.prompts import Prompt
from lmforge.sandbox import Pool, run_job
from lmforge.scorers.behaviour import MAX_INPUTS, Behaviour, candidate_inputs, select_cases
from lmforge.scorers.rewards import Rewards

SIG = 'def IS_CHARACTER_JUNK(ch, ws=" \\t"):'
DOC = '''    r"""
    Return True for ignorable character: iff `ch` is a space or tab.

    Examples:

    >>> IS_CHARACTER_JUNK(' ')
    True
    >>> IS_CHARACTER_JUNK('\\t')
    True
    >>> IS_CHARACTER_JUNK('\\n')
    False
    >>> IS_CHARACTER_JUNK('x')
    False
    """'''


def _prompt(module="difflib", qualname="IS_CHARACTER_JUNK", signature=SIG, doc=DOC, reference="    return ch in ws"):
    user = "Write the body of this Python function:\n" + signature + "\n" + doc
    return Prompt([{"role": "user", "content": user}], f"{module}:{qualname}", f"{module}:{qualname}",
                  {"module": module, "qualname": qualname, "signature": signature, "reference": reference})


@pytest.fixture(scope="module", params=["process", "bubblewrap"])
def pool(request):
    """A pool of each isolation (bubblewrap where it is installed)."""
    if request.param == "bubblewrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed here")
    with Pool(workers=2, isolation=request.param) as p:
        yield p


def test_inputs_start_with_the_doctest_arguments_and_are_deterministic():
    xs = candidate_inputs(SIG, DOC, "IS_CHARACTER_JUNK", "difflib")
    assert xs[:4] == ["(' ',)", "('\\t',)", "('\\n',)", "('x',)"]
    assert len(xs) == MAX_INPUTS == len(set(xs))
    assert xs == candidate_inputs(SIG, DOC, "IS_CHARACTER_JUNK", "difflib")
    assert any(x.count(",") >= 1 and x.endswith(")") and len(eval(x)) == 2 for x in xs)  # the optional `ws` too
    assert candidate_inputs("def m(self, x):", DOC, "Cls.m", "difflib") == []  # a method needs an instance
    assert candidate_inputs("def f(*, key):", "", "f", "m") == []  # a required keyword-only parameter


def test_select_cases_needs_two_results_and_puts_new_results_first():
    same = [["(1,)", "0", "(1,)"], ["(2,)", "0", "(2,)"], ["(3,)", "0", "(3,)"]]
    assert select_cases(same) is None  # a constant would pass
    assert select_cases(same[:1] + [["(4,)", "1", "(4,)"]]) is None  # fewer than MIN_CASES
    got = select_cases(same + [["(4,)", "1", "(4,)"]])
    assert [c[1] for c in got] == ["0", "1", "0", "0"]


HACKS = ["    pass", "    ...", "    return None", "    return True", '    """Junk."""',
         "    raise NotImplementedError",
         # hard-coded doctest outputs: right on the docstring's four examples, wrong elsewhere
         "    if ch == ' ' or ch == '\\t':\n        return True\n    return False",
         "    return {' ': True, '\\t': True, '\\n': False, 'x': False}.get(ch, False)",
         "    from difflib import IS_CHARACTER_JUNK as ref\n    return ref(ch, ws)",
         "    import os\n    os.write(1, b'PASS\\n')\n    os._exit(0)"]


def test_r6_hacks_score_zero_on_behaviour_and_real_bodies_one(pool):
    b = Behaviour(pool)
    p = _prompt()
    b.prepare([p])
    cases = b.cases["difflib:IS_CHARACTER_JUNK"]
    assert cases is not None and len(cases) >= 6 and len({c[1] for c in cases}) == 2
    assert any(c[0].count(",") == 1 and not c[0].endswith(",)") for c in cases)  # `ws` varied: hard-coding fails
    good = ["    return ch in ws", "    return ws.find(ch) >= 0", "    for c in ws:\n        if c == ch:\n"
            "            return True\n    return ch == ''"]
    scores, results = b.score([p] * (len(good) + len(HACKS)), good + HACKS, [True] * (len(good) + len(HACKS)))
    assert scores == [1.0] * len(good) + [0.0] * len(HACKS), [r.detail for r in results]
    assert all(r.verdict in ("PASS", "FAIL") for r in results)
    assert b.score([p], ["    return ch in ws"], [False])[0] == [0.0]  # refused by the static check: not run


def test_a_result_tied_to_the_process_drops_the_function(pool):
    """posixpath.abspath answers the same twice in one probe, but another interpreter's folder gives
    another answer: its reference body fails its own cases, so the reward does not apply."""
    ref = "    path = os.fspath(path)\n    if not isabs(path):\n        path = join(os.getcwd(), path)\n" \
          "    return normpath(path)"
    p = _prompt("posixpath", "abspath", "def abspath(path):", '    """Return an absolute path."""', ref)
    b = Behaviour(pool)
    assert b.score([p], [ref], [True])[0] == [None]
    method = _prompt(qualname="SequenceMatcher.ratio", signature="def ratio(self):")
    assert b.score([method], ["    return 1.0"], [True])[0] == [None]


def test_a_slow_function_is_dropped_and_its_module_still_probed():
    r = run_job({"kind": "probe", "module": "time", "probes": {"sleep": ["(10,)"], "gmtime": ["(0,)"]}}, timeout=10)
    assert r.verdict == "PASS" and r.data["sleep"] == [] and r.data["gmtime"][0][0] == "(0,)"
    assert r.seconds < 3


def test_rewards_average_what_applies_and_a_users_none_is_allowed(pool, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "partial_reward.py").write_text(
        "def half(completions, prompts, **kw):\n    return [None if 'x' in c else 0.5 for c in completions]\n")
    rw = Rewards(["behaviour", "partial_reward:half"])
    try:
        p, m = _prompt(), _prompt(qualname="SequenceMatcher.ratio", signature="def ratio(self):")
        s = rw.score([p, p, m, m], ["    return ch in ws", "    return False # x", "    return 1.0", "    return 1.0"],
                     [True, True, True, False])
        assert s.each["behaviour"] == [1.0, 0.0, None, None]
        assert s.each["partial_reward:half"] == [0.5, None, 0.5, 0.5]
        assert s.total == [0.75, 0.0, 0.5, 0.0]  # the mean of what applies; cut off: 0
    finally:
        rw.close()


@pytest.mark.parametrize("isolation", ["process", "bubblewrap"])
def test_the_pool_gives_run_jobs_verdicts_in_order_and_leaves_no_folder(isolation, tmp_path, monkeypatch):
    if isolation == "bubblewrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed here")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # a folder of its own: another worker's sandboxes come and go in /tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "lmforge-sandbox-*")))
    job = {"kind": "cases", "module": "", "function": "f", "source": "def f(a, b):\n    return a // b\n"}
    jobs = [{**job, "cases": [[f"({i}, 2)", repr(i // 2)]]} for i in range(8)]
    jobs[3] = {**job, "cases": [["(1, 2)", "7"]]}
    jobs[5] = {**job, "source": "def f(a, b):\n    while True: pass\n", "cases": [["(1, 2)", "0"]]}
    with Pool(workers=2, timeout=1.5, isolation=isolation) as p:
        got = [r.verdict for r in p.map(jobs)]
        again = [r.verdict for r in p.map(jobs[:2])]
    assert got == ["PASS"] * 3 + ["FAIL", "PASS", "TIMEOUT", "PASS", "PASS"]
    assert got == [run_job(j, timeout=1.5, isolation=isolation).verdict for j in jobs]
    assert again == ["PASS", "PASS"]
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "lmforge-sandbox-*"))) == before
    with pytest.raises(RuntimeError, match="closed"):
        p.map(jobs)
