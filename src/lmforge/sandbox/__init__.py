"""Running generated Python that nobody has read: a verdict the candidate cannot reach.

The verdict is decided in lmforge's own process. The interpreter that runs the candidate gets
only what it must run (the candidate's source, the arguments of each case, the sources of the
docstring examples), never an expected result; it reports what it observed (the repr of each
value returned and of the arguments after the call, the name of an exception, an example's
output) on a private pipe, and lmforge compares. Whatever a body does inside its process (patch
the harness, its builtins or its modules, reach a frame, leave a thread, an atexit callback or a
finalizer behind, print a verdict) changes at most what is reported about itself: it passes only
by producing what the reference produces.

What `run_job` does (human-eval's `execution.py` and nanochat's `execution.py` did parts of it;
both say they are not sandboxes either):

- a fresh interpreter (`python -I`: no user site, no current folder on sys.path), in its own
  session and process group, in a fresh temporary folder (deleted after), with a scrubbed
  environment (PATH, LANG) and stdin closed; inside bubblewrap where it works here
  (`isolation()` says "bubblewrap": the root read-only, a private /tmp with only the job's folder
  writable, no network, its own PID and IPC namespaces, killed with its parent), else a plain
  process ("process": without network where an unprivileged user namespace can be made,
  `network_isolation()`);
- resource limits: address space (`memory_bytes`), CPU seconds, file size (1 MiB), open files
  (64), no new process or thread (for a user other than root), no core file;
- an audit hook (PEP 578; it cannot be removed, and it is never switched off) installed before
  the candidate's code is compiled, refusing sockets, subprocesses, exec / fork / spawn / kill,
  ctypes, frame and garbage-collector introspection, tracing and profiling hooks, another audit
  hook, and any write, rename or removal outside the folder; its state is out of the body's reach;
- the candidate's source must be exactly one definition of the function (anything after the
  body, even a decorator, is refused before it runs) and replaces the reference in its module
  (`setattr(module, name, candidate)`) before any test runs, so `from difflib import ndiff`
  inside the body is the candidate; the reference's own code becomes a call of the candidate
  (its other names, such as another module's import of it, included) and its module's code
  may not run again (a reload would bring the reference back);
- the report travels on a private pipe, each line tagged with a nonce the parent made and the
  child reads from stdin; stdout, stderr and exit codes are never read as a pass; the process
  group is killed as soon as the report decides, and the child ends itself with `os._exit`
  after its report (no atexit, finalizer or thread runs after it).

Verdicts: PASS, FAIL (wrong, raised, did not compile, text after the function, did something
refused, ended the process), TIMEOUT (wall clock or CPU limit), OOM (MemoryError, or killed at
the memory limit), ERROR (the harness's own fault: it never started, or broke before the
candidate existed; a body cannot cause one; never silently a 0 — callers count ERRORs and
`check_errors` refuses a batch whose share passes MAX_ERROR_SHARE); a doctest job whose
docstring has no examples is NODOC.

Not guaranteed: that a body does not read what it may read (the standard library's sources and
docstrings, so a doctest's expected outputs; any file the user may read) or re-derive the
reference from them; that the plain "process" isolation contains code written to escape a
Python-level guard (it is defence in depth; bubblewrap's mounts and namespaces are enforced by
the kernel). Run code from outside your machine in a container or a VM.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import re
import secrets
import select
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
#: Default limits of one job, and the ranges `run_job` and `Pool` accept.
TIMEOUT_S = 5.0
MAX_TIMEOUT_S = 3600.0
MEMORY_BYTES = 1 << 30
MIN_MEMORY_BYTES = 64 << 20  # the interpreter and the harness alone map ~20 MiB
FILE_BYTES = 1 << 20
#: The most of a child's report the parent reads (a probe's cases travel on the pipe).
MESSAGE_BYTES = 16 << 20
#: The longest candidate source and expected text a job may carry (characters).
SOURCE_CHARS = 1 << 20
#: Size of bubblewrap's private /tmp (nothing may be written there: the audit hook refuses it).
TMP_BYTES = 16 << 20
#: The environment variable that chooses the isolation: "1" bubblewrap (an error where it does
#: not work), "0" the plain process, unset or "auto" bubblewrap where it works.
ISOLATION_ENV = "LMFORGE_SANDBOX_BWRAP"
ISOLATIONS = ("bubblewrap", "process")
JOB_KINDS = ("doctest", "cases", "probe")
_FIELDS = {"doctest": ("kind", "module", "function", "source", "doc"),
           "cases": ("kind", "module", "function", "source", "cases"),
           "probe": ("kind", "module", "probes", "call_s")}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


class SandboxError(LmforgeError):
    """The sandbox itself failed too often to trust the scores, or the isolation asked for is
    not available here."""


@dataclass(frozen=True)
class Result:
    """One job's verdict (one of VERDICTS, or NODOC), a one-line reason, the wall-clock seconds,
    and what a "probe" job found (`run_job`)."""

    verdict: str
    detail: str
    seconds: float
    data: object = None


#: The child's program (lmforge/sandbox/child.py), run with `python -I -c`.
_HARNESS = (Path(__file__).resolve().parent / "child.py").read_text(encoding="utf-8")


# -- isolation -----------------------------------------------------------------------------------
@functools.cache
def network_isolation() -> str:
    """"unshare -rn" when an unprivileged user namespace without network can be made here (the
    plain process then has no network at all), else "" (the audit hook still refuses sockets)."""
    unshare = shutil.which("unshare")
    if not unshare:
        return ""
    try:
        ok = subprocess.run([unshare, "-rn", "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return f"{unshare} -rn" if ok else ""


def _bwrap_args(bwrap: str, folder: str) -> list[str]:
    return [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--size", str(TMP_BYTES), "--tmpfs",
            "/tmp", "--bind", folder, folder, "--chdir", folder, "--unshare-all", "--die-with-parent", "--"]


@functools.cache
def _bwrap() -> tuple[str, str]:
    """(bwrap's path, "") when bubblewrap runs this interpreter here, else ("", why not). Probed
    once per process: `python -I` started inside it exactly as a job is."""
    bwrap = shutil.which("bwrap")
    if not bwrap:
        return "", "bwrap is not installed"
    folder = tempfile.mkdtemp(prefix="lmforge-sandbox-probe-")
    try:
        cmd = _bwrap_args(bwrap, folder) + [sys.executable, "-I", "-c", "import os; os.write(1, b'ok')"]
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=30, cwd=folder)
        if r.returncode == 0 and r.stdout == b"ok":
            return bwrap, ""
        return "", f"{bwrap} failed its start-up probe (exit status {r.returncode}: " \
                   f"{r.stderr.decode(errors='replace').strip()[:160]})"
    except (OSError, subprocess.SubprocessError) as exc:
        return "", f"{bwrap} failed its start-up probe ({type(exc).__name__}: {exc})"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def isolation(requested: str | None = None) -> str:
    """The isolation generated code runs in: "bubblewrap" or "process" (module docstring).

    `requested`: None (the environment variable ISOLATION_ENV decides: "1" bubblewrap, "0"
    process, unset or "auto" bubblewrap where it works), "bubblewrap" or "process". Bubblewrap is
    probed once per process (about 50 ms), then cached.

    Raises:
        ValueError: `requested` is none of those.
        SandboxError: ISOLATION_ENV holds another value, or bubblewrap is asked for and does not
            work here (the reason named).
    """
    if requested is None:
        value = os.environ.get(ISOLATION_ENV, "").strip().lower()
        if value in ("", "auto"):
            return "bubblewrap" if _bwrap()[0] else "process"
        if value not in ("0", "1"):
            raise SandboxError(f"{ISOLATION_ENV}={os.environ[ISOLATION_ENV]!r}: expected 1 (run generated code in "
                               f"bubblewrap), 0 (a plain process) or auto (bubblewrap where it works).")
        requested = "bubblewrap" if value == "1" else "process"
        where = f"{ISOLATION_ENV}=1"
    else:
        if requested not in ISOLATIONS:
            raise ValueError(f"isolation={requested!r}: expected one of {ISOLATIONS} or None (automatic)")
        where = "isolation='bubblewrap'"
    if requested == "bubblewrap" and not _bwrap()[0]:
        raise SandboxError(f"{where} asks for bubblewrap, and {_bwrap()[1]}. Install bubblewrap (apt install "
                           f"bubblewrap), allow unprivileged user namespaces, or set {ISOLATION_ENV}=0.")
    return requested


_isolation = isolation  # for the functions whose argument is named `isolation`


def isolation_line() -> str:
    """One line saying how generated code is run (for a command's start-up report)."""
    if isolation() == "bubblewrap":
        how = "bubblewrap (read-only root, private /tmp, no network, own PID namespace)"
    else:
        net = "no network (user namespace)" if network_isolation() else \
            "network not removed (no user namespace here; sockets refused by the audit hook)"
        why = _bwrap()[1] if os.environ.get(ISOLATION_ENV, "").strip() != "0" else f"{ISOLATION_ENV}=0"
        how = f"a plain process ({why}), {net}"
    return f"sandbox: generated code runs in {how}: a fresh `python -I` with limits and an audit hook; " \
           f"lmforge decides each verdict from what it reports"


# -- what a job is --------------------------------------------------------------------------------
def check_limits(timeout: object, memory_bytes: object) -> None:
    """Refuse limits a job cannot run under.

    Raises:
        TypeError: `timeout` is not a number, or `memory_bytes` not an int (bools refused).
        ValueError: `timeout` outside (0, MAX_TIMEOUT_S] (nan and inf included), `memory_bytes`
            below MIN_MEMORY_BYTES; each message names the value and the range.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout={timeout!r}: expected seconds as a number in (0, {MAX_TIMEOUT_S:g}]")
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout={timeout!r}: expected seconds in (0, {MAX_TIMEOUT_S:g}]")
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int):
        raise TypeError(f"memory_bytes={memory_bytes!r}: expected an int of bytes >= {MIN_MEMORY_BYTES} (64 MiB)")
    if not MIN_MEMORY_BYTES <= memory_bytes < 1 << 63:
        raise ValueError(f"memory_bytes={memory_bytes!r}: expected bytes in [{MIN_MEMORY_BYTES} (64 MiB), 2**63) "
                         f"(the interpreter and the harness alone map ~20 MiB; a job needs room besides)")


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} = {_short(value)}: expected a str")
    if len(value) > SOURCE_CHARS:
        raise ValueError(f"{where} has {len(value)} characters: at most {SOURCE_CHARS}")
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _args(value: object, where: str) -> str:
    text = _text(value, where)
    try:
        parsed = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        parsed = None
    if not isinstance(parsed, tuple):
        raise ValueError(f"{where} = {_short(text)}: expected the text of a tuple literal of arguments, "
                         f"e.g. \"(1, 'a')\"")
    return text


@dataclass
class _Plan:
    """A validated job: what the child receives (`child`: never an expected result) and what
    lmforge keeps to judge its report (`expected`)."""

    kind: str
    child: dict
    expected: list | None  # cases: [(want, args_after | None)]; doctest: [(want, exc_msg)] or None (read at ready)
    names: tuple = ()  # probe: the functions probed


def plan_job(job: object) -> _Plan:
    """Validate `job` (the shape `run_job` documents) and split it into what the child runs and
    what lmforge keeps.

    Raises:
        TypeError: `job` is not a dict, or a field has the wrong type (the field named).
        ValueError: an unknown kind or field, a name that is not an identifier, no case, a case
            that is not [args, want] or [args, want, args_after], args that are not a tuple
            literal, a call_s outside (0, 60] (the field and the value named).
    """
    if not isinstance(job, dict):
        raise TypeError(f"job = {_short(job)}: expected a dict with a 'kind' of {JOB_KINDS}")
    kind = job.get("kind")
    if kind not in JOB_KINDS:
        raise ValueError(f"job['kind'] = {_short(kind)}: expected one of {JOB_KINDS}")
    extra = sorted(str(k) for k in job if k not in _FIELDS[kind])
    if extra:
        raise ValueError(f"job has the unknown field(s) {extra}: a {kind!r} job takes {list(_FIELDS[kind])}")
    module = _text(job.get("module", ""), "job['module']")
    if module and not _MODULE.match(module):
        raise ValueError(f"job['module'] = {module!r}: expected a dotted module name, or '' for none")
    child: dict = {"kind": kind, "module": module}
    if kind == "probe":
        probes = job.get("probes")
        if not isinstance(probes, dict):
            raise TypeError(f"job['probes'] = {_short(probes)}: expected a dict {{function name: [args, ...]}}")
        for name, inputs in probes.items():
            if not isinstance(name, str) or not _NAME.match(name):
                raise ValueError(f"job['probes'] has the key {_short(name)}: expected a function's name")
            if not isinstance(inputs, (list, tuple)):
                raise TypeError(f"job['probes'][{name!r}] = {_short(inputs)}: expected a list of argument tuples' text")
            for i, a in enumerate(inputs):
                _args(a, f"job['probes'][{name!r}][{i}]")
        call_s = job.get("call_s", 0.25)
        if isinstance(call_s, bool) or not isinstance(call_s, (int, float)) or not (math.isfinite(call_s)
                                                                                     and 0 < call_s <= 60):
            raise ValueError(f"job['call_s'] = {_short(call_s)}: expected seconds in (0, 60]")
        child.update(probes={n: list(v) for n, v in probes.items()}, call_s=float(call_s))
        return _Plan(kind, child, None, tuple(probes))
    function = job.get("function")
    if not isinstance(function, str):
        raise TypeError(f"job['function'] = {_short(function)}: expected the function's name (a str)")
    if not _NAME.match(function):
        raise ValueError(f"job['function'] = {function!r}: expected an identifier")
    child.update(function=function, source=_text(job.get("source"), "job['source']"))
    if kind == "cases":
        cases = job.get("cases")
        if not isinstance(cases, (list, tuple)):
            raise TypeError(f"job['cases'] = {_short(cases)}: expected a list of [args, want] or [args, want, "
                            f"args_after]")
        if not cases:
            raise ValueError("job['cases'] is empty: expected at least one case (none would pass anything)")
        args, expected = [], []
        for i, case in enumerate(cases):
            if not isinstance(case, (list, tuple)) or len(case) not in (2, 3):
                raise ValueError(f"job['cases'][{i}] = {_short(case)}: expected [args, want] or [args, want, "
                                 f"args_after] (texts)")
            args.append(_args(case[0], f"job['cases'][{i}][0]"))
            expected.append((_text(case[1], f"job['cases'][{i}][1]"),
                             _text(case[2], f"job['cases'][{i}][2]") if len(case) == 3 else None))
        child["args"] = args
        return _Plan(kind, child, expected)
    doc = job.get("doc")
    if doc is None:  # the reference's docstring, which the child reads before the candidate exists
        child["examples"] = None
        return _Plan(kind, child, None)
    examples = _examples(_text(doc, "job['doc']"))
    child["examples"] = [ex.source for ex in examples]
    return _Plan(kind, child, [(ex.want, ex.exc_msg) for ex in examples])


def _examples(doc: str) -> list:
    import doctest

    try:
        return doctest.DocTestParser().get_examples(doc)
    except ValueError:
        return []


# -- judging what the child reports (in lmforge's process) ------------------------------------------
class _Judge:
    """lmforge's side of one job: fed the child's report line by line, it says the verdict
    (verdict, detail, data) as soon as the report decides it, else None."""

    def __init__(self, plan: _Plan):
        self.plan = plan
        self.expected = plan.expected
        self.ready = False
        self.seen = 0
        self.kept: dict[str, list] = {n: [] for n in plan.names}

    @property
    def progress(self) -> str:
        n = len(self.expected) if self.expected is not None else "?"
        return f"after {self.seen} of {n} {'cases' if self.plan.kind == 'cases' else 'examples'}"

    def feed(self, msg: list) -> tuple | None:
        tag = msg[1] if len(msg) > 1 else None
        if not self.ready:  # written before any candidate code existed: trusted
            if tag == "error" and len(msg) == 3:
                return "ERROR", msg[2], None
            if tag != "ready" or len(msg) != 3:
                return "ERROR", f"the harness sent {_short(msg[1:])} before it was ready", None
            self.ready = True
            if self.plan.kind == "doctest":
                if self.expected is None:
                    self.expected = [(ex.want, ex.exc_msg) for ex in _examples(msg[2])]
                if not self.expected:
                    return "NODOC", f"{self.plan.child['function']} has no >>> examples", None
            return None
        # from here on, the candidate may have written any of it
        if tag == "done" and len(msg) == 2:
            if self.plan.kind == "probe":
                return "PASS", f"{sum(map(len, self.kept.values()))} cases kept", self.kept
            if self.seen != len(self.expected):
                return "FAIL", f"the report ended {self.progress}", None
            return "PASS", f"{self.seen} {'cases' if self.plan.kind == 'cases' else 'examples'}", None
        if tag == "compile" and len(msg) == 3:
            return "FAIL", f"did not compile: {msg[2][:160]}", None
        if tag == "kept" and self.plan.kind == "probe" and len(msg) == 6 and msg[2] in self.kept:
            self.kept[msg[2]].append(msg[3:])
            return None
        if tag == "obs" and self.plan.kind != "probe" and self.seen < len(self.expected):
            self.seen += 1
            return self._cases(msg[2:]) if self.plan.kind == "cases" else self._example(msg[2:])
        return "FAIL", f"a malformed report {self.progress}", None

    def _cases(self, obs: list) -> tuple | None:
        i = self.seen
        want, after = self.expected[i - 1]
        if obs == ["oom"]:
            return "OOM", f"case {i}: MemoryError", None
        if obs[:1] == ["value"] and len(obs) == 3:
            got = obs[1] if after is None or obs[2] == after else f"{obs[1]} (arguments left as {obs[2]})"
        elif obs[:1] == ["raise"] and len(obs) == 2:
            got = "raise " + obs[1]
        else:
            return "FAIL", f"case {i}: a malformed observation", None
        if got != want:
            return "FAIL", f"case {i}: got {got[:80]}, expected {want[:80]}", None
        return None

    def _example(self, obs: list) -> tuple | None:
        import doctest

        i = self.seen
        want, exc_msg = self.expected[i - 1]
        if obs == ["oom"]:
            return "OOM", f"example {i}: MemoryError", None
        if len(obs) != 2 or obs[0] not in ("out", "raise"):
            return "FAIL", f"example {i}: a malformed observation", None
        check, flags = doctest.OutputChecker(), doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        if obs[0] == "out":
            if exc_msg is not None or not check.check_output(want, obs[1], flags):
                return "FAIL", f"example {i}: wrong output", None
        elif exc_msg is None or not check.check_output(exc_msg, obs[1], flags):
            return "FAIL", f"example {i}: raised {obs[1].split(':')[0].strip()[:60]}", None
        return None


# -- one interpreter --------------------------------------------------------------------------------
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
        try:
            self.read_fd, write_fd = os.pipe()
            self.folder = tempfile.mkdtemp(prefix="lmforge-sandbox-")
            cmd = [sys.executable, "-I", "-c", _HARNESS, str(write_fd), str(int(memory_bytes)), str(FILE_BYTES)]
            if how == "bubblewrap":
                cmd = _bwrap_args(_bwrap()[0], self.folder) + cmd
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

    def send(self, plan: _Plan, timeout: float) -> None:
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

    def wait(self, plan: _Plan) -> Result:
        """The job's verdict, decided here from the child's report; the process group is killed
        as soon as it is decided, the folder removed."""
        try:
            verdict = ("ERROR", self.error, None) if self.proc is None else self._judge(plan)
        finally:
            self.close()
        return Result(verdict[0], str(verdict[1])[:200], time.perf_counter() - self.started, verdict[2])

    def _judge(self, plan: _Plan) -> tuple:
        judge = _Judge(plan)
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

    def _run(self, plan: _Plan, timeout: float) -> Result:
        if plan.kind == "doctest" and plan.expected == []:
            return Result("NODOC", "the docstring has no >>> examples", 0.0)
        worker = self._take()
        try:
            worker.send(plan, timeout)
            self._refill()  # the next interpreter starts while this job runs
        except BaseException:
            worker.close()
            raise
        return worker.wait(plan)

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
        return list(self._threads.map(lambda p: self._run(p, float(timeout)), plans))

    def close(self) -> None:
        """Kill the waiting interpreters and remove their folders (idempotent)."""
        with self._lock:
            self._closed = True
            ready, self._ready = self._ready, []
        for worker in ready:
            worker.close()
        self._threads.shutdown(wait=False)

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


def check_errors(results: list[Result], what: str) -> None:
    """Refuse a batch of verdicts whose ERROR share (the harness's own faults) passes MAX_ERROR_SHARE.

    Raises:
        SandboxError: naming the count, the share and the first reason.
    """
    errors = [r for r in results if r.verdict == "ERROR"]
    if results and len(errors) / len(results) > MAX_ERROR_SHARE:
        raise SandboxError(f"{what}: {len(errors)} of {len(results)} sandbox runs failed in the harness itself "
                           f"(first: {errors[0].detail}); above {MAX_ERROR_SHARE:.0%}, the scores cannot be trusted. "
                           f"Check that `{sys.executable} -I` starts here ({isolation_line()}).")


__all__ = ["ISOLATIONS", "ISOLATION_ENV", "MAX_ERROR_SHARE", "MAX_TIMEOUT_S", "MIN_MEMORY_BYTES", "Pool", "Result",
           "SandboxError", "VERDICTS", "check_errors", "check_limits", "isolation", "isolation_line",
           "network_isolation", "plan_job", "run_job"]
