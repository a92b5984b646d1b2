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

A reward of yours runs guarded (`_guarded`): each call may take `rl.reward_timeout_s` per
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

import importlib
import math
import numbers
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lmforge.data.prompts import Prompt
from lmforge.data.records import short
from lmforge.data.stdlib_functions import place_body
from lmforge.errors import ConfigError, Interrupted, LmforgeError
from lmforge.sandbox import Pool, Result
from lmforge.scorers.behaviour import Behaviour
from lmforge.scorers.doctests import doctest_job
from lmforge.scorers.static import static_verdict


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
        self.user: dict[str, Callable] = {n: _import(n) for n in self.names if ":" in n}
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
                out = _guarded(lambda: fn(completions=list(completions), prompts=[p.messages for p in prompts],
                                          **kwargs), limit)
                break
            except _Signalled as stop:  # the signal's doing, not the reward's: the handler in place decides
                if not stop.delivered:
                    _deliver(stop.signum)
                if attempt == 2:  # the call once more, after the signal: its result, or stop now (a second Ctrl-C)
                    if stop.result is _NOTHING:
                        raise Interrupted(stop.signum) from None
                    out = stop.result
            except _Failure as f:
                raise RewardError(self._failed(name, f, prompts[0].where, keys, n)) from None
        if not isinstance(out, (list, tuple)) or len(out) != n:
            raise RewardError(f"rl.rewards = {name!r} returned {type(out).__name__}"
                              f"{f' of {len(out)}' if isinstance(out, (list, tuple)) else ''}: expected a list of "
                              f"{n} numbers in [0, 1], one per completion.")
        values = []
        for i, v in enumerate(out):
            value, why = _as_reward(v)
            if why is not None:
                raise RewardError(f"rl.rewards = {name!r} returned {_shown(v)} for completion {i} (prompt "
                                  f"{prompts[i].where}): expected a number in [0, 1], or None where the reward "
                                  f"does not apply{why}.")
            values.append(value)
        return values

    def _failed(self, name: str, f: "_Failure", first: str, keys: list[str], n: int) -> str:
        """The message of a call of yours that failed (`_Failure`); `first`: where its first prompt is."""
        where = f"on a batch of {n} completions, first prompt {first}"
        if f.kind == "exit":
            return (f"rl.rewards = {name!r} called sys.exit({_shown(f.detail)}) ({where}): a reward returns its "
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
        return (f"rl.rewards = {name!r} raised {_describe(f.detail)} ({where}). Fix the function; it receives "
                f"completions=, prompts= and {keys} as keyword arguments.")


# -- running your code: the guard ----------------------------------------------------------------------
class _Timeout(BaseException):
    """Raised in a reward of yours by the timer (a BaseException: its `except Exception` lets it pass)."""


class _Failure(Exception):
    """What `_guarded` found wrong: `kind` "exit" (detail: the exit code), "timeout" (the limit, s),
    "chdir" ((before, after, what was done about it)) or "raised" (the exception)."""

    def __init__(self, kind: str, detail: object):
        super().__init__(kind)
        self.kind, self.detail = kind, detail


_NOTHING = object()


class _Signalled(Exception):
    """A SIGINT/SIGTERM arrived while your code ran, and the handler in place let it go on (a
    training loop records it and stops after the step): its result, if it returned one
    (`result`), may be what the signal left of it (its subprocesses got the Ctrl-C too).
    `delivered` says whether the handler has seen the signal (else `_deliver` hands it over: it
    raised KeyboardInterrupt of its own)."""

    def __init__(self, signum: int, delivered: bool, result: object = _NOTHING):
        super().__init__(signum)
        self.signum, self.delivered, self.result = int(signum), delivered, result


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _guarded(call: Callable[[], object], limit_s: float | None = None) -> object:
    """`call()` (your code), its result; the working folder, the SIGINT/SIGTERM/SIGALRM handlers and
    the real-time timer as they were afterwards, whatever it did.

    In the main thread a SIGINT/SIGTERM during the call goes on to the handler that was in place (the
    command line's raises Interrupted; a training loop's records it and finishes the step); `limit_s`
    arms a SIGALRM timer that raises `_Timeout` in the call (`signal.setitimer`; code stuck in native
    code that never returns to Python is not stopped). Outside the main thread neither applies.

    Raises:
        Interrupted / KeyboardInterrupt: what a signal's handler raised (the stop it asks for), even
        where the call swallowed it.
        _Signalled: a signal arrived during the call and its handler did not stop it (the call's
        result, if any, in `result`), or the call raised KeyboardInterrupt of its own.
        _Failure: it ran past `limit_s` (even if it swallowed the `_Timeout`), changed the working
        folder (put back), called sys.exit, or raised.
    """
    main = threading.current_thread() is threading.main_thread()
    seen: list[int] = []
    stops: list[BaseException] = []  # what the handlers in place raised: their decision to stop
    timer = {"armed": False, "fired": False}
    previous: dict = {}
    alarm, old_timer, t0 = None, (0.0, 0.0), time.monotonic()
    try:
        cwd: str | None = os.getcwd()
    except OSError:  # the current folder was removed: nothing to put back
        cwd = None
    if main:
        def forward(signum, frame):
            handler = previous[signum]
            if handler == signal.SIG_IGN:
                return
            seen.append(signum)
            if handler == signal.SIG_DFL:  # what would have happened: the default action
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
            elif callable(handler):
                try:
                    handler(signum, frame)
                except BaseException as exc:
                    stops.append(exc)
                    raise

        def expire(signum, frame):
            timer["fired"] = True
            if timer["armed"]:
                raise _Timeout

        for s in _SIGNALS:
            if signal.getsignal(s) is not None:  # None: installed outside Python, which cannot put it back
                previous[s] = signal.signal(s, forward)
        if limit_s and signal.getsignal(signal.SIGALRM) is not None:
            alarm = signal.signal(signal.SIGALRM, expire)
            old_timer = signal.setitimer(signal.ITIMER_REAL, limit_s)
    failure: BaseException | None = None
    result = None
    try:
        try:
            timer["armed"] = True
            result = call()
        finally:
            timer["armed"] = False
            if alarm is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as exc:  # noqa: BLE001 - your code: every way out is judged below
        failure = exc
    finally:
        if alarm is not None:
            signal.signal(signal.SIGALRM, alarm)
            if old_timer[0] > 0:  # someone else's timer: what it had left
                signal.setitimer(signal.ITIMER_REAL, max(old_timer[0] - (time.monotonic() - t0), 1e-6), old_timer[1])
        for s, handler in previous.items():
            signal.signal(s, handler)
        moved = _put_back(cwd)
    if stops:
        raise failure if failure is not None and any(failure is x for x in stops) else stops[0]
    if isinstance(failure, (KeyboardInterrupt, Interrupted)):  # its own: a Ctrl-C its code saw first
        raise _Signalled(seen[0] if seen else getattr(failure, "signum", signal.SIGINT), bool(seen)) from None
    if seen:  # what it did while the signal arrived may be the signal's doing (its subprocess got it too)
        raise _Signalled(seen[0], True, _NOTHING if failure is not None else result) from None
    if timer["fired"]:
        raise _Failure("timeout", limit_s)
    if moved:
        raise _Failure("chdir", moved)
    if isinstance(failure, SystemExit):
        raise _Failure("exit", failure.code)
    if failure is not None:
        raise _Failure("raised", failure)
    return result


def _put_back(cwd: str | None) -> tuple[str, str, str] | None:
    """The working folder `cwd` again if your code changed it: (before, after, what was done), or None."""
    if cwd is None:
        return None
    try:
        now = os.getcwd()
    except OSError:
        now = "a folder since removed"
    if now == cwd:
        return None
    try:
        os.chdir(cwd)
        done = "put it back"
    except OSError as exc:
        done = f"could not put it back ({exc.strerror})"
    return cwd, now, done


def _deliver(signum: int) -> None:
    """Hand a signal your code caught first (it raised KeyboardInterrupt) to the handler in place,
    as if it had arrived now: a training loop records it and stops after the step; the command
    line's handler raises Interrupted."""
    if threading.current_thread() is threading.main_thread():
        signal.raise_signal(signum)
    else:
        raise KeyboardInterrupt


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a __str__ that fails
        text = "(its message cannot be shown)"
    return f"{type(exc).__name__}: {text[:200]}"


def _as_reward(v: object) -> tuple[float | None, str | None]:
    """(v as a reward, None), or (None, why it is not one: "" or " (...)"): None, or a real number
    (int, float, numpy's, Fraction) in [0, 1]; never a bool."""
    if v is None:
        return None, None
    if isinstance(v, bool) or type(v).__name__ == "bool_":  # Python's or numpy's
        return None, " (a bool is not a number here: return 1.0 or 0.0)"
    if not isinstance(v, numbers.Real):
        return None, ""
    if isinstance(v, numbers.Integral):  # compared as it is: an int too large for a float is out of range too
        return (float(int(v)), None) if 0 <= v <= 1 else (None, "")
    try:
        x = float(v)
    except (OverflowError, ValueError, TypeError):
        return None, " (too large for a float)"
    if not math.isfinite(x):
        return None, " (it is not finite)"
    return (x, None) if 0 <= x <= 1 else (None, "")


def _shown(v: object) -> str:
    """`v` for a message: short, and never an error (an int of more digits than Python prints)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        try:
            return f"an integer of {len(str(abs(v)))} digits"
        except ValueError:
            return f"an integer of about {int(v.bit_length() * math.log10(2)) + 1} digits"
    try:
        return short(v)
    except Exception:  # noqa: BLE001 - a __repr__ that fails
        return f"a {type(v).__name__}"


#: The current folder as lmforge put it on sys.path (one entry at most, following the current folder).
_ADDED_TO_PATH: list[str] = []


def _current_folder_on_path() -> None:
    """The current folder on sys.path (last), where a user keeps `my_rewards.py` as a script would
    import it; nothing when it is there already ("" and "." included); the folder an earlier import
    put there is taken off, so sys.path never grows by more than one entry."""
    try:
        cwd = os.getcwd()
    except OSError:
        return
    here = os.path.realpath(cwd)
    for p in sys.path:
        if p in ("", ".") or (isinstance(p, str) and os.path.realpath(p) == here):
            return
    for p in _ADDED_TO_PATH:
        if p in sys.path:
            sys.path.remove(p)
    _ADDED_TO_PATH[:] = [cwd]
    sys.path.append(cwd)


def _import(spec: str) -> Callable:
    """The function `spec` names ("package.module:function"), found on sys.path or in the current
    folder (`_current_folder_on_path`), imported guarded (`_guarded`): a signal is the signal,
    sys.exit, a changed working folder or an exception is a ConfigError naming it."""
    module, _, name = (x.strip() for x in spec.partition(":"))
    _current_folder_on_path()
    importlib.invalidate_caches()  # a module written since the last import (a notebook, a test)
    fresh = module not in sys.modules
    try:  # your code: anything its import does is named, never a traceback
        mod = _guarded(lambda: importlib.import_module(module))
    except _Signalled as stop:  # imported while a signal its handler let go on arrived: the module as it is
        if not stop.delivered:
            _deliver(stop.signum)
        if stop.result is _NOTHING:
            raise Interrupted(stop.signum) from None
        mod = stop.result
    except _Failure as f:
        if fresh:  # imported, but refused: the next import runs it again
            sys.modules.pop(module, None)
        if f.kind == "exit":
            why = (f"importing {module!r} called sys.exit({_shown(f.detail)}). A module of rewards must not exit when "
                   f"imported: put a script's code under `if __name__ == \"__main__\":`.")
        elif f.kind == "chdir":
            why = (f"importing {module!r} changed the working folder from {f.detail[0]} to {f.detail[1]}; the "
                   f"run's relative paths need it as it was: lmforge {f.detail[2]} and stopped. Leave the working "
                   f"folder alone.")
        else:
            why = (f"cannot import {module!r} ({_describe(f.detail)}). Install it, put its folder on PYTHONPATH or "
                   f"run from the folder that holds it.")
        raise ConfigError(f"rl.rewards = {spec!r}: {why}") from None
    fn = getattr(mod, name, None)
    if fn is None:
        raise ConfigError(f"rl.rewards = {spec!r}: module {module!r} has no {name!r}.")
    if not callable(fn):
        raise ConfigError(f"rl.rewards = {spec!r} is {type(fn).__name__}, not a function.")
    return fn


__all__ = ["SANDBOXED", "RewardError", "Rewards", "Scored"]
