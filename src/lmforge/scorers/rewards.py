"""Rewards for reinforcement learning: functions over (prompt record, completion) -> a number in
[0, 1], verifiable and offline.

    static     `scorers.static`: the body parses under its signature, ends its turn, is not
               trivial, reads a parameter, every name it loads resolves (in process, µs)
    doctests   the function's own `>>>` examples pass, the body replacing the reference in its
               module, in `lmforge.sandbox` (~70 ms a completion); 0 for a body the static check
               already refuses (it is not run)
    yours      "package.module:function" (on PYTHONPATH, or a module in the current folder),
               called as TRL calls a reward function:
               f(completions=[text, ...], prompts=[[{role, content}, ...], ...], **fields), each
               extra field of the prompt records as a list (one value per completion); it returns
               one number in [0, 1] per completion

A completion cut off by the token budget scores 0 whatever the function says (`score`).
Sandbox ERRORs (the harness's own faults) are never a silent 0: `score` counts them and
`sandbox.check_errors` refuses a step where they pass 1%.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lmforge.data.prompts import Prompt
from lmforge.errors import ConfigError, LmforgeError
from lmforge.sandbox import Result, run_job
from lmforge.scorers.static import static_verdict

class RewardError(LmforgeError):
    """A reward function that cannot be loaded, raises, or returns something that is not a reward."""


def _fields(prompt: Prompt, names: tuple[str, ...], reward: str) -> list:
    missing = [n for n in names if n not in prompt.fields]
    if missing:
        raise RewardError(f"rl.rewards = {reward!r} reads the field(s) {missing} of each prompt, and {prompt.where} "
                          f"has none (it has {sorted(prompt.fields)}). Use rl.data = \"stdlib\", add the fields, or "
                          f"choose another reward.")
    return [prompt.fields[n] for n in names]


@dataclass
class Scored:
    """The rewards of a batch of completions: `total` (R,) the mean over the reward functions (0
    for a completion cut off), `each` {name: (R,)}, the sandbox `results`, and per completion the
    static check's reason ("" = passed)."""

    total: list[float]
    each: dict[str, list[float]]
    results: list[Result] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)


class Rewards:
    """The rewards `rl.rewards` names, built once (a function of your own is imported here).

    Raises:
        ConfigError: a "module:function" that cannot be imported or is not callable.
    """

    def __init__(self, names: Sequence[str], timeout_s: float = 5.0):
        self.names = list(names)
        self.timeout_s = timeout_s
        self.user: dict[str, Callable] = {n: _import(n) for n in self.names if ":" in n}

    def score(self, prompts: Sequence[Prompt], completions: Sequence[str], stopped: Sequence[bool]) -> Scored:
        """Score R completions (`prompts[i]` is completion i's prompt)."""
        # the static check once per completion: the static reward, and the gate of the doctests reward
        reasons = [static_verdict(p.fields["signature"], c, s, p.fields.get("module", "")).reason
                   if "signature" in p.fields else "" for p, c, s in zip(prompts, completions, stopped)]
        each: dict[str, list[float]] = {}
        results: list[Result] = []
        for name in self.names:
            if name == "static":
                for p in prompts:  # every prompt carries what the check reads, or the run stops naming it
                    _fields(p, ("signature",), "static")
                each[name] = [0.0 if why else 1.0 for why in reasons]
            elif name == "doctests":
                each[name] = []
                for p, c, s, why in zip(prompts, completions, stopped, reasons):
                    module, qualname, signature = _fields(p, ("module", "qualname", "signature"), "doctests")
                    if why or not s:
                        each[name].append(0.0)
                        continue
                    r = run_job({"kind": "doctest", "module": module, "function": qualname,
                                 "source": signature + "\n" + c + "\n"}, timeout=self.timeout_s)
                    results.append(r)
                    each[name].append(1.0 if r.verdict == "PASS" else 0.0)
            else:
                each[name] = self._call(name, prompts, completions)
        total = [0.0 if not s else sum(each[n][i] for n in self.names) / len(self.names)
                 for i, s in enumerate(stopped)]
        return Scored(total, each, results, reasons)

    def _call(self, name: str, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        keys = sorted({k for p in prompts for k in p.fields})
        kwargs = {k: [p.fields.get(k) for p in prompts] for k in keys}
        try:
            out = self.user[name](completions=list(completions), prompts=[p.messages for p in prompts], **kwargs)
        except Exception as exc:
            raise RewardError(f"rl.rewards = {name!r} raised {type(exc).__name__}: {str(exc)[:200]} (on a batch of "
                              f"{len(completions)} completions, first prompt {prompts[0].where}). Fix the function; "
                              f"it receives completions=, prompts= and {keys} as keyword arguments.") from None
        if not isinstance(out, (list, tuple)) or len(out) != len(completions):
            raise RewardError(f"rl.rewards = {name!r} returned {type(out).__name__}"
                              f"{f' of {len(out)}' if isinstance(out, (list, tuple)) else ''}: expected a list of "
                              f"{len(completions)} numbers in [0, 1], one per completion.")
        for i, v in enumerate(out):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1:
                raise RewardError(f"rl.rewards = {name!r} returned {v!r} for completion {i} (prompt "
                                  f"{prompts[i].where}): expected a number in [0, 1].")
        return [float(v) for v in out]


def _import(spec: str) -> Callable:
    """The function `spec` names ("package.module:function"), found on sys.path or in the current
    folder (where a user keeps `my_rewards.py`, as a script would import it)."""
    module, _, name = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:  # your code: anything its import raises is named, never a traceback
        mod = importlib.import_module(module.strip())
    except Exception as exc:
        raise ConfigError(f"rl.rewards = {spec!r}: cannot import {module.strip()!r} ({type(exc).__name__}: {exc}). "
                          f"Install it, put its folder on PYTHONPATH or run from the folder that holds it.") from None
    fn = getattr(mod, name.strip(), None)
    if fn is None:
        raise ConfigError(f"rl.rewards = {spec!r}: module {module.strip()!r} has no {name.strip()!r}.")
    if not callable(fn):
        raise ConfigError(f"rl.rewards = {spec!r} is {type(fn).__name__}, not a function.")
    return fn


__all__ = ["RewardError", "Rewards", "Scored"]
