"""Scorers: checks that grade what a model wrote, below the stages, so that the speedrun's
summary, evaluation and reinforcement learning's rewards share one implementation.

    python_bodies   a generated function body that parses under its signature and ends its
                    turn (`body_parse_rate`), and the held-out prompts it is asked for
    doctests        the function's own docstring examples run against the generated body in
                    lmforge.sandbox (`run_doctests`, `doctest_pass_rate`)
    static          the static check (parses, no text after the function, ends its turn, not
                    trivial, names resolve)
    behaviour       differential testing against the real function (the behaviour reward)
    rewards         the `rl.rewards`: lmforge's reward functions (a user's signature, TRL's), their
                    table `REWARDS`, and `Rewards`, which calls those a run names and averages them
    user_rewards    a reward of yours: imported guarded, called in a process of its own
    intervals       the Wilson interval of a rate over few samples
"""

from lmforge.scorers.doctests import doctest_pass_rate, run_doctests
from lmforge.scorers.python_bodies import body_parse_rate, held_out_prompts

__all__ = ["body_parse_rate", "doctest_pass_rate", "held_out_prompts", "run_doctests"]
