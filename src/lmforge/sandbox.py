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
import time
from dataclasses import dataclass

from lmforge.errors import LmforgeError

VERDICTS = ("PASS", "FAIL", "TIMEOUT", "OOM", "ERROR")
#: The share of ERROR verdicts (the harness's own faults) a batch may have before it is refused.
MAX_ERROR_SHARE = 0.01
#: Default limits of one job.
TIMEOUT_S = 5.0
MEMORY_BYTES = 1 << 30
FILE_BYTES = 1 << 20


class SandboxError(LmforgeError):
    """The sandbox itself failed too often to trust the scores."""


@dataclass(frozen=True)
class Result:
    """One job's verdict (one of VERDICTS), a one-line reason, and the wall-clock seconds."""

    verdict: str
    detail: str
    seconds: float


# The child's program. Everything lives inside main(): no module global holds the nonce, and the
# hook's state is a closure the candidate cannot reach once frames and the collector are refused.
_HARNESS = r'''
def main():
    import builtins, contextlib, doctest, importlib, io, json, os, sys
    fd = int(sys.argv[1])
    job = json.loads(sys.stdin.buffer.read())
    nonce = job.pop("nonce")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    home = os.path.realpath(os.getcwd())

    def say(**msg):
        os.write(fd, (json.dumps(dict(msg, nonce=nonce)) + "\n").encode())

    guard = [False]
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    REFUSED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
               "os.forkpty", "os.kill", "os.killpg", "os.setsid", "ctypes.", "sys._getframe",
               "sys._current_frames", "sys.settrace", "sys.setprofile", "gc.get_", "object.__getattr__",
               "pty.", "resource.setrlimit", "os.chroot", "shutil.", "os.startfile", "webbrowser.")
    PATHS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
             "os.truncate", "os.utime", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr")

    def inside(path):
        try:
            p = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else f"/proc/self/fd/{path}")
        except Exception:
            return False
        return p == home or p.startswith(home + os.sep)

    def hook(event, args):
        if not guard[0]:
            return
        if event.startswith(REFUSED):
            raise PermissionError(f"sandbox: {event} is refused")
        if event == "open":
            path, mode, flags = args
            if path is None:
                return
            text = os.fsdecode(path) if not isinstance(path, int) else ""
            if text.startswith("/proc") or text.startswith("/dev/") and text != os.devnull:
                raise PermissionError(f"sandbox: opening {text} is refused")
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & WRITE
            if writes and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox folder is refused")
        elif event in PATHS or event.startswith(PATHS):
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError(f"sandbox: {event} outside the sandbox folder is refused")

    sys.addaudithook(hook)
    try:
        mod = importlib.import_module(job["module"]) if job.get("module") else None
        ref = getattr(mod, job["function"], None) if mod is not None else None
        doc = job.get("doc") if job.get("doc") is not None else (getattr(ref, "__doc__", None) or "")
        ns = dict(vars(mod)) if mod is not None else {"__name__": "__sandbox__", "__builtins__": builtins}
    except BaseException as exc:
        say(verdict="ERROR", detail=f"the harness could not import {job.get('module')!r}: {type(exc).__name__}")
        return
    say(ready=True)
    out = io.StringIO()
    verdict, detail = "FAIL", ""
    guard[0] = True
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(job["source"], "<candidate>", "exec"), ns)
            cand = ns.get(job["function"])
            if not callable(cand):
                raise NameError(f"the candidate defines no function {job['function']!r}")
            if mod is not None:
                setattr(mod, job["function"], cand)
            if job["kind"] == "doctest":
                verdict, detail = _doctests(doctest, out, doc, ns, job["function"])
            elif job["kind"] == "cases":
                verdict, detail = _cases(cand, job["cases"])
            else:
                verdict, detail = "ERROR", f"unknown job kind {job['kind']!r}"
    except MemoryError:
        verdict, detail = "OOM", "MemoryError"
    except RecursionError:
        verdict, detail = "FAIL", "RecursionError"
    except BaseException as exc:
        verdict, detail = "FAIL", f"{type(exc).__name__}: {str(exc)[:160]}"
    guard[0] = False
    say(verdict=verdict, detail=detail)


def _doctests(doctest, out, doc, ns, name):
    examples = doctest.DocTestParser().get_examples(doc)
    if not examples:
        return "NODOC", f"{name} has no >>> examples"
    check = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    for i, ex in enumerate(examples):
        out.seek(0)
        out.truncate()
        try:
            exec(compile(ex.source, f"<example {i + 1}>", "single"), ns)
            got = out.getvalue()
            if ex.exc_msg is not None or not check.check_output(ex.want, got, flags):
                return "FAIL", f"example {i + 1}: wrong output"
        except MemoryError:
            return "OOM", f"example {i + 1}: MemoryError"
        except Exception as exc:  # the line doctest compares, built without touching the traceback (refused)
            kind = type(exc).__qualname__
            if type(exc).__module__ not in ("builtins", "__main__"):
                kind = f"{type(exc).__module__}.{kind}"
            got = f"{kind}: {exc}\n" if str(exc) else f"{kind}\n"
            if ex.exc_msg is None or not check.check_output(ex.exc_msg, got, flags):
                return "FAIL", f"example {i + 1}: raised {type(exc).__name__}"
    return "PASS", f"{len(examples)} examples"


def _cases(cand, cases):
    for i, (args, want) in enumerate(cases):
        try:
            got = repr(cand(*eval(args)))
        except MemoryError:
            return "OOM", f"case {i + 1}: MemoryError"
        except Exception as exc:
            got = "raise " + type(exc).__name__
        if got != want:
            return "FAIL", f"case {i + 1}: got {got[:80]}, expected {want[:80]}"
    return "PASS", f"{len(cases)} cases"


main()
'''


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


def _limits(timeout: float, memory_bytes: int) -> None:
    import resource

    cpu = int(timeout) + 1
    for name, value in (("RLIMIT_AS", memory_bytes), ("RLIMIT_CPU", cpu), ("RLIMIT_FSIZE", FILE_BYTES),
                        ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", 64)):
        limit = getattr(resource, name, None)
        if limit is not None:
            try:
                resource.setrlimit(limit, (value, value))
            except (ValueError, OSError):
                pass


def run_job(job: dict, timeout: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES) -> Result:
    """Run one job in a fresh sandboxed interpreter and return its verdict.

    `job`: {"kind": "doctest" | "cases", "source": the candidate (a module defining `function`),
    "function": its name, "module": the module it replaces the reference in ("" for none),
    "doc": the docstring whose examples to run (kind "doctest"; default the reference's),
    "cases": [[args as a Python literal of a tuple, repr of the expected value or "raise Name"]]
    (kind "cases")}. `timeout`: wall-clock seconds; `memory_bytes`: the address-space limit.
    """
    start = time.perf_counter()
    nonce = secrets.token_hex(16)
    read_fd, write_fd = os.pipe()
    folder = tempfile.mkdtemp(prefix="lmforge-sandbox-")
    cmd = [sys.executable, "-I", "-c", _HARNESS, str(write_fd)]
    if network_isolation():
        cmd = network_isolation().split() + cmd
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    killed = False
    try:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    cwd=folder, env=env, pass_fds=(write_fd,), start_new_session=True,
                                    preexec_fn=lambda: _limits(timeout, memory_bytes))
        except OSError as exc:
            return Result("ERROR", f"could not start the sandbox: {exc.strerror}", time.perf_counter() - start)
        finally:
            os.close(write_fd)
        try:
            proc.communicate(json.dumps({**job, "nonce": nonce}).encode(), timeout=timeout)
        except subprocess.TimeoutExpired:
            killed = True
            _kill_group(proc)
        except (BrokenPipeError, OSError):
            proc.wait()  # the child died before reading its job
        _kill_group(proc)  # anything the child left running in its group
        messages = _read_messages(read_fd, nonce)
    finally:
        os.close(read_fd)
        shutil.rmtree(folder, ignore_errors=True)
    seconds = time.perf_counter() - start
    ready = any(m.get("ready") for m in messages)
    final = next((m for m in messages if "verdict" in m), None)
    if killed:
        return Result("TIMEOUT", f"still running after {timeout:g} s (the process group was killed)", seconds)
    if final is not None and final["verdict"] in (*VERDICTS, "NODOC"):
        return Result(final["verdict"], str(final.get("detail", ""))[:200], seconds)
    code = proc.returncode
    if code in (-signal.SIGXCPU, -signal.SIGKILL) and ready:
        what = "TIMEOUT" if code == -signal.SIGXCPU else "OOM"
        return Result(what, f"killed by signal {-code} ({signal.Signals(-code).name})", seconds)
    if ready:
        return Result("FAIL", f"the candidate ended the process (exit status {code}) before a verdict", seconds)
    return Result("ERROR", f"the harness ended (exit status {code}) before the candidate ran", seconds)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read_messages(fd: int, nonce: str) -> list[dict]:
    """The child's messages that carry the parent's nonce (anything else on the pipe is ignored)."""
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
        if len(data) > 1 << 20:
            break
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


__all__ = ["MAX_ERROR_SHARE", "Result", "SandboxError", "VERDICTS", "check_errors", "isolation_line",
           "network_isolation", "run_job"]
