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

Where it is: `jobs.py` (a job's limits and validation, the judge of the child's report, `Result`),
`isolate.py` (bubblewrap or a plain process), `runner.py` (one interpreter per job: `run_job`,
`Pool`, `check_errors`), `child.py` (the program the interpreter runs: the audit hook, the cases,
the report).
"""

from lmforge.sandbox.isolate import ISOLATION_ENV, ISOLATIONS, isolation, isolation_line, network_isolation
from lmforge.sandbox.jobs import (MAX_TIMEOUT_S, MIN_MEMORY_BYTES, TIMEOUT_S, VERDICTS, Result, SandboxError, check_limits,
                                  plan_job)
from lmforge.sandbox.runner import MAX_ERROR_SHARE, Pool, check_errors, run_job

__all__ = ["ISOLATIONS", "ISOLATION_ENV", "MAX_ERROR_SHARE", "MAX_TIMEOUT_S", "MIN_MEMORY_BYTES", "Pool", "Result",
           "SandboxError", "VERDICTS", "check_errors", "check_limits", "isolation", "isolation_line",
           "network_isolation", "plan_job", "run_job"]
