"""Scorers: checks that grade what a model wrote, below the stages, so that the speedrun's
summary, evaluation and (later) reinforcement-learning rewards share one implementation.

    python_bodies   a generated function body that parses under its signature and ends its
                    turn (`body_parse_rate`), and the held-out prompts it is asked for
    doctests        the function's own docstring examples run against the generated body in
                    lmforge.sandbox (`run_doctests`, `doctest_pass_rate`)
    static          the static check (parses, no text after the function, ends its turn, not
                    trivial, names resolve)
    behaviour       differential testing against the real function (the behaviour reward)
    rewards         the `rl.rewards` functions
    user_rewards    a reward of yours, imported and called guarded
"""

from lmforge.scorers.doctests import doctest_pass_rate, run_doctests
from lmforge.scorers.python_bodies import body_parse_rate, held_out_prompts

__all__ = ["body_parse_rate", "doctest_pass_rate", "held_out_prompts", "run_doctests"]
