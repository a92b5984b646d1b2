"""The reward functions of `rl.rewards` (lmforge.scorers.rewards): lmforge's own are plain functions
with a user's signature (TRL's) in one table, `REWARDS`, that holds config.RL_REWARDS; their
docstrings' `>>>` examples run; `Rewards.score` checks and averages lmforge's rewards as it does
yours; every number is the one the code before the table gave (literals below, computed by it on
the same completions); a new one (`parses`) is one function and one row; importing a reward of
yours leaves sys.path as it is once the module is found."""

from __future__ import annotations

import doctest
import inspect
import sys
from pathlib import Path

import pytest

from lmforge.config import RL_REWARDS
from lmforge.data.prompts import Prompt
from lmforge.errors import ConfigError
from lmforge.scorers import rewards as rewards_module
from lmforge.scorers.rewards import REWARDS, SANDBOXED, Reward, RewardError, Rewards

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/rl_rewards.py: "a user's own" rewards

STDLIB_PROMPT = "Write the body of this Python function:\n"


def stdlib(module: str, qualname: str, signature: str, doc: str, reference: str) -> Prompt:
    where = f"{module}:{qualname}"
    return Prompt([{"role": "user", "content": STDLIB_PROMPT + signature + "\n" + doc}], where, where,
                  {"module": module, "qualname": qualname, "signature": signature, "reference": reference})


JUNK = stdlib("difflib", "IS_CHARACTER_JUNK", 'def IS_CHARACTER_JUNK(ch, ws=" \\t"):',
              '    r"""\n    Return True for ignorable character: iff `ch` is a space or tab.\n\n    Examples:\n\n'
              '    >>> IS_CHARACTER_JUNK(\' \')\n    True\n    >>> IS_CHARACTER_JUNK(\'\\t\')\n    True\n'
              '    >>> IS_CHARACTER_JUNK(\'\\n\')\n    False\n    >>> IS_CHARACTER_JUNK(\'x\')\n    False\n    """',
              "    return ch in ws")
MEDIAN = stdlib("statistics", "median", "def median(data):",
                '    """Return the median (middle value) of numeric data.\n\n    >>> median([1, 3, 5])\n    3\n'
                '    >>> median([1, 3, 5, 7])\n    4.0\n\n    """',
                '    data = sorted(data)\n    n = len(data)\n    if n == 0:\n        raise StatisticsError("no median '
                'for empty data")\n    if n % 2 == 1:\n        return data[n // 2]\n    else:\n        i = n // 2\n'
                '        return (data[i - 1] + data[i]) / 2')
RATIO = stdlib("difflib", "SequenceMatcher.ratio", "def ratio(self):",
               '    """Return a measure of the sequences\' similarity (float in [0,1]).\n\n'
               '    >>> s = SequenceMatcher(None, "abcd", "bcde")\n    >>> s.ratio()\n    0.75\n    """',
               "    matches = sum(triple[-1] for triple in self.get_matching_blocks())\n"
               "    return _calculate_ratio(matches, len(self.a) + len(self.b))")

#: (prompt, completion, stopped): right, stubs, hard-coded, unresolved, cut off, text after, unparsable, wrong.
FUNCTIONS = [
    (JUNK, "    return ch in ws", True),
    (JUNK, "    return ws.find(ch) >= 0", True),
    (JUNK, "    pass", True),
    (JUNK, "    return True", True),
    (JUNK, "    if ch == ' ' or ch == '\\t':\n        return True\n    return False", True),
    (JUNK, "    return ch in wz", True),
    (JUNK, "    return ch in ws", False),
    (JUNK, "    return ch in ws\nprint(1)", True),
    (JUNK, "    return (\n", True),
    (JUNK, "    return ch == ' '", True),
    (MEDIAN, MEDIAN.fields["reference"], True),
    (MEDIAN, "    return sorted(data)[len(data) // 2]", True),
    (MEDIAN, "    return 3", True),
    (MEDIAN, "    raise ValueError(data)", True),
    (MEDIAN, "    s = sorted(data)\n    n = len(s)\n    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2",
     True),
    (MEDIAN, MEDIAN.fields["reference"], False),
]
METHODS = [
    (RATIO, RATIO.fields["reference"], True),
    (RATIO, "    return 1.0", True),
    (RATIO, "    return len(self.a) / 2", True),
    (RATIO, "    return self.quick_ratio()", True),
]

# What the code before the table (`if name == ...` branches in Rewards.score, at f54324a) gave
# on these completions, printed with repr: the table must give the same floats, bit for bit.
R = None
REASONS = ["", "", "trivial", "trivial", "trivial", "unresolved name wz", "cut off", "text after the function",
           "does not parse", "", "", "", "trivial", "", "", "cut off"]
BEFORE = {
    "static": [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0],
    "rl_rewards:fractional": [0.0, 0.42857142857142855, 0.8571428571428571, 0.2857142857142857, R,
                              0.14285714285714285, 0.5714285714285714, 0.0, 0.42857142857142855, R,
                              0.2857142857142857, 0.7142857142857143, 0.14285714285714285, 0.5714285714285714, R,
                              0.42857142857142855],
    "doctests": [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0],
    "behaviour": [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0],
    "rl_rewards:short": [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
}
TOTAL_BEFORE = [0.6, 0.6857142857142857, 0.37142857142857144, 0.05714285714285714, 0.0, 0.02857142857142857, 0.0, 0.0,
                0.08571428571428572, 0.25, 0.6571428571428571, 0.34285714285714286, 0.02857142857142857,
                0.3142857142857143, 0.75, 0.0]
VERDICTS_BEFORE = ["PASS", "PASS", "FAIL", "PASS", "FAIL", "FAIL", "PASS",  # doctests, then behaviour
                   "PASS", "PASS", "FAIL", "PASS", "FAIL", "FAIL", "PASS"]
# rl.rewards = ["rl_rewards:fractional", "static", "behaviour"] on FUNCTIONS + METHODS
METHODS_BEFORE = {
    "static": BEFORE["static"] + [1.0, 0.0, 1.0, 1.0],
    "behaviour": BEFORE["behaviour"] + [R, R, R, R],
}
METHODS_TOTAL_BEFORE = [0.6666666666666666, 0.8095238095238096, 0.2857142857142857, 0.09523809523809523, 0.0,
                        0.047619047619047616, 0.0, 0.0, 0.14285714285714285, 0.5, 0.7619047619047619,
                        0.5714285714285715, 0.047619047619047616, 0.5238095238095238, 1.0, 0.0, 0.9285714285714286,
                        0.14285714285714285, 0.8571428571428572, 1.0]


def score(names, cases):
    rw = Rewards(names)
    try:
        return rw.score([p for p, _, _ in cases], [c for _, c, _ in cases], [s for _, _, s in cases])
    finally:
        rw.close()


def test_the_rewards_examples_run():
    """Every `>>>` example in lmforge.scorers.rewards (each reward's docstring) runs as written."""
    result = doctest.testmod(rewards_module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 14, result
    for name, row in REWARDS.items():
        assert ">>> " + row.function.__name__ + "(" in row.function.__doc__, f"{name}: no runnable example"


def test_the_table_is_config_rl_rewards_and_each_reward_has_a_users_signature():
    assert set(REWARDS) == set(RL_REWARDS)
    assert SANDBOXED == {"doctests", "behaviour"}
    for name, row in REWARDS.items():
        params = inspect.signature(row.function).parameters
        assert list(params)[:2] == ["completions", "prompts"], name
        assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), name  # TRL passes every field
        assert set(row.reads) <= set(params), name
    assert "name ==" not in inspect.getsource(Rewards.score)  # no branch per reward left


def test_every_reward_gives_the_numbers_it_gave_before_the_table():
    names = ["static", "rl_rewards:fractional", "doctests", "behaviour", "rl_rewards:short"]
    s = score(names, FUNCTIONS)
    assert list(s.each) == names
    assert s.each == BEFORE and s.total == TOTAL_BEFORE and s.reasons == REASONS
    assert [r.verdict for r in s.results] == VERDICTS_BEFORE
    s = score(["rl_rewards:fractional", "static", "behaviour"], FUNCTIONS + METHODS)  # another order, None applies
    assert s.each["static"] == METHODS_BEFORE["static"] and s.each["behaviour"] == METHODS_BEFORE["behaviour"]
    assert s.total == METHODS_TOTAL_BEFORE


def test_doctests_does_not_apply_to_a_method():
    """A method's body cannot replace it in its module: None (it used to stop the run with a
    ValueError from the sandbox, 'expected an identifier')."""
    s = score(["doctests"], METHODS)
    assert s.each["doctests"] == [None] * 4 and s.total == [0.0] * 4 and s.results == []


def test_parses_a_new_reward_is_one_function_and_one_row():
    """`parses`: 1 where the body parses under its signature and the model ended its turn."""
    from lmforge.config import load_config

    s = score(["parses"], FUNCTIONS + METHODS)
    want = [0.0 if why in ("does not parse", "text after the function", "cut off") else 1.0 for why in REASONS]
    assert s.each["parses"] == want + [1.0] * 4
    assert load_config(None, ["rl.rewards=['parses', 'static']"]).rl.rewards == ["parses", "static"]
    bare = Prompt([{"role": "user", "content": "f"}], "p.jsonl:2", "k", {"answer": "1"})
    with pytest.raises(RewardError, match=r"rl\.rewards = 'parses' reads the field\(s\) \['signature'\] of each "
                                          r"prompt, and p\.jsonl:2 has none \(it has \['answer'\]\)"):
        score(["parses"], [(bare, "x", True)])


def test_score_checks_lmforges_rewards_as_it_checks_yours(monkeypatch):
    monkeypatch.setitem(REWARDS, "static", Reward(lambda completions, prompts, **f: [2.0] * len(completions),
                                                  ("signature",)))
    with pytest.raises(RewardError, match=r"rl\.rewards = 'static' returned 2\.0 for completion 0 \(prompt "
                                          r"difflib:IS_CHARACTER_JUNK\): expected a number in \[0, 1\]"):
        score(["static"], FUNCTIONS[:2])
    monkeypatch.setitem(REWARDS, "static", Reward(lambda completions, prompts, **f: [1.0], ("signature",)))
    with pytest.raises(RewardError, match=r"'static' returned list of 1: expected a list of 2 numbers"):
        score(["static"], FUNCTIONS[:2])


def test_a_name_that_is_no_reward_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"rl\.rewards names 'statik': expected one of \['behaviour', 'doctests', "
                                          r"'parses', 'static'\] or \"package\.module:function\""):
        Rewards(["statik"])


def test_importing_a_reward_again_or_from_sys_path_leaves_sys_path_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    Rewards(["rl_rewards:short"])  # on sys.path already: the current folder is not added
    assert sys.path == before
    (tmp_path / "here_rewards.py").write_text("def f(completions, **fields):\n    return [1.0] * len(completions)\n")
    try:
        Rewards(["here_rewards:f"])  # in the current folder: added once
        assert sys.path == before + [str(tmp_path)]
        for _ in range(3):
            Rewards(["here_rewards:f"])
        assert sys.path == before + [str(tmp_path)]
        sys.modules.pop("here_rewards")
        Rewards(["here_rewards:f"])  # imported afresh, found through the entry added before
        assert sys.path == before + [str(tmp_path)]
    finally:
        sys.modules.pop("here_rewards", None)
