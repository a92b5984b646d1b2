"""lmforge.scorers.doctests: docstring examples run against generated bodies, in a subprocess."""

import inspect
import statistics
import textwrap

from lmforge.scorers import doctest_pass_rate, run_doctests


def _median_parts():
    src = textwrap.dedent(inspect.getsource(statistics.median))
    signature, _, rest = src.partition("\n")
    return signature, rest


def test_reference_passes_and_a_wrong_body_fails():
    signature, body = _median_parts()
    assert run_doctests("statistics", "median", signature + "\n" + body) == "PASS"
    assert run_doctests("statistics", "median", signature + "\n    return 42\n") == "FAIL"
    assert run_doctests("statistics", "median", signature + "\n    while True: pass\n", timeout=2) == "TIMEOUT"
    assert run_doctests("statistics", "median", "def median(:\n") == "FAIL"


def test_pass_rate_scores_only_functions_whose_reference_passes():
    signature, body = _median_parts()
    items = [{"name": "statistics:median", "signature": signature, "body": body},
             {"name": "statistics:NormalDist.mean", "signature": "def mean(self):", "body": "    return 0"},
             {"name": "statistics:median", "signature": signature, "body": body}]
    gens = [{"body": body, "stopped": True}, {"body": "    return 0", "stopped": True},
            {"body": "    return 1", "stopped": True}]
    r = doctest_pass_rate(items, gens)
    assert (r["n"], r["passed"]) == (2, 1)
