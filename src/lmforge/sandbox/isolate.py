"""How generated code is isolated here: inside bubblewrap where it works (`isolation()` says
"bubblewrap": the root read-only, a private /tmp with only the job's folder writable, no network,
its own PID and IPC namespaces, killed with its parent), else a plain process ("process": without
network where an unprivileged user namespace can be made, `network_isolation()`). The choice
follows ISOLATION_ENV; `isolation_line()` says it in one line. `runner.py` starts each
interpreter inside it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile

from lmforge.sandbox.jobs import SandboxError

#: Size of bubblewrap's private /tmp (nothing may be written there: the audit hook refuses it).
TMP_BYTES = 16 << 20
#: The environment variable that chooses the isolation: "1" bubblewrap (an error where it does
#: not work), "0" the plain process, unset or "auto" bubblewrap where it works.
ISOLATION_ENV = "LMFORGE_SANDBOX_BWRAP"
ISOLATIONS = ("bubblewrap", "process")


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


def bwrap_args(bwrap: str, folder: str) -> list[str]:
    return [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--size", str(TMP_BYTES), "--tmpfs",
            "/tmp", "--bind", folder, folder, "--chdir", folder, "--unshare-all", "--die-with-parent", "--"]


@functools.cache
def bwrap_probe() -> tuple[str, str]:
    """(bwrap's path, "") when bubblewrap runs this interpreter here, else ("", why not). Probed
    once per process: `python -I` started inside it exactly as a job is."""
    bwrap = shutil.which("bwrap")
    if not bwrap:
        return "", "bwrap is not installed"
    folder = tempfile.mkdtemp(prefix="lmforge-sandbox-probe-")
    try:
        cmd = bwrap_args(bwrap, folder) + [sys.executable, "-I", "-c", "import os; os.write(1, b'ok')"]
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
            return "bubblewrap" if bwrap_probe()[0] else "process"
        if value not in ("0", "1"):
            raise SandboxError(f"{ISOLATION_ENV}={os.environ[ISOLATION_ENV]!r}: expected 1 (run generated code in "
                               f"bubblewrap), 0 (a plain process) or auto (bubblewrap where it works).")
        requested = "bubblewrap" if value == "1" else "process"
        where = f"{ISOLATION_ENV}=1"
    else:
        if requested not in ISOLATIONS:
            raise ValueError(f"isolation={requested!r}: expected one of {ISOLATIONS} or None (automatic)")
        where = "isolation='bubblewrap'"
    if requested == "bubblewrap" and not bwrap_probe()[0]:
        raise SandboxError(f"{where} asks for bubblewrap, and {bwrap_probe()[1]}. Install bubblewrap (apt install "
                           f"bubblewrap), allow unprivileged user namespaces, or set {ISOLATION_ENV}=0.")
    return requested


def isolation_line() -> str:
    """One line saying how generated code is run (for a command's start-up report)."""
    if isolation() == "bubblewrap":
        how = "bubblewrap (read-only root, private /tmp, no network, own PID namespace)"
    else:
        net = "no network (user namespace)" if network_isolation() else \
            "network not removed (no user namespace here; sockets refused by the audit hook)"
        why = bwrap_probe()[1] if os.environ.get(ISOLATION_ENV, "").strip() != "0" else f"{ISOLATION_ENV}=0"
        how = f"a plain process ({why}), {net}"
        if not shutil.which("bwrap") and os.environ.get(ISOLATION_ENV, "").strip() != "0":
            how += "; add the boundary with `make sandbox` (apt-get install bubblewrap)"
    return f"sandbox: generated code runs in {how}: a fresh `python -I` with limits and an audit hook; " \
           f"lmforge decides each verdict from what it reports"


__all__ = ["ISOLATIONS", "ISOLATION_ENV", "TMP_BYTES", "isolation", "isolation_line", "network_isolation"]
