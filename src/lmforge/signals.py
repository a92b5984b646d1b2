"""SIGINT and SIGTERM, and how an lmforge process ends after them.

- a command (`lmforge.cli.main`): `command_handlers` makes a signal unwind it (`Interrupted`), so
  every writer removes its temporary and its lock; `stop_signal` and `report_stop` turn the stop
  into one `interrupted` line (the exit code: 128 + the signal, 130 or 143); `restore_handlers`
  puts Python's back; `end_progress_lines` ends an open progress bar's line before an `error:` line;
- a training loop (`lmforge.train.trainer.Trainer.fit`): `TrainingStop` only records the signal,
  and the loop stops after the current step and its checkpoint; a second Ctrl-C stops it at once;
- a rank of a multi-rank run: `exit_past_gloo_teardown` ends it past gloo's teardown.

The signals received are recorded in `lmforge.errors` (`request_stop`): native code that swallows
the exception a handler raises (the Rust BPE trainer) checks them when it returns.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

from lmforge.errors import Interrupted, clear_stop_requests, first_stop_signal, request_stop, stop_requested

#: The signals that stop a command (SIGXFSZ is ignored instead: a write past `ulimit -f` then
#: fails with EFBIG and is reported like a full disk).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def on_main_thread() -> bool:
    """Handlers can be set on the main thread only (a command run from a thread keeps Python's)."""
    return threading.current_thread() is threading.main_thread()


# -- a command ------------------------------------------------------------------------------
def on_signal(signum, frame):
    """SIGINT / SIGTERM outside a training loop (which handles them itself, finishing the step):
    unwind, so every writer removes its temporary and its lock; exit 130 / 143. Recorded too,
    for native code that swallows the exception (`errors.raise_if_stopped`). A second signal
    while the first one's shutdown runs is only recorded: the clean-up finishes, the exit
    code is the first signal's, and no traceback is printed."""
    if stop_requested():  # the shutdown of the first is under way: let it finish
        request_stop(signum)
        return
    request_stop(signum)
    raise Interrupted(signum)


def quiet(signum, frame):
    """The handler while a command's end is reported: a signal is recorded, nothing raised."""
    request_stop(signum)


def command_handlers() -> dict:
    """A new command's handlers: earlier signals forgotten, SIGINT/SIGTERM -> `on_signal`, SIGXFSZ
    ignored. Returns the handlers they replaced (for `restore_handlers`; {} off the main thread)."""
    clear_stop_requests()
    if not on_main_thread():
        return {}
    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    previous[signal.SIGXFSZ] = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return previous


def stop_signal(exc: BaseException) -> int:
    """The signal that stopped a command with `exc`: an `Interrupted`'s, SIGINT for a
    KeyboardInterrupt (a second Ctrl-C in a training loop), and for any other error the first
    signal received (the shutdown after it failed on the way: a second Ctrl-C cut an import, a
    clean-up). Any other error with no signal received is a bug: raised, its traceback wanted."""
    if isinstance(exc, Interrupted):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if not stop_requested():
        raise exc
    return first_stop_signal() or signal.SIGINT


def report_stop(signum: int, named: bool, resumable: bool, handlers: dict) -> None:
    """Say that signal `signum` stopped the command (`named`: with the signal's name; not for a
    second Ctrl-C in a training loop) and how to go on (the exit code is 128 + the signal). With
    `handlers` set (`command_handlers`), a further signal is only recorded meanwhile."""
    for s in STOP_SIGNALS if handlers else ():
        signal.signal(s, quiet)
    if resumable:  # a training command kept its checkpoints
        hint = "checkpoints are kept; run the same command with --resume to continue"
        hint += " (`make speedrun` resumes by itself)" if named else ""
    else:
        hint = "nothing was written (outputs are replaced only when complete); run the command again"
    name = f" ({signal.Signals(signum).name})" if named else ""
    print(f"interrupted{name}: {hint}", file=sys.stderr)


def restore_handlers(previous: dict, interrupted: bool, own_process: bool) -> None:
    """Put back the handlers `command_handlers` replaced. The process's own command (`own_process`)
    stopped by a signal exits next: a further Ctrl-C is ignored there, never a traceback. A command
    called from Python (not `own_process`) forgets its signals once its exit code says them: the
    caller's next call of lmforge (a stage, the tokenizer trainer) is not stopped by them."""
    for s, handler in previous.items():
        signal.signal(s, signal.SIG_IGN if interrupted and own_process and s != signal.SIGXFSZ else handler)
    if not own_process:
        clear_stop_requests()
    if interrupted:
        keyboard_interrupt_handled()


def keyboard_interrupt_handled() -> None:
    """CPython marks a KeyboardInterrupt that crossed code run from C (a nested evaluation) as
    unhandled, and at exit kills the process with SIGINT: exit -2 instead of our 130, after
    the message was printed. It was handled here; clear the mark (CPython only, else nothing)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 0


def end_progress_lines() -> None:
    """A safety net for the `error:` line: a progress bar still open (the traceback of the error
    holds it; each stage closes its own) has left its line without a newline. End that line,
    so the error starts one of its own, and stop the bar: it draws nothing after the error.
    tqdm's bars only (its registry of open bars); a bar of the Rust tokenizers library draws
    only on a terminal and ends its line itself."""
    from tqdm import tqdm

    open_bars = [bar for bar in list(getattr(tqdm, "_instances", ())) if not getattr(bar, "disable", True)]
    for bar in open_bars:
        bar.disable = True  # its close(), when the traceback lets it go, then writes nothing
    if open_bars:
        sys.stderr.write("\n")


def exit_past_gloo_teardown(code: int, distributed_used: Callable[[], bool]) -> None:
    """A process of a multi-rank run (torchrun: WORLD_SIZE > 1) that initialised torch.distributed
    (`distributed_used()`) ends here with os._exit, its output flushed, after every file of its run
    is closed (the stages write through lmforge.fileio) and its process group destroyed: at
    interpreter finalization gloo's C++ teardown aborted a finished rank now and then ("terminate
    called without an active exception", SIGABRT; torch 2.13, a 2-core CPU under load, 2026-11-27:
    torchrun then reported the run failed; pytorch/pytorch#179291 describes gloo's worker threads
    holding tensors past finalization). Single-process commands and calls from Python return as usual."""
    import torch.distributed as dist

    if os.environ.get("WORLD_SIZE", "1") in ("", "1") or not dist.is_available() or not distributed_used():
        return  # one process: the interpreter's own exit is safe
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -- a training loop ----------------------------------------------------------------------------
class TrainingStop:
    """SIGINT/SIGTERM while a training loop runs (a context manager around it): the signal is
    recorded in `signum` and the loop stops after the current step, once its checkpoint is
    written; a second Ctrl-C raises KeyboardInterrupt (stop now, without a checkpoint). The
    handlers it replaced come back on the way out. Off the main thread it changes nothing."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def _handler(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT and not stop_requested():  # a second Ctrl-C
            request_stop(signum)  # a further signal is only recorded: the clean-up runs to its end
            raise KeyboardInterrupt  # stop now, without a checkpoint
        self.signum = signum  # no I/O here: the loop reports after the checkpoint

    def __enter__(self) -> TrainingStop:
        if on_main_thread():
            self._previous = {s: signal.signal(s, self._handler) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)


__all__ = ["STOP_SIGNALS", "command_handlers", "stop_signal", "report_stop", "restore_handlers",
           "end_progress_lines", "exit_past_gloo_teardown", "TrainingStop"]
