"""The rewards of reinforcement learning (`rl.rewards`): lmforge's own, each a plain function with
the signature of a reward of yours (TRL's), the table `REWARDS` that names them, and `Rewards`,
which calls the ones a run names (yours imported and guarded) and combines their numbers.

Every reward, lmforge's or yours, is called as TRL calls a reward function:

    f(completions=[text, ...], prompts=[[{role, content}, ...], ...], **fields) -> list[float | None]

`fields`: each extra field of the prompt records as a list, one value per completion (None where
a record has none). It returns one number in [0, 1] per completion, or None where the reward does
not apply to it (TRL's convention). lmforge's own also get `stopped` (per completion: the model
ended its turn, what TRL's `completion_ids` tell) and `sandbox` (a `Sandbox`: where generated
code runs); copy one as the template of yours. Verifiable and offline:

    parses     the body parses under its signature as that one function and ends its turn (a
               format reward, as TRL's think_format_reward; the speedrun's SFT figure; in
               process, µs)
    static     `scorers.static`: parses, ends its turn, is not trivial, reads a parameter, every
               name it loads resolves (in process, µs)
    doctests   the function's own `>>>` examples pass, the body replacing the reference in its
               module, in `lmforge.sandbox` (~30 ms a completion on a pre-started interpreter); 0
               for a body the static check refuses (it is not run); None for a method
    behaviour  `scorers.behaviour`: the body returns what the real function returns on its
               doctest arguments, their mutations and small typed pools (EvalPlus-style
               differential testing), in the sandbox; None for a function it cannot call
               (a method, inputs that are not literals); 0 for a body the static check refuses
    yours      "package.module:function" (on PYTHONPATH, or a module in the current folder)

A new one of lmforge's: a function here, a row in `REWARDS` (the fields it reads), its name in
`config.RL_REWARDS`; tests/test_rl_rewards.py runs the examples of its docstring.

A reward of yours is imported guarded (`user_rewards.guarded`) and called in a process of its own
(`reward_process.RewardProcess`, which says what the reward cannot escape there): each call may take
`rl.reward_timeout_s` per completion, after which its process group is killed. A call that exceeds the
limit, calls sys.exit (or does so while it is imported), ends its process (os._exit), changes the
working folder (put back at once), raises, or returns anything but numbers in [0, 1] or None stops
the run with a RewardError naming it. A prompt field named `completions` or `prompts` is the data
file's error (a DataError naming the prompt). A SIGINT or SIGTERM is never its error: one sent to
lmforge goes to the handler in place (a training loop finishes its step, writes a checkpoint and
says how to resume) while the reward runs on undisturbed; one its own process received (or a
KeyboardInterrupt it raised) is handed to that handler and the call is made once more, the step
finishing with that call's numbers; if that one fails too, the run stops at once, as on a second
Ctrl-C. Names spelled twice (spaces aside, or two names of one function) are refused.

A completion's reward is the mean of the rewards that apply to it (0 when none does); a
completion cut off by the token budget scores 0 whatever the functions say (`Rewards.score`).
Sandbox ERRORs (the harness's own faults) are never a silent 0: `score` returns them and
`sandbox.check_errors` refuses a step where they pass 1%.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from lmforge.data.prompts import RESERVED_FIELDS, Prompt
from lmforge.data.stdlib_functions import place_body
from lmforge.errors import ConfigError, DataError, Interrupted, LmforgeError
from lmforge.sandbox import Pool, Result
from lmforge.scorers.behaviour import Behaviour
from lmforge.scorers.doctests import doctest_job
from lmforge.scorers.static import parse_body, static_verdict
from lmforge.scorers.reward_process import RewardProcess
from lmforge.scorers.user_rewards import Failure, as_reward, deliver, describe, import_reward, shown


class RewardError(LmforgeError):
    """A reward function that cannot be loaded, raises, or returns something that is not a reward."""


class Sandbox:
    """Where lmforge's rewards run generated code, shared over a run: pre-started interpreters
    (`pool`, started on first use; `timeout_s` per job), the behaviour cases found so far
    (`behaviour`), and the `results` of the jobs run since `Rewards.score` last emptied it."""

    def __init__(self, timeout_s: float = 5.0):
        self.timeout_s = timeout_s
        self.results: list[Result] = []
        self._pool: Pool | None = None
        self._behaviour: Behaviour | None = None

    @property
    def pool(self) -> Pool:
        if self._pool is None:
            self._pool = Pool(timeout=self.timeout_s)
        return self._pool

    @property
    def behaviour(self) -> Behaviour:
        if self._behaviour is None:
            self._behaviour = Behaviour(self.pool)
        return self._behaviour

    def run(self, jobs: Sequence[dict]) -> list[Result]:
        """The jobs' results, in order (kept in `results` too)."""
        found = self.pool.map(jobs)
        self.results += found
        return found

    def close(self) -> None:
        """Stop the waiting interpreters (a later job starts new ones)."""
        if self._pool is not None:
            self._pool.close()
            self._pool, self._behaviour = None, None


def static_reasons(completions: Sequence[str], signature: Sequence[str | None], stopped: Sequence[bool],
                   module: Sequence[str | None] | None = None) -> list[str]:
    """Per completion the first check of `scorers.static.static_verdict` it fails ("" = passed, or
    no signature to check); `module` None: builtins only."""
    module = module or [None] * len(completions)
    return [static_verdict(sig, c, s, m or "").reason if sig is not None else ""
            for c, sig, s, m in zip(completions, signature, stopped, module)]


# -- lmforge's rewards: each one is what a reward of yours looks like ----------------------------------
def parses(completions, prompts, signature, stopped, **fields):
    """1.0 where the body parses under its signature as that one function and the model ended its
    turn (`scorers.static.parse_body`), else 0.0.

    >>> prompts = [[{"role": "user", "content": "def add(a, b):"}]] * 3
    >>> parses(["    return a + b", "    return (a +", "    return a + b"], prompts,
    ...        signature=["def add(a, b):"] * 3, stopped=[True, True, False])
    [1.0, 0.0, 0.0]
    """
    return [1.0 if s and parse_body(sig, c)[0] is not None else 0.0
            for c, sig, s in zip(completions, signature, stopped)]


def static(completions, prompts, signature, stopped, module=None, **fields):
    """1.0 where the body passes the static check (`scorers.static`: parses, ends its turn, is not
    trivial, reads a parameter, every name it loads resolves in its `module`), else 0.0.

    >>> prompts = [[{"role": "user", "content": "def add(a, b):"}]] * 3
    >>> static(["    return a + b", "    pass", "    return a + c"], prompts,
    ...        signature=["def add(a, b):"] * 3, stopped=[True] * 3)
    [1.0, 0.0, 0.0]
    """
    return [0.0 if why else 1.0 for why in static_reasons(completions, signature, stopped, module)]


def doctests(completions, prompts, module, qualname, signature, stopped, sandbox, **fields):
    """1.0 where the function's own docstring examples pass with the body in place of the
    reference (`scorers.doctests`, in `sandbox`), else 0.0 (they fail, or the function has none,
    or the static check refuses the body: it is not run); None for a method (only a top-level
    function can be replaced in its module).

    >>> prompts = [[{"role": "user", "content": "def median(data):"}]] * 3
    >>> sandbox = Sandbox()
    >>> doctests(["    s = sorted(data); n = len(s); return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2",
    ...           "    return sorted(data)[len(data) // 2]", "    return 3"], prompts,
    ...          module=["statistics"] * 3, qualname=["median"] * 3, signature=["def median(data):"] * 3,
    ...          stopped=[True] * 3, sandbox=sandbox)
    [1.0, 0.0, 0.0]
    >>> sandbox.close()
    """
    out: list[float | None] = [None if "." in q else 0.0 for q in qualname]
    why = static_reasons(completions, signature, stopped, module)
    todo = [i for i, v in enumerate(out) if v is not None and not why[i]]  # a cut-off body's reason is "cut off"
    ran = sandbox.run([doctest_job(module[i], qualname[i], place_body(signature[i], completions[i])) for i in todo])
    for i, r in zip(todo, ran):
        out[i] = 1.0 if r.verdict == "PASS" else 0.0
    return out


def behaviour(completions, prompts, module, qualname, signature, reference, stopped, sandbox, **fields):
    """1.0 where the body returns what the real function returns on the behaviour cases
    (`scorers.behaviour`, in `sandbox`; the cases come from the docstring in the prompt's last
    turn, found once per function and run), else 0.0 (or the static check refuses the body: it is
    not run); None for a function without cases (a method, inputs that are not literals).

    >>> right = "    s = sorted(data); n = len(s); return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2"
    >>> doc = "def median(data):\\n    '''\\n    >>> median([1, 3, 5])\\n    3\\n    '''"
    >>> prompts = [[{"role": "user", "content": "Write the body of this Python function:\\n" + doc}]] * 2
    >>> sandbox = Sandbox()
    >>> behaviour([right, "    return sorted(data)[len(data) // 2]"], prompts, module=["statistics"] * 2,
    ...           qualname=["median"] * 2, signature=["def median(data):"] * 2, reference=[right] * 2,
    ...           stopped=[True] * 2, sandbox=sandbox)
    [1.0, 0.0]
    >>> sandbox.close()
    """
    records = [Prompt(list(p), f"{m}:{q}", f"{m}:{q}", {"module": m, "qualname": q, "signature": s, "reference": r})
               for p, m, q, s, r in zip(prompts, module, qualname, signature, reference)]
    why = static_reasons(completions, signature, stopped, module)
    values, found = sandbox.behaviour.score(records, completions, [not w for w in why])
    sandbox.results += found
    return values


class Reward(NamedTuple):
    """A row of `REWARDS`: the function, the prompt fields it reads (a prompt without one stops
    the run, naming it), and whether it runs generated code in the sandbox."""

    function: Callable[..., list]
    reads: tuple[str, ...]
    sandboxed: bool = False


#: lmforge's rewards by their name in `rl.rewards` (config.RL_REWARDS lists the same names).
REWARDS: dict[str, Reward] = {
    "static": Reward(static, ("signature",)),
    "doctests": Reward(doctests, ("module", "qualname", "signature"), sandboxed=True),
    "behaviour": Reward(behaviour, ("module", "qualname", "signature", "reference"), sandboxed=True),
    "parses": Reward(parses, ("signature",)),
}
#: The rewards that run generated code in the sandbox.
SANDBOXED = frozenset(n for n, r in REWARDS.items() if r.sandboxed)


def _fields(prompt: Prompt, names: tuple[str, ...], reward: str) -> None:
    missing = [n for n in names if n not in prompt.fields]
    if missing:
        raise RewardError(f"rl.rewards = {reward!r} reads the field(s) {missing} of each prompt, and {prompt.where} "
                          f"has none (it has {sorted(prompt.fields)}). Use rl.data = \"stdlib\", add the fields, or "
                          f"choose another reward.")


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
    """The rewards `rl.rewards` names, built once: lmforge's from `REWARDS`, a function of yours
    imported here (`user`).

    Raises:
        ConfigError: a name that is neither in `REWARDS` nor "module:function"; a "module:function"
        that cannot be imported or is not callable, or whose import calls sys.exit or changes the
        working folder.
        Interrupted: a SIGINT/SIGTERM while it is imported.
    """

    def __init__(self, names: Sequence[str], timeout_s: float = 5.0):
        self.names = list(names)
        self.timeout_s = timeout_s
        for n in self.names:
            if ":" not in n and n not in REWARDS:
                raise ConfigError(f"rl.rewards names {n!r}: expected one of {sorted(REWARDS)} or "
                                  f"\"package.module:function\" (a function of your own). Fix rl.rewards.")
        spelled: dict[str, str] = {}
        for n in self.names:  # "m:f", "m: f" and " m:f" are one reward: listed twice, as "m:f" twice is
            key = ":".join(part.strip() for part in n.split(":", 1))
            if key in spelled:
                raise ConfigError(f"rl.rewards = {self.names}: {spelled[key]!r} and {n!r} are the same reward "
                                  f"(spaces aside); list each once.")
            spelled[key] = n
        self.user: dict[str, Callable] = {n: import_reward(n) for n in self.names if ":" in n}
        same = {}
        for n, fn in self.user.items():  # two names of one function ("pkg.m:f" and "pkg:f", its re-export)
            if id(fn) in same:
                raise ConfigError(f"rl.rewards = {self.names}: {same[id(fn)]!r} and {n!r} name the same function; "
                                  f"it would be called and counted twice. List it once.")
            same[id(fn)] = n
        self._processes = {n: RewardProcess(fn) for n, fn in self.user.items()}  # each forked at its first call
        self.sandbox = Sandbox(timeout_s)

    @property
    def _behaviour(self) -> Behaviour | None:
        """The behaviour cases found so far, or None (bench/bench_rl.py reads them here)."""
        return self.sandbox._behaviour

    def close(self) -> None:
        """Stop the sandbox's waiting interpreters and the processes of your rewards (a later
        call starts them again)."""
        for process in self._processes.values():
            process.stop()
        self.sandbox.close()

    def static_reasons(self, prompts: Sequence[Prompt], completions: Sequence[str],
                       stopped: Sequence[bool]) -> list[str]:
        """Per completion the static check's reason ("" = passed, or no signature to check)."""
        return static_reasons(completions, [p.fields.get("signature") for p in prompts], stopped,
                              [p.fields.get("module") for p in prompts])

    def behaviour(self, prompts: Sequence[Prompt], completions: Sequence[str],
                  reasons: Sequence[str]) -> tuple[list[float | None], list[Result]]:
        """The behaviour reward (None where it does not apply) and its sandbox results; a body the
        static check refused (`reasons[i]` not "") scores 0 without running."""
        return self.sandbox.behaviour.score(prompts, completions, [not why for why in reasons])

    def score(self, prompts: Sequence[Prompt], completions: Sequence[str], stopped: Sequence[bool]) -> Scored:
        """Score R completions (`prompts[i]` is completion i's prompt): each reward in the order
        `rl.rewards` names them, checked, then their mean per completion.

        Raises:
            RewardError: a reward of yours raised, called sys.exit, changed the working folder, ran
            past rl.reward_timeout_s per completion or returned something else than rewards; a
            prompt without the fields one of lmforge's reads.
            Interrupted / KeyboardInterrupt: a signal's handler stopped the call (see the module).
        """
        reasons = self.static_reasons(prompts, completions, stopped)
        self.sandbox.results = []
        for p in prompts:  # what every reward's call already passes: the data's field cannot be passed too
            taken = sorted(set(p.fields) & set(RESERVED_FIELDS))
            if taken:
                raise DataError(f"{p.where}: the prompt has a field named {taken[0]!r}, the name of what every reward "
                                f"receives ({', '.join(f'{k}=' for k in RESERVED_FIELDS)}); a reward cannot get both. "
                                f"Rename the field in the prompts file.")
        keys = sorted({k for p in prompts for k in p.fields})
        fields = {k: [p.fields.get(k) for p in prompts] for k in keys}
        each: dict[str, list[float | None]] = {}
        for name in self.names:
            if name in self.user:
                out = self._call_yours(name, prompts, completions, fields)
            else:
                reward = REWARDS[name]
                for p in prompts:  # every prompt carries what it reads, or the run stops naming it
                    _fields(p, reward.reads, name)
                out = reward.function(list(completions), [p.messages for p in prompts],
                                      **{**fields, "stopped": list(stopped), "sandbox": self.sandbox})
            each[name] = self._checked(name, out, prompts)
        total = []
        for i, s in enumerate(stopped):
            got = [each[n][i] for n in self.names if each[n][i] is not None]
            total.append(sum(got) / len(got) if s and got else 0.0)
        return Scored(total, each, self.sandbox.results, reasons)

    def _checked(self, name: str, out: object, prompts: Sequence[Prompt]) -> list[float | None]:
        """`out` as rewards: one number in [0, 1] or None per completion, else a RewardError."""
        n = len(prompts)
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

    def _call_yours(self, name: str, prompts: Sequence[Prompt], completions: Sequence[str], fields: dict) -> object:
        """What a reward of yours returned, called in its process (the module docstring)."""
        n = len(completions)
        limit = self.timeout_s * n
        for attempt in (1, 2):
            try:
                kind, detail, seen, moved = self._processes[name].call(
                    list(completions), [p.messages for p in prompts], fields, limit)
            except Failure as f:
                raise RewardError(self._failed(name, f, prompts[0].where, sorted(fields), n)) from None
            try:
                if kind == "interrupt" or seen:  # a signal its process received: the run's, as a Ctrl-C here
                    deliver(seen[0] if seen else signal.SIGINT)  # the handler in place decides (it may raise)
                    if attempt == 1:
                        continue  # the call once more, after the signal
                    if kind != "value":  # failed again after the signal: stop now, as on a second Ctrl-C
                        raise Interrupted(seen[0] if seen else signal.SIGINT)
                if moved:
                    raise Failure("chdir", moved)
                if kind == "value":
                    return detail
                raise Failure(kind, detail)
            except Failure as f:
                raise RewardError(self._failed(name, f, prompts[0].where, sorted(fields), n)) from None
        raise AssertionError("unreachable")

    def _failed(self, name: str, f: Failure, first: str, keys: list[str], n: int) -> str:
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
        if f.kind == "ended":
            return (f"rl.rewards = {name!r} ended the process it runs in ({f.detail}) ({where}): a reward returns "
                    f"its numbers and must not end its process (os._exit, a signal to itself). Remove the call "
                    f"(an exception it raises is reported here, naming it).")
        if f.kind == "unsendable":
            return (f"rl.rewards = {name!r} returned {f.detail} ({where}), which cannot be passed back from the "
                    f"process it runs in (pickled): expected a list of {n} numbers in [0, 1] or None.")
        raised = f.detail if isinstance(f.detail, str) else describe(f.detail)
        return (f"rl.rewards = {name!r} raised {raised} ({where}). Fix the function; it receives "
                f"completions=, prompts= and {keys} as keyword arguments.")


__all__ = ["REWARDS", "SANDBOXED", "Reward", "RewardError", "Rewards", "Sandbox", "Scored", "behaviour", "doctests",
           "parses", "static", "static_reasons"]
