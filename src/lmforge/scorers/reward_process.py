"""A reward of yours called in a process of its own (`RewardProcess`): forked from lmforge's at the
first call and kept for the run, so `rl.reward_timeout_s` holds whatever the reward does with
signals, exceptions, threads, `os._exit` or `fork` (the process group is killed at the limit).
`lmforge.scorers.rewards.Rewards` calls it; `user_rewards` imports the reward and checks what it
returned."""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import time
import weakref
from collections.abc import Callable

from lmforge.scorers.user_rewards import SIGNALS, Failure, describe, put_back, shown

_HEADER = struct.Struct("!Q")
#: The reward processes alive in this process (a process forked from it closes their pipes).
_PROCESSES: "weakref.WeakSet[RewardProcess]" = weakref.WeakSet()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _serve(fn: Callable, requests: int, replies: int) -> None:
    """The reward's process: each request (completions, prompts, fields) is one call of `fn`, its
    reply (kind, detail, the signals it received, the working folder it moved to) pickled back.
    SIGINT/SIGTERM are only recorded (lmforge's process decides: `Rewards`); a copy of this process
    that the reward forked and that returns here ends at once, unheard."""
    me = os.getpid()
    seen: list[int] = []

    def record(signum, frame):
        seen.append(signum)

    for s in SIGNALS:
        signal.signal(s, record)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the reward's to use as it likes
    while True:
        try:
            size = _HEADER.unpack(_read_exact(requests, _HEADER.size))[0]
            completions, prompts, fields = pickle.loads(_read_exact(requests, size))
        except EOFError:  # lmforge's process closed the pipe (it ended): so does this one
            return
        seen.clear()
        try:
            cwd: str | None = os.getcwd()
        except OSError:
            cwd = None
        try:
            out: tuple = ("value", fn(completions=completions, prompts=prompts, **fields))
        except SystemExit as exc:
            out = ("exit", exc.code)
        except KeyboardInterrupt:
            out = ("interrupt", None)
        except BaseException as exc:  # noqa: BLE001 - your code: every way out is reported
            out = ("raised", describe(exc))
        if os.getpid() != me:  # a forked copy returned from the reward: the call is the original's
            os._exit(0)
        for s in SIGNALS:
            signal.signal(s, record)
        moved = put_back(cwd)
        try:
            data = pickle.dumps((*out, list(seen), moved), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - a value that cannot be pickled (or whose pickling fails)
            data = pickle.dumps(("unsendable", shown(out[1]), list(seen), moved), protocol=pickle.HIGHEST_PROTOCOL)
        _write_all(replies, _HEADER.pack(len(data)) + data)


def _ended(status: int) -> str:
    """How a process ended, from its wait status."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}, e.g. os._exit"


class RewardProcess:
    """A reward of yours (`fn`) called in a process of its own: forked from lmforge's at the first
    call (the module as imported, its state as it is then) and kept for the next calls, in its own
    process group. `call` waits at most `limit_s` for the reply, then kills the group: a reward
    cannot outlive its limit, whatever it does with SIGALRM, timers, its handlers or `except:`.
    What it does to its process stays there: threads it leaves behind, the signals it sets, a fork
    (the copy that returns is ended), `os._exit` (the reward's process ends: a `Failure`). A call
    costs a pickled round trip on a pipe (~0.1 ms for a trivial reward's batch; the fork, once,
    a few ms).

    Not for a reward that uses CUDA when lmforge's process already has (a forked process cannot).
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        self.pid = 0
        self._requests = self._replies = self._pidfd = -1
        self._status: int | None = None
        self._finalizer: weakref.finalize | None = None

    def _start(self) -> None:
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the reward's process: never back into lmforge's code
            try:
                for other in list(_PROCESSES):
                    other._forget()
                os.close(requests_w)
                os.close(replies_r)
                try:
                    os.setpgid(0, 0)
                except OSError:
                    pass
                _serve(self.fn, requests_r, replies_w)
            finally:
                os._exit(0)
        os.close(requests_r)
        os.close(replies_w)
        try:
            os.setpgid(pid, pid)
        except OSError:  # it did it itself already, or it ended
            pass
        self.pid, self._requests, self._replies, self._status = pid, requests_w, replies_r, None
        try:
            self._pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd here: the wait polls
            self._pidfd = -1
        _PROCESSES.add(self)
        self._finalizer = weakref.finalize(self, _kill, pid, (requests_w, replies_r, self._pidfd))

    def call(self, completions: list, prompts: list, fields: dict, limit_s: float) -> tuple:
        """(kind, detail, signals received, working folder moved) of one call: kind "value" (detail:
        what it returned), "exit", "interrupt" (it raised KeyboardInterrupt), "raised" (its
        `describe` text) or "unsendable" (what it returned, as text).

        Raises:
            Failure: "timeout" (no reply within `limit_s`: the process group is killed) or "ended"
            (its process ended without a reply). Anything a signal handler of lmforge's raises
            while it waits (the process group is killed first).
        """
        if not self.pid:
            self._start()
        deadline = time.monotonic() + limit_s
        try:
            data = pickle.dumps((completions, prompts, fields), protocol=pickle.HIGHEST_PROTOCOL)
            self._send(_HEADER.pack(len(data)) + data, deadline, limit_s)
            size = _HEADER.unpack(self._receive(_HEADER.size, deadline, limit_s))[0]
            return pickle.loads(self._receive(size, deadline, limit_s))
        except BaseException:
            self.stop()
            raise

    def _wait(self, fd: int, events: int, deadline: float, limit_s: float) -> None:
        """Until `fd` is ready; Failure "timeout" past the deadline, "ended" once the process has."""
        poller = select.poll()
        poller.register(fd, events)
        if self._pidfd >= 0:
            poller.register(self._pidfd, select.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failure("timeout", limit_s)
            tick = left if self._pidfd >= 0 else min(left, 0.05)
            ready = dict(poller.poll(max(1, int(tick * 1000 + 1))))
            if ready.get(fd):
                return
            if self._exited():
                raise Failure("ended", _ended(self._status))

    def _exited(self) -> bool:
        if self._status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid:
                self._status = status
        return self._status is not None

    def _send(self, data: bytes, deadline: float, limit_s: float) -> None:
        view = memoryview(data)
        os.set_blocking(self._requests, False)
        while view:
            try:
                view = view[os.write(self._requests, view):]
            except BlockingIOError:
                self._wait(self._requests, select.POLLOUT, deadline, limit_s)
            except BrokenPipeError:
                raise self._gone() from None

    def _receive(self, n: int, deadline: float, limit_s: float) -> bytes:
        chunks, left = [], n
        while left:
            self._wait(self._replies, select.POLLIN, deadline, limit_s)
            chunk = os.read(self._replies, min(left, 1 << 20))
            if not chunk:
                raise self._gone()
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _gone(self) -> Failure:
        """The Failure of a process whose end of a pipe closed: it ended (its status, awaited briefly)."""
        end = time.monotonic() + 1.0
        while not self._exited() and time.monotonic() < end:
            time.sleep(0.01)
        return Failure("ended", _ended(self._status) if self._status is not None else "its pipe closed")

    def _forget(self) -> None:
        """Close this one's pipes (in a forked process: they are lmforge's process's)."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        for fd in (self._requests, self._replies, self._pidfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.pid, self._requests, self._replies, self._pidfd = 0, -1, -1, -1

    def stop(self) -> None:
        """Kill the reward's process group and reap it (idempotent; the next call forks anew)."""
        if not self.pid:
            return
        _PROCESSES.discard(self)
        _kill(self.pid, (), reap=False, leader=self._status is None)  # its group: what it forked too
        if self._status is None:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
        self._forget()


def _kill(pid: int, fds: tuple, reap: bool = True, leader: bool = True) -> None:
    """Close `fds`, SIGKILL the process group `pid` (and `pid` itself, unless reaped: `leader`)."""
    for fd in fds:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    for kill in (os.killpg, os.kill) if leader else (os.killpg,):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if reap:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


__all__ = ["RewardProcess"]
