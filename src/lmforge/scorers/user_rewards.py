"""Running a reward of yours (`rl.rewards = "package.module:function"`) guarded: importing it
(`import_reward`, in lmforge's process, `guarded`; the current folder goes on sys.path only when the
module is found there and nowhere else, `current_folder_on_path`), calling it in a process of its
own (`scorers/reward_process.py`: forked from lmforge's at the first call and kept for the run, so a
time limit holds whatever the reward does with signals, exceptions, threads, `os._exit` or `fork`),
and checking what it returned (`as_reward`).
`lmforge.scorers.rewards.Rewards` turns what goes wrong here into one RewardError naming the reward."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import math
import numbers
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from lmforge.data.records import short
from lmforge.errors import ConfigError, Interrupted


class Timeout(BaseException):
    """Raised in a reward of yours by the timer (a BaseException: its `except Exception` lets it pass)."""


class Failure(Exception):
    """What `guarded` or `RewardProcess.call` found wrong: `kind` "exit" (detail: the exit code),
    "timeout" (the limit, s), "chdir" ((before, after, what was done about it)), "raised" (the
    exception, or its `describe` text), "ended" (how the reward's process ended: it called os._exit
    or was killed) or "unsendable" (what it returned, which cannot be passed back: its text)."""

    def __init__(self, kind: str, detail: object):
        super().__init__(kind)
        self.kind, self.detail = kind, detail


NOTHING = object()


class Signalled(Exception):
    """A SIGINT/SIGTERM arrived while your code ran, and the handler in place let it go on (a
    training loop records it and stops after the step): its result, if it returned one
    (`result`), may be what the signal left of it (its subprocesses got the Ctrl-C too).
    `delivered` says whether the handler has seen the signal (else `deliver` hands it over: it
    raised KeyboardInterrupt of its own)."""

    def __init__(self, signum: int, delivered: bool, result: object = NOTHING):
        super().__init__(signum)
        self.signum, self.delivered, self.result = int(signum), delivered, result


SIGNALS = (signal.SIGINT, signal.SIGTERM)


def guarded(call: Callable[[], object], limit_s: float | None = None) -> object:
    """`call()` (your code), its result; the working folder, the SIGINT/SIGTERM/SIGALRM handlers and
    the real-time timer as they were afterwards, whatever it did.

    In the main thread a SIGINT/SIGTERM during the call goes on to the handler that was in place (the
    command line's raises Interrupted; a training loop's records it and finishes the step); `limit_s`
    arms a SIGALRM timer that raises `Timeout` in the call (`signal.setitimer`; code stuck in native
    code that never returns to Python is not stopped). Outside the main thread neither applies.

    Raises:
        Interrupted / KeyboardInterrupt: what a signal's handler raised (the stop it asks for), even
        where the call swallowed it.
        Signalled: a signal arrived during the call and its handler did not stop it (the call's
        result, if any, in `result`), or the call raised KeyboardInterrupt of its own.
        Failure: it ran past `limit_s` (even if it swallowed the `Timeout`), changed the working
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
        alarm, old_timer = _take_signals(limit_s, seen, stops, timer, previous)
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
        moved = put_back(cwd)
    return _verdict(result, failure, stops, seen, timer["fired"], limit_s, moved)


def _take_signals(limit_s: float | None, seen: list[int], stops: list[BaseException], timer: dict,
                  previous: dict) -> tuple[object, tuple[float, float]]:
    """`guarded`'s handlers, in the main thread: SIGINT/SIGTERM go on to the handlers in place
    (kept in `previous`; the signals in `seen`, what the handlers raised in `stops`); with
    `limit_s`, SIGALRM raises Timeout while `timer["armed"]` (`timer["fired"]` set) and the timer
    is armed. Returns (the SIGALRM handler replaced, or None: none installed; the real-time timer
    replaced: (seconds left, interval))."""
    alarm, old_timer = None, (0.0, 0.0)

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
            raise Timeout

    for s in SIGNALS:
        if signal.getsignal(s) is not None:  # None: installed outside Python, which cannot put it back
            previous[s] = signal.signal(s, forward)
    if limit_s and signal.getsignal(signal.SIGALRM) is not None:
        alarm = signal.signal(signal.SIGALRM, expire)
        old_timer = signal.setitimer(signal.ITIMER_REAL, limit_s)
    return alarm, old_timer


def _verdict(result: object, failure: BaseException | None, stops: list[BaseException], seen: list[int],
             fired: bool, limit_s: float | None, moved: tuple[str, str, str] | None) -> object:
    """`guarded`'s judgement once all is put back: the stop a handler asked for, Signalled,
    Failure (in that order of precedence), or the call's `result`."""
    if stops:
        raise failure if failure is not None and any(failure is x for x in stops) else stops[0]
    if isinstance(failure, (KeyboardInterrupt, Interrupted)):  # its own: a Ctrl-C its code saw first
        raise Signalled(seen[0] if seen else getattr(failure, "signum", signal.SIGINT), bool(seen)) from None
    if seen:  # what it did while the signal arrived may be the signal's doing (its subprocess got it too)
        raise Signalled(seen[0], True, NOTHING if failure is not None else result) from None
    if fired:
        raise Failure("timeout", limit_s)
    if moved:
        raise Failure("chdir", moved)
    if isinstance(failure, SystemExit):
        raise Failure("exit", failure.code)
    if failure is not None:
        raise Failure("raised", failure)
    return result


def put_back(cwd: str | None) -> tuple[str, str, str] | None:
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


def deliver(signum: int) -> None:
    """Hand a signal your code caught first (it raised KeyboardInterrupt) to the handler in place,
    as if it had arrived now: a training loop records it and stops after the step; the command
    line's handler raises Interrupted."""
    if threading.current_thread() is threading.main_thread():
        signal.raise_signal(signum)
    else:
        raise KeyboardInterrupt


def describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a __str__ that fails
        text = "(its message cannot be shown)"
    return f"{type(exc).__name__}: {text[:200]}"


def as_reward(v: object) -> tuple[float | None, str | None]:
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


def shown(v: object) -> str:
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


#: The current folder as lmforge put it on sys.path (one entry at most: the last folder it was needed for).
_ADDED_TO_PATH: list[str] = []


def current_folder_on_path(module: str) -> None:
    """The current folder on sys.path (last), where a user keeps `my_rewards.py` as a script would
    import it, only when `module`'s top-level name is found there and not already imported or
    found on sys.path: importing a reward again, or one on PYTHONPATH, leaves sys.path as it is.
    The folder an earlier import put there is taken off, so sys.path never grows by more than one
    entry. Nothing is imported here (the top-level name is looked up by the finders only)."""
    top = module.partition(".")[0]
    if not top or top in sys.modules:
        return
    try:
        found = importlib.util.find_spec(top)
        if found is not None and found.origin is not None:  # on sys.path ("" and "." are the current folder)
            return  # (origin None: only a namespace package's folder, which a module here would win over)
        cwd = os.getcwd()
    except (ImportError, ValueError, OSError):  # a finder that fails, a folder since removed: the import says why
        return
    if importlib.machinery.PathFinder.find_spec(top, [cwd]) is None:
        return
    for p in _ADDED_TO_PATH:
        if p in sys.path:
            sys.path.remove(p)
    _ADDED_TO_PATH[:] = [cwd]
    sys.path.append(cwd)


def import_reward(spec: str) -> Callable:
    """The function `spec` names ("package.module:function"), found on sys.path or in the current
    folder (`current_folder_on_path`), imported guarded (`guarded`): a signal is the signal,
    sys.exit, a changed working folder or an exception is a ConfigError naming it."""
    module, _, name = (x.strip() for x in spec.partition(":"))
    importlib.invalidate_caches()  # a module written since the last import (a notebook, a test)
    current_folder_on_path(module)
    fresh = module not in sys.modules
    try:  # your code: anything its import does is named, never a traceback
        mod = guarded(lambda: importlib.import_module(module))
    except Signalled as stop:  # imported while a signal its handler let go on arrived: the module as it is
        if not stop.delivered:
            deliver(stop.signum)
        if stop.result is NOTHING:
            raise Interrupted(stop.signum) from None
        mod = stop.result
    except Failure as f:
        if fresh:  # imported, but refused: the next import runs it again
            sys.modules.pop(module, None)
        if f.kind == "exit":
            why = (f"importing {module!r} called sys.exit({shown(f.detail)}). A module of rewards must not exit when "
                   f"imported: put a script's code under `if __name__ == \"__main__\":`.")
        elif f.kind == "chdir":
            why = (f"importing {module!r} changed the working folder from {f.detail[0]} to {f.detail[1]}; the "
                   f"run's relative paths need it as it was: lmforge {f.detail[2]} and stopped. Leave the working "
                   f"folder alone.")
        else:
            why = (f"cannot import {module!r} ({describe(f.detail)}). Install it, put its folder on PYTHONPATH or "
                   f"run from the folder that holds it.")
        raise ConfigError(f"rl.rewards = {spec!r}: {why}") from None
    fn = getattr(mod, name, None)
    if fn is None:
        raise ConfigError(f"rl.rewards = {spec!r}: module {module!r} has no {name!r}.")
    if not callable(fn):
        raise ConfigError(f"rl.rewards = {spec!r} is {type(fn).__name__}, not a function.")
    return fn


__all__ = ["Failure", "NOTHING", "SIGNALS", "Signalled", "Timeout", "as_reward", "deliver", "describe", "guarded",
           "import_reward", "put_back", "shown"]
