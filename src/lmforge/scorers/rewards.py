"""Rewards for reinforcement learning: functions over (prompt record, completion) -> a number in
[0, 1], or None where the reward does not apply to the prompt (TRL's convention); verifiable
and offline.

    static     `scorers.static`: the body parses under its signature, ends its turn, is not
               trivial, reads a parameter, every name it loads resolves (in process, µs)
    doctests   the function's own `>>>` examples pass, the body replacing the reference in its
               module, in `lmforge.sandbox` (~30 ms a completion on a pre-started interpreter); 0
               for a body the static check already refuses (it is not run)
    behaviour  `scorers.behaviour`: the body returns what the real function returns on its
               doctest arguments, their mutations and small typed pools (EvalPlus-style
               differential testing), in the sandbox; None for a function it cannot call
               (a method, inputs that are not literals); 0 for a body the static check refuses
    yours      "package.module:function" (on PYTHONPATH, or a module in the current folder),
               called as TRL calls a reward function:
               f(completions=[text, ...], prompts=[[{role, content}, ...], ...], **fields), each
               extra field of the prompt records as a list (one value per completion); it returns
               one number in [0, 1] (or None: does not apply) per completion

A reward of yours runs guarded (`guarded`): each call may take `rl.reward_timeout_s` per
completion (a SIGALRM timer, in the main thread); a call that exceeds it, calls sys.exit (or
does so while it is imported), changes the working folder (put back at once), raises, or returns
anything but numbers in [0, 1] or None stops the run with a RewardError naming it. A SIGINT or
SIGTERM is never its error: while it runs the signal goes to the handler in place (a training
loop finishes its step, writes a checkpoint and says how to resume); a call during which the
signal arrived (or that raised KeyboardInterrupt of its own) may hold what the signal did to it
(its subprocesses got the Ctrl-C too), so it is made once more, after the signal, and the step
finishes with that call's numbers; if that one fails too, the run stops at once, as on a second
Ctrl-C.

A completion's reward is the mean of the rewards that apply to it (0 when none does); a
completion cut off by the token budget scores 0 whatever the functions say (`score`).
Sandbox ERRORs (the harness's own faults) are never a silent 0: `score` counts them and
`sandbox.check_errors` refuses a step where they pass 1%.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lmforge.data.prompts import Prompt
from lmforge.data.stdlib_functions import place_body
from lmforge.errors import Interrupted, LmforgeError
from lmforge.sandbox import Pool, Result
from lmforge.scorers.behaviour import Behaviour
from lmforge.scorers.doctests import doctest_job
from lmforge.scorers.static import static_verdict
from lmforge.scorers.user_rewards import NOTHING, Failure, Signalled, as_reward, deliver, describe, guarded, \
    import_reward, shown


#: The rewards that run generated code in the sandbox.
SANDBOXED = frozenset({"doctests", "behaviour"})


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
    """The rewards of a batch of completions: `total` (R,) the mean over the reward functions that
    apply (0 for a completion cut off, or when none applies), `each` {name: (R,) floats, None
    where it does not apply}, the sandbox `results`, and per completion the static check's reason
    ("" = passed)."""

    total: list[float]
    each: dict[str, list[float | None]]
    results: list[Result] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)


class Rewards:
    """The rewards `rl.rewards` names, built once (a function of your own is imported here).

    Raises:
        ConfigError: a "module:function" that cannot be imported or is not callable, or whose import
        calls sys.exit or changes the working folder.
        Interrupted: a SIGINT/SIGTERM while it is imported.
    """

    def __init__(self, names: Sequence[str], timeout_s: float = 5.0):
        self.names = list(names)
        self.timeout_s = timeout_s
        self.user: dict[str, Callable] = {n: import_reward(n) for n in self.names if ":" in n}
        self._pool: Pool | None = None
        self._behaviour: Behaviour | None = None

    @property
    def pool(self) -> Pool:
        """The sandbox's pre-started interpreters (started on first use)."""
        if self._pool is None:
            self._pool = Pool(timeout=self.timeout_s)
        return self._pool

    def close(self) -> None:
        """Stop the sandbox's waiting interpreters."""
        if self._pool is not None:
            self._pool.close()
            self._pool, self._behaviour = None, None

    def static_reasons(self, prompts: Sequence[Prompt], completions: Sequence[str],
                       stopped: Sequence[bool]) -> list[str]:
        """Per completion the static check's reason ("" = passed, or no signature to check)."""
        return [static_verdict(p.fields["signature"], c, s, p.fields.get("module", "")).reason
                if "signature" in p.fields else "" for p, c, s in zip(prompts, completions, stopped)]

    def behaviour(self, prompts: Sequence[Prompt], completions: Sequence[str],
                  reasons: Sequence[str]) -> tuple[list[float | None], list[Result]]:
        """The behaviour reward (None where it does not apply) and its sandbox results; a body the
        static check refused (`reasons[i]` not "") scores 0 without running."""
        if self._behaviour is None:
            self._behaviour = Behaviour(self.pool)
        return self._behaviour.score(prompts, completions, [not why for why in reasons])

    def score(self, prompts: Sequence[Prompt], completions: Sequence[str], stopped: Sequence[bool]) -> Scored:
        """Score R completions (`prompts[i]` is completion i's prompt).

        Raises:
            RewardError: a reward of yours raised, called sys.exit, changed the working folder, ran
            past rl.reward_timeout_s per completion or returned something else than rewards; a
            prompt without the fields a built-in reward reads.
            Interrupted / KeyboardInterrupt: a signal's handler stopped the call (see the module).
        """
        # the static check once per completion: the static reward, and the gate of the sandboxed rewards
        reasons = self.static_reasons(prompts, completions, stopped)
        each: dict[str, list[float | None]] = {}
        results: list[Result] = []
        for name in self.names:
            if name == "static":
                for p in prompts:  # every prompt carries what the check reads, or the run stops naming it
                    _fields(p, ("signature",), "static")
                each[name] = [0.0 if why else 1.0 for why in reasons]
            elif name == "doctests":
                jobs, where = [], []
                for i, (p, c, s, why) in enumerate(zip(prompts, completions, stopped, reasons)):
                    module, qualname, signature = _fields(p, ("module", "qualname", "signature"), "doctests")
                    if not why and s:
                        jobs.append(doctest_job(module, qualname, place_body(signature, c)))
                        where.append(i)
                each[name] = [0.0] * len(completions)
                for i, r in zip(where, self.pool.map(jobs)):
                    results.append(r)
                    each[name][i] = 1.0 if r.verdict == "PASS" else 0.0
            elif name == "behaviour":
                for p in prompts:
                    _fields(p, ("module", "qualname", "signature", "reference"), "behaviour")
                each[name], found = self.behaviour(prompts, completions, reasons)
                results += found
            else:
                each[name] = self._call(name, prompts, completions)
        total = []
        for i, s in enumerate(stopped):
            got = [each[n][i] for n in self.names if each[n][i] is not None]
            total.append(sum(got) / len(got) if s and got else 0.0)
        return Scored(total, each, results, reasons)

    def _call(self, name: str, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float | None]:
        keys = sorted({k for p in prompts for k in p.fields})
        kwargs = {k: [p.fields.get(k) for p in prompts] for k in keys}
        fn, n = self.user[name], len(completions)
        limit = self.timeout_s * n
        for attempt in (1, 2):
            try:
                out = guarded(lambda: fn(completions=list(completions), prompts=[p.messages for p in prompts],
                                          **kwargs), limit)
                break
            except Signalled as stop:  # the signal's doing, not the reward's: the handler in place decides
                if not stop.delivered:
                    deliver(stop.signum)
                if attempt == 2:  # the call once more, after the signal: its result, or stop now (a second Ctrl-C)
                    if stop.result is NOTHING:
                        raise Interrupted(stop.signum) from None
                    out = stop.result
            except Failure as f:
                raise RewardError(self._failed(name, f, prompts[0].where, keys, n)) from None
        if not isinstance(out, (list, tuple)) or len(out) != n:
            raise RewardError(f"rl.rewards = {name!r} returned {type(out).__name__}"
                              f"{f' of {len(out)}' if isinstance(out, (list, tuple)) else ''}: expected a list of "
                              f"{n} numbers in [0, 1], one per completion.")
        values = []
        for i, v in enumerate(out):
            value, why = as_reward(v)
            if why is not None:
                raise RewardError(f"rl.rewards = {name!r} returned {shown(v)} for completion {i} (prompt "
                                  f"{prompts[i].where}): expected a number in [0, 1], or None where the reward "
                                  f"does not apply{why}.")
            values.append(value)
        return values

    def _failed(self, name: str, f: "Failure", first: str, keys: list[str], n: int) -> str:
        """The message of a call of yours that failed (`Failure`); `first`: where its first prompt is."""
        where = f"on a batch of {n} completions, first prompt {first}"
        if f.kind == "exit":
            return (f"rl.rewards = {name!r} called sys.exit({shown(f.detail)}) ({where}): a reward returns its "
                    f"numbers and must not end the process. Remove the call (an exception it raises is reported "
                    f"here, naming it).")
        if f.kind == "timeout":
            return (f"rl.rewards = {name!r} did not return within {f.detail:g} s (rl.reward_timeout_s = "
                    f"{self.timeout_s:g} s per completion, {n} completions; first prompt {first}). "
                    f"Make it faster, or raise rl.reward_timeout_s.")
        if f.kind == "chdir":
            return (f"rl.rewards = {name!r} changed the working folder from {f.detail[0]} to {f.detail[1]} "
                    f"({where}); the run's relative paths need it as it was: lmforge {f.detail[2]} and stopped. "
                    f"Leave the working folder alone (use absolute paths, or subprocess's cwd=).")
        return (f"rl.rewards = {name!r} raised {describe(f.detail)} ({where}). Fix the function; it receives "
                f"completions=, prompts= and {keys} as keyword arguments.")


__all__ = ["SANDBOXED", "RewardError", "Rewards", "Scored"]
