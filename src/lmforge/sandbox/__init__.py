"""Running generated Python that nobody has read: a verdict the candidate cannot forge.

Defence in depth, NOT a security boundary. A determined attacker with a Python interpreter can
escape any in-process guard; what this module guarantees is that the ordinary failures of model-
written code (an endless loop, a huge list, a stray file write, a printed "PASS", a call of the
reference it should replace) are scored as what they are and leave nothing behind. Run untrusted
code from outside your machine in a container or a VM, not here.

What `run_job` does (human-eval's `execution.py` and nanochat's `execution.py` did parts of it;
both say they are not sandboxes either):

- a fresh interpreter (`python -I`: no user site, no current folder on sys.path), in its own
  session and process group (a timeout kills the whole group, grandchildren included), in a
  fresh temporary folder (deleted after), with a scrubbed environment (PATH, LANG) and stdin
  closed; without network where the machine allows an unprivileged user namespace
  (`unshare -rn`, `network_isolation()` says whether it is in use);
- resource limits: address space (`memory_bytes`), CPU seconds, file size (1 MiB), open files
  (64), processes, no core file;
- an audit hook (PEP 578; it cannot be removed once added) installed before the candidate's
  code is compiled, refusing sockets, subprocesses, exec / fork / spawn / kill, ctypes, frame
  and garbage-collector introspection, and any write, rename or removal outside the folder;
- the verdict travels on a private pipe, tagged with a nonce the parent made and the child
  reads before the candidate exists; stdout, stderr and exit codes are never read as a pass;
- the candidate replaces the reference in its module (`setattr(module, name, candidate)`)
  before any test runs, so `from difflib import ndiff` inside the body is the candidate.

Verdicts: PASS, FAIL (wrong, raised, did not compile, did something refused, ended the process),
TIMEOUT (wall clock or CPU limit), OOM (MemoryError, or killed at the memory limit), ERROR (the
harness's own fault: it never started, or broke; never silently a 0 — callers count ERRORs and
`check_errors` refuses a batch whose share passes MAX_ERROR_SHARE); a doctest job whose
docstring has no examples is NODOC.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from lmforge.errors import LmforgeError

VERDICTS = ("PASS", "FAIL", "TIMEOUT", "OOM", "ERROR")
#: The share of ERROR verdicts (the harness's own faults) a batch may have before it is refused.
MAX_ERROR_SHARE = 0.01
#: Default limits of one job.
TIMEOUT_S = 5.0
MEMORY_BYTES = 1 << 30
FILE_BYTES = 1 << 20
#: The most of a child's messages the parent keeps (a probe's cases travel on the pipe).
MESSAGE_BYTES = 16 << 20


class SandboxError(LmforgeError):
    """The sandbox itself failed too often to trust the scores."""


@dataclass(frozen=True)
class Result:
    """One job's verdict (one of VERDICTS), a one-line reason, the wall-clock seconds, and what a
    "probe" job found (`run_job`)."""

    verdict: str
    detail: str
    seconds: float
    data: object = None


#: The child's program (lmforge/sandbox/child.py), run with `python -I -c`.
_HARNESS = (Path(__file__).resolve().parent / "child.py").read_text(encoding="utf-8")


@functools.cache
def network_isolation() -> str:
    """"unshare -rn" when an unprivileged user namespace without network can be made here (the
    child then has no network at all), else "" (the audit hook still refuses sockets)."""
    unshare = shutil.which("unshare")
    if not unshare:
        return ""
    try:
        ok = subprocess.run([unshare, "-rn", "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return f"{unshare} -rn" if ok else ""


def isolation_line() -> str:
    """One line saying how generated code is run (for a command's start-up report)."""
    net = "no network (user namespace)" if network_isolation() else "network not removed (no user namespace here; " \
                                                                    "sockets refused by the audit hook)"
    return f"sandbox: generated code runs in a fresh `python -I` with limits, an audit hook and {net}"


class _Worker:
    """One sandboxed interpreter, started and waiting for its job on stdin (its temporary folder,
    the read end of its verdict pipe drained by a thread, the nonce its messages must carry)."""

    def __init__(self, timeout: float, memory_bytes: int):
        self.timeout, self.memory_bytes = timeout, memory_bytes
        self.started = time.perf_counter()
        self.nonce = secrets.token_hex(16)
        self.data = bytearray()
        self.proc: subprocess.Popen | None = None
        self.error = ""
        read_fd, write_fd = os.pipe()
        self.read_fd = read_fd
        self.folder = tempfile.mkdtemp(prefix="lmforge-sandbox-")
        cmd = [sys.executable, "-I", "-c", _HARNESS, str(write_fd), repr(float(timeout)), str(int(memory_bytes)),
               str(FILE_BYTES)]
        if network_isolation():
            cmd = network_isolation().split() + cmd
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, cwd=self.folder, env=env, pass_fds=(write_fd,),
                                         start_new_session=True)
        except OSError as exc:
            self.error = f"could not start the sandbox: {exc.strerror}"
        finally:
            os.close(write_fd)
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        # read the verdict pipe while the child runs (a big message must not fill the pipe and stall it)
        while True:
            try:
                chunk = os.read(self.read_fd, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            if len(self.data) < MESSAGE_BYTES:
                self.data += chunk

    def send(self, job: dict) -> None:
        """Hand the worker its job (the clock of its time limit starts here)."""
        self.started = time.perf_counter()
        if self.proc is None:
            return
        try:
            self.proc.stdin.write(json.dumps({**job, "nonce": self.nonce}).encode())
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # the child died before reading its job: its exit status says why

    def wait(self) -> Result:
        """The job's verdict; the process group is killed and the folder removed."""
        killed = False
        try:
            if self.proc is None:
                return Result("ERROR", self.error, time.perf_counter() - self.started)
            try:
                self.proc.wait(timeout=max(self.timeout - (time.perf_counter() - self.started), 0.01))
            except subprocess.TimeoutExpired:
                killed = True
            _kill_group(self.proc)  # on a timeout, and anything the child left running in its group
            self.reader.join(timeout=2.0)
        finally:
            self.close()
        seconds = time.perf_counter() - self.started
        messages = _messages(bytes(self.data), self.nonce)
        ready = any(m.get("ready") for m in messages)
        final = next((m for m in messages if "verdict" in m), None)
        if killed:
            return Result("TIMEOUT", f"still running after {self.timeout:g} s (the process group was killed)", seconds)
        if final is not None and final["verdict"] in (*VERDICTS, "NODOC"):
            return Result(final["verdict"], str(final.get("detail", ""))[:200], seconds, final.get("data"))
        code = self.proc.returncode
        if code in (-signal.SIGXCPU, -signal.SIGKILL) and ready:
            what = "TIMEOUT" if code == -signal.SIGXCPU else "OOM"
            return Result(what, f"killed by signal {-code} ({signal.Signals(-code).name})", seconds)
        if ready:
            return Result("FAIL", f"the candidate ended the process (exit status {code}) before a verdict", seconds)
        return Result("ERROR", f"the harness ended (exit status {code}) before the candidate ran", seconds)

    def close(self) -> None:
        """Kill the worker if it still runs; remove its folder; close the pipe (idempotent)."""
        if self.proc is not None and self.proc.returncode is None:
            _kill_group(self.proc)
            self.reader.join(timeout=2.0)
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = ""
        if self.read_fd >= 0 and not self.reader.is_alive():
            os.close(self.read_fd)
            self.read_fd = -1


def run_job(job: dict, timeout: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES) -> Result:
    """Run one job in a fresh sandboxed interpreter and return its verdict.

    `job`: {"kind": "doctest" | "cases" | "probe", "source": the candidate (a module defining
    `function`), "function": its name, "module": the module it replaces the reference in ("" for
    none), "doc": the docstring whose examples to run (kind "doctest"; default the reference's),
    "cases": [[args, want] or [args, want, args_after]] (kind "cases": `args` a Python literal of
    a tuple, `want` the repr of the value returned (an iterator: the list of what it yields) or
    "raise Name", `args_after` the repr of the arguments after the call), "probes": {name: [args,
    ...]} (kind "probe": no candidate; each of `module`'s functions `name` is called twice on each
    input, and `Result.data` is {name: [[args, want, args_after], ...]} for the inputs where both
    calls returned the same within "call_s" seconds (default 0.25))}. `timeout`: wall-clock
    seconds; `memory_bytes`: the address-space limit.
    """
    worker = _Worker(timeout, memory_bytes)
    worker.send(job)
    return worker.wait()


class Pool:
    """Sandboxed interpreters started ahead of their jobs, run `workers` at a time.

    A job's own run is ~10 ms; starting `python -I` is most of the ~70 ms a fresh `run_job`
    takes. The pool keeps `workers` interpreters started and waiting (each still runs exactly one
    job, in its own folder: nothing carries over between jobs) and starts the next while a job
    runs. `map` returns the same verdicts `run_job` would, in order. Use it as a context manager,
    or call `close` (it kills the waiting interpreters and removes their folders).
    """

    def __init__(self, workers: int = 0, timeout: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES):
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self.timeout, self.memory_bytes = timeout, memory_bytes
        self._ready: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    def _take(self) -> _Worker:
        with self._lock:
            worker = self._ready.pop() if self._ready else None
        return worker or _Worker(self.timeout, self.memory_bytes)

    def _refill(self) -> None:
        with self._lock:
            if self._closed or len(self._ready) >= self.workers:
                return
        worker = _Worker(self.timeout, self.memory_bytes)
        with self._lock:
            if not self._closed and len(self._ready) < self.workers:
                self._ready.append(worker)
                return
        worker.close()

    def _run(self, job: dict, timeout: float | None = None) -> Result:
        if timeout is not None and timeout != self.timeout:  # other limits: an interpreter of its own
            return run_job(job, timeout, self.memory_bytes)
        worker = self._take()
        worker.send(job)
        self._refill()  # the next interpreter starts while this job runs
        return worker.wait()

    def map(self, jobs: Sequence[dict], timeout: float | None = None) -> list[Result]:
        """Every job's verdict, in order (at most `workers` run at once); `timeout`: wall-clock
        seconds of each of these jobs (default the pool's)."""
        if not jobs:
            return []
        if self._closed:
            raise RuntimeError("this sandbox pool is closed")
        if len(jobs) == 1 or self.workers == 1:
            return [self._run(j, timeout) for j in jobs]
        with ThreadPoolExecutor(self.workers) as ex:
            return list(ex.map(lambda j: self._run(j, timeout), jobs))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            ready, self._ready = self._ready, []
        for worker in ready:
            worker.close()

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
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _messages(data: bytes, nonce: str) -> list[dict]:
    """The child's messages that carry the parent's nonce (anything else on the pipe is ignored)."""
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(msg, dict) and msg.get("nonce") == nonce:
            out.append(msg)
    return out


def check_errors(results: list[Result], what: str) -> None:
    """Refuse a batch of verdicts whose ERROR share (the harness's own faults) passes MAX_ERROR_SHARE.

    Raises:
        SandboxError: naming the count, the share and the first reason.
    """
    errors = [r for r in results if r.verdict == "ERROR"]
    if results and len(errors) / len(results) > MAX_ERROR_SHARE:
        raise SandboxError(f"{what}: {len(errors)} of {len(results)} sandbox runs failed in the harness itself "
                           f"(first: {errors[0].detail}); above {MAX_ERROR_SHARE:.0%}, the scores cannot be trusted. "
                           f"Check that `{sys.executable} -I` starts here.")


__all__ = ["MAX_ERROR_SHARE", "Pool", "Result", "SandboxError", "VERDICTS", "check_errors", "isolation_line",
           "network_isolation", "run_job"]
