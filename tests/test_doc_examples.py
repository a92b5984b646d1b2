"""The `>>>` examples in the docstrings of the entry points a newcomer reads first run as written
(issue 47): each object listed here has at least one example, and every example passes."""

from __future__ import annotations

import doctest

import pytest

from lmforge import sandbox
from lmforge.train.trainer import Trainer

#: Objects whose docstring carries a runnable example.
DOCUMENTED = [sandbox.run_job, Trainer]


@pytest.mark.parametrize("obj", DOCUMENTED, ids=lambda o: f"{o.__module__}.{o.__qualname__}")
def test_docstring_examples_run(obj):
    tests = doctest.DocTestFinder(recurse=False).find(obj, obj.__qualname__, globs={})
    assert sum(len(t.examples) for t in tests) > 0, f"{obj.__qualname__} has no >>> example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for t in tests:
        runner.run(t)
    assert runner.failures == 0, f"{runner.failures} example(s) of {obj.__qualname__} failed (output above)"
