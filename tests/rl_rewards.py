"""Reward functions of "a user's own" for tests/test_rl.py (TRL's calling convention)."""


def short(completions, prompts, **fields):
    """1 for a completion of at most 8 characters: what a random tiny model can learn in a step."""
    return [1.0 if len(c) <= 8 else 0.0 for c in completions]


def by_field(completions, prompts, target, **fields):
    """1 when the completion starts with the prompt record's `target` field."""
    return [1.0 if c.startswith(t) else 0.0 for c, t in zip(completions, target)]


def raises(completions, prompts, **fields):
    raise KeyError("answer")


def not_numbers(completions, prompts, **fields):
    return ["yes"] * len(completions)


def too_few(completions, prompts, **fields):
    return [0.5]


# -- hostile rewards (tests/test_rl_inputs.py) ---------------------------------------------------
#: calls of `hostile` so far; PLAN[n]: what its n-th call does first (1 is the stage's check
#: before training, 2 the first step's rollouts, ...), a function of the completions whose
#: result, when not None, is what the call returns. Both set by the tests.
CALLS: dict = {"hostile": 0}
PLAN: dict = {}
#: A file `hostile` appends a line to on each call, when set: a reward runs in a process of its own
#: (forked at its first call), so CALLS counts there, not in the test's process.
CALLS_FILE = None


def hostile(completions, prompts, **fields):
    """`short`'s rewards, but its n-th call first does PLAN[n](completions)."""
    CALLS["hostile"] += 1
    if CALLS_FILE is not None:
        with open(CALLS_FILE, "a") as f:
            f.write(f"{CALLS['hostile']}\n")
    action = PLAN.get(CALLS["hostile"])
    if action is not None:
        out = action(completions)
        if out is not None:
            return out
    return short(completions, prompts)


def fractional(completions, prompts, **fields):
    """Rewards that are not 0 or 1, None on every fifth completion: a mean whose rounding shows the
    order it was summed in (tests/test_rl_rewards.py compares the combined rewards bit for bit)."""
    return [None if i % 5 == 4 else ((3 * i) % 7) / 7 for i in range(len(completions))]
