"""Running jobs, one sandboxed interpreter each: `_Worker` starts a fresh `python -I` running
`child.py` (in its own session, temporary folder and isolation, `isolate.py`), hands it its job on
stdin, reads its report from a private pipe and has `jobs.Judge` decide the verdict as lines
arrive, then kills its process group and removes its folder. `run_job` runs one job, `Pool` keeps
interpreters started ahead of their jobs, and `check_errors` refuses a batch whose share of the
harness's own faults (ERROR) passes MAX_ERROR_SHARE.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lmforge.sandbox.isolate import bwrap_probe, bwrap_args, isolation, isolation_line, network_isolation
from lmforge.sandbox.jobs import (FILE_BYTES, MEMORY_BYTES, TIMEOUT_S, Result, SandboxError, Judge, Plan, check_limits,
                                  plan_job)

#: The share of ERROR verdicts (the harness's own faults) a batch may have before it is refused.
MAX_ERROR_SHARE = 0.01
#: The most of a child's report the parent reads (a probe's cases travel on the pipe).
MESSAGE_BYTES = 16 << 20

#: The child's program (lmforge/sandbox/child.py), run with `python -I -c`.
_HARNESS = (Path(__file__).resolve().parent / "child.py").read_text(encoding="utf-8")


_isolation = isolation  # for the functions whose argument is named `isolation`


#: The interpreters started and not yet closed (a process forked from this one closes their pipes).
_WORKERS: "weakref.WeakSet[_Worker]" = weakref.WeakSet()


def _forget_workers() -> None:
    """In a process forked from this one (a reward of yours, `multiprocessing`): drop its copies of
    this one's pipes to the interpreters (a copy of a waiting interpreter's stdin would keep it
    from ever reading its job's end). The stdin's number is kept, on /dev/null, for its file object."""
    if not _WORKERS:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for worker in list(_WORKERS):
            stdin = worker.proc.stdin if worker.proc is not None else None
            with contextlib.suppress(OSError, ValueError):
                if stdin is not None and not stdin.closed:
                    os.dup2(null, stdin.fileno())
            with contextlib.suppress(OSError):
                if worker.read_fd >= 0:
                    os.close(worker.read_fd)
            worker.read_fd = -1
    finally:
        os.close(null)


os.register_at_fork(after_in_child=_forget_workers)


class _Worker:
    """One sandboxed interpreter, started and waiting for its job on stdin (its temporary folder,
    the read end of its report pipe, the nonce its lines must carry)."""

    def __init__(self, memory_bytes: int, how: str):
        self.started = time.perf_counter()
        self.timeout = TIMEOUT_S
        self.nonce = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.error = ""
        self.read_fd = -1
        self.folder = ""
        write_fd = -1
        _WORKERS.add(self)
        try:
            self.read_fd, write_fd = os.pipe()
            self.folder = tempfile.mkdtemp(prefix="lmforge-sandbox-")
            cmd = [sys.executable, "-I", "-c", _HARNESS, str(write_fd), str(int(memory_bytes)), str(FILE_BYTES)]
            if how == "bubblewrap":
                cmd = bwrap_args(bwrap_probe()[0], self.folder) + cmd
            elif network_isolation():
                cmd = network_isolation().split() + cmd
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, cwd=self.folder, env=env, pass_fds=(write_fd,),
                                         start_new_session=True)
        except OSError as exc:
            self.error = f"could not start the sandbox: {exc.strerror or exc}"
        except BaseException:
            self.close()
            raise
        finally:
            if write_fd >= 0:
                os.close(write_fd)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL its process group now, from any thread (whoever waits on it reaps it and closes it)."""
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def send(self, plan: Plan, timeout: float) -> None:
        """Hand the worker its job (the clock of its time limit starts here)."""
        self.started, self.timeout = time.perf_counter(), timeout
        if self.proc is None:
            return
        data = json.dumps({**plan.child, "nonce": self.nonce, "cpu_s": int(timeout) + 1}).encode()
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.close()
        except OSError:
            pass  # the child died before reading its job: its report (none) says so

    def wait(self, plan: Plan) -> Result:
        """The job's verdict, decided here from the child's report; the process group is killed
        as soon as it is decided, the folder removed."""
        try:
            verdict = ("ERROR", self.error, None) if self.proc is None else self._judge(plan)
        finally:
            self.close()
        return Result(verdict[0], str(verdict[1])[:200], time.perf_counter() - self.started, verdict[2])

    def _judge(self, plan: Plan) -> tuple:
        judge = Judge(plan)
        deadline = self.started + self.timeout
        poller = select.poll()
        poller.register(self.read_fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        buf, total = b"", 0
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                return self._timeout()
            if not poller.poll(max(1, int(left * 1000))):
                continue
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                break
            total += len(chunk)
            if total > MESSAGE_BYTES:
                what = "FAIL" if judge.ready else "ERROR"
                return what, f"the report passed {MESSAGE_BYTES >> 20} MiB {judge.progress}", None
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                try:
                    msg = json.loads(line)
                except (ValueError, RecursionError):
                    continue  # not a line of the harness's
                if not (isinstance(msg, list) and msg and msg[0] == self.nonce
                        and all(isinstance(x, str) for x in msg)):
                    continue
                decided = judge.feed(msg)
                if decided is not None:
                    return decided
        # the pipe closed without a decision: the process ended (or closed it)
        try:
            self.proc.wait(timeout=max(deadline - time.perf_counter(), 0.01))
        except subprocess.TimeoutExpired:
            return self._timeout()
        code = self.proc.returncode
        if not judge.ready:
            return "ERROR", f"the harness ended (exit status {code}) before the candidate ran", None
        for sig, what in ((signal.SIGXCPU, "TIMEOUT"), (signal.SIGKILL, "OOM")):
            if code in (-sig, 128 + sig):
                return what, f"killed by signal {sig} ({signal.Signals(sig).name}) {judge.progress}", None
        return "FAIL", f"the candidate ended the process (exit status {code}) {judge.progress}", None

    def _timeout(self) -> tuple:
        return "TIMEOUT", f"still running after {self.timeout:g} s (the process group was killed)", None

    def close(self) -> None:
        """Kill the worker's process group, reap it, close its pipes, remove its folder (idempotent)."""
        if self.proc is not None:
            if self.proc.returncode is None:
                _kill_group(self.proc)
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = ""


def run_job(job: dict, timeout: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES,
            isolation: str | None = None) -> Result:
    """Run one job in a fresh sandboxed interpreter and return its verdict (decided here, from
    what the interpreter reports).

    `job`: {"kind": "doctest" | "cases" | "probe", "source": the candidate (exactly one definition
    of `function`: anything else in it is a FAIL, never run), "function": its name, "module": the
    module it replaces the reference in ("" for none), "doc": the docstring whose examples to run
    (kind "doctest"; default the reference's), "cases": [[args, want] or [args, want, args_after]]
    (kind "cases": `args` the text of a tuple literal, `want` the repr of the value returned (an
    iterator: the list of what it yields) or "raise Name", `args_after` the repr of the arguments
    after the call), "probes": {name: [args, ...]} (kind "probe": no candidate; each of `module`'s
    functions `name` is called twice on each input, and `Result.data` is {name: [[args, want,
    args_after], ...]} for the inputs where both calls returned the same within "call_s" seconds
    (default 0.25))}. `timeout`: wall-clock seconds (the CPU limit is one more); `memory_bytes`:
    the address-space limit; `isolation`: "bubblewrap", "process" or None (see `isolation`).

    >>> from lmforge.sandbox import run_job
    >>> job = {"kind": "cases", "module": "", "function": "double",
    ...        "source": "def double(x):\\n    return 2 * x\\n", "cases": [["(3,)", "6"]]}
    >>> run_job(job).verdict
    'PASS'
    >>> run_job({**job, "cases": [["(3,)", "7"]]}).detail
    'case 1: got 6, expected 7'

    Raises:
        TypeError, ValueError: a malformed job or limit (the field and the value named), before
            any process starts.
        SandboxError: bubblewrap asked for and not available.
    """
    check_limits(timeout, memory_bytes)
    plan = plan_job(job)
    how = _isolation(isolation)
    if plan.kind == "doctest" and plan.expected == []:
        return Result("NODOC", "the docstring has no >>> examples", 0.0)
    worker = _Worker(memory_bytes, how)
    try:
        worker.send(plan, float(timeout))
    except BaseException:
        worker.close()
        raise
    return worker.wait(plan)


class Pool:
    """Sandboxed interpreters started ahead of their jobs, run `workers` at a time.

    A job's own run is a few ms; starting `python -I` (and bubblewrap) is most of what a fresh
    `run_job` takes. The pool keeps `workers` interpreters started and waiting (each still runs
    exactly one job, in its own folder: nothing carries over between jobs) and starts the next
    while a job runs. `map` returns the same verdicts `run_job` would, in order. Use it as a
    context manager, or call `close` (it kills the waiting interpreters and removes their folders).

    Raises (at construction):
        TypeError, ValueError: `workers` not an int >= 0, or limits `check_limits` refuses.
        SandboxError: bubblewrap asked for and not available.
    """

    def __init__(self, workers: int = 0, timeout: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES,
                 isolation: str | None = None):
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise TypeError(f"workers={workers!r}: expected an int (0: as many as the cores, at most 4)")
        if workers < 0:
            raise ValueError(f"workers={workers!r}: expected an int >= 0 (0: as many as the cores, at most 4)")
        check_limits(timeout, memory_bytes)
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self.timeout, self.memory_bytes = timeout, memory_bytes
        self.isolation = _isolation(isolation)
        self._ready: list[_Worker] = []
        self._running: dict[_Worker, threading.Event] = {}  # the interpreters running a job, by their map
        self._lock = threading.Lock()
        self._closed = False
        # bubblewrap's --die-with-parent follows the thread that started it: interpreters are
        # started by these threads, which live as long as the pool
        self._threads = ThreadPoolExecutor(self.workers, thread_name_prefix="lmforge-sandbox")

    def _take(self) -> _Worker:
        while True:
            with self._lock:
                worker = self._ready.pop() if self._ready else None
            if worker is None:
                return _Worker(self.memory_bytes, self.isolation)
            if worker.alive():
                return worker
            worker.close()  # died while it waited: not this job's fault

    def _refill(self) -> None:
        with self._lock:
            if self._closed or len(self._ready) >= self.workers:
                return
        worker = _Worker(self.memory_bytes, self.isolation)
        with self._lock:
            if not self._closed and len(self._ready) < self.workers:
                self._ready.append(worker)
                return
        worker.close()

    def _run(self, plan: Plan, timeout: float, stop: threading.Event) -> Result:
        if plan.kind == "doctest" and plan.expected == []:
            return Result("NODOC", "the docstring has no >>> examples", 0.0)
        if stop.is_set():  # the map was given up (a Ctrl-C): nothing more starts
            return Result("ERROR", "not run: the batch was interrupted", 0.0)
        worker = self._take()
        with self._lock:
            self._running[worker] = stop
        try:
            if stop.is_set():
                worker.close()
                return Result("ERROR", "not run: the batch was interrupted", 0.0)
            worker.send(plan, timeout)
            if not stop.is_set():
                self._refill()  # the next interpreter starts while this job runs
            return worker.wait(plan)
        finally:
            worker.close()
            with self._lock:
                self._running.pop(worker, None)

    def _give_up(self, stop: threading.Event) -> None:
        """Stop a map's jobs now: nothing more starts, the running interpreters' process groups are
        killed (their threads then see the pipe close and return at once)."""
        stop.set()
        with self._lock:
            running = [w for w, s in self._running.items() if s is stop]
        for worker in running:
            worker.kill()

    def map(self, jobs: Sequence[dict], timeout: float | None = None) -> list[Result]:
        """Every job's verdict, in order (at most `workers` run at once); `timeout`: wall-clock
        seconds of each of these jobs (default the pool's).

        Raises:
            TypeError, ValueError: a malformed job or timeout (all are checked before any runs).
            RuntimeError: the pool is closed.
        """
        if self._closed:
            raise RuntimeError("this sandbox pool is closed")
        timeout = self.timeout if timeout is None else timeout
        check_limits(timeout, self.memory_bytes)
        plans = [plan_job(j) for j in jobs]
        if not plans:
            return []
        stop = threading.Event()
        futures = [self._threads.submit(self._run, p, float(timeout), stop) for p in plans]
        try:
            return [f.result() for f in futures]
        except BaseException:  # a Ctrl-C (or a job's error): the others are stopped, not waited for
            for f in futures:
                f.cancel()
            self._give_up(stop)
            raise

    def close(self) -> None:
        """Kill the waiting interpreters and remove their folders, and the running ones (idempotent)."""
        with self._lock:
            self._closed = True
            ready, self._ready = self._ready, []
            running = list(self._running)
        for worker in ready:
            worker.close()
        for worker in running:
            worker.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def check_errors(results: list[Result], what: str) -> None:
    """Refuse a batch of verdicts whose ERROR share (the harness's own faults) passes MAX_ERROR_SHARE.

    Raises: SandboxError, naming the count, the share and the first reason."""
    errors = [r for r in results if r.verdict == "ERROR"]
    if results and len(errors) / len(results) > MAX_ERROR_SHARE:
        raise SandboxError(f"{what}: {len(errors)} of {len(results)} sandbox runs failed in the harness itself "
                           f"(first: {errors[0].detail}); above {MAX_ERROR_SHARE:.0%}, the scores cannot be trusted. "
                           f"Check that `{sys.executable} -I` starts here ({isolation_line()}).")


__all__ = ["MAX_ERROR_SHARE", "Pool", "check_errors", "run_job"]
