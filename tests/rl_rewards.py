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
