"""Moved: `lmforge.scorers.doctests` (scorers live below the stages). Kept so that imports of
`lmforge.stages.sft_checks` go on working."""

from lmforge.scorers.doctests import doctest_pass_rate, run_doctests

__all__ = ["doctest_pass_rate", "run_doctests"]
