"""`train.tensorboard`: a copy of a run's metrics for TensorBoard's viewer (metrics.jsonl stays
the record that needs nothing installed)."""

from __future__ import annotations

import threading
from pathlib import Path

from lmforge.errors import FileSystemError, os_error, require_package

TENSORBOARD_DIR = "tensorboard"


class TensorBoard:
    """`train.tensorboard`: every number of each metrics.jsonl row as a scalar (same names),
    health warnings as text, through torch.utils.tensorboard's SummaryWriter. metrics.jsonl
    stays the record that needs nothing installed; this is a copy for TensorBoard's viewer.
    `purge_step` (a resumed run): events at or after it from an earlier, interrupted run are
    dropped by TensorBoard.

    Raises:
        LmforgeError: the tensorboard package is not installed (naming the pip command).
        FileSystemError: the folder cannot be made or written (read-only, full...): checked here,
            before SummaryWriter starts its writer thread, whose failure would print the thread's
            traceback before the error.
    """

    def __init__(self, folder: Path, purge_step: int | None = None):
        require_package("tensorboard", "tensorboard", "train.tensorboard = true")
        check_writable(Path(folder))
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self.writer.add_text(tag, text, step)

    def write(self, row: dict) -> None:
        step = int(row["step"])
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None:
                self.writer.add_scalar(key, value, step)
        for w in row.get("health", ()):
            self.writer.add_text("health", f"step {w['step']}: {w['kind']}: {w['message']}", step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def check_writable(folder: Path) -> None:
    """Make `folder` (if absent) and create and remove a file in it.

    Raises:
        FileSystemError: naming the folder, the system's reason and what to do.
    """
    import os
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".lmforge-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise os_error(OSError(exc.errno, exc.strerror, str(folder)), doing="write in",
                       what="(train.tensorboard writes its events there.) Make it writable, or set "
                            "train.tensorboard = false.") from None


class GuardedBoard:
    """`train.tensorboard` as the loop writes it (`TensorBoard`), with the operating system's
    refusals (a full disk: ENOSPC, EDQUOT; EFBIG past `ulimit -f`) said as one FileSystemError
    naming the folder, as a metrics.jsonl write that fails is (`fileio.AppendFile`). TensorBoard
    writes from a thread of its own: an OSError there would print the thread's traceback and reach
    the loop only at the next write. While the board is open that thread's OSError is kept (not
    printed) and raised at the next `text`, `write` or `close`."""

    def __init__(self, folder: Path, purge_step: int | None = None):
        self.folder = Path(folder)
        self.failed: OSError | None = None
        self._said = False
        self._previous_hook = threading.excepthook
        threading.excepthook = self._thread_error
        try:
            self.board = TensorBoard(self.folder, purge_step=purge_step)
        except OSError as exc:
            self._restore_hook()
            raise self._error(exc) from None
        except BaseException:
            self._restore_hook()
            raise

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self._guarded(self.board.text, tag, text, step)

    def write(self, row: dict) -> None:
        self._guarded(self.board.write, row)

    def close(self, quiet: bool = False) -> None:
        """Close the writer; a failure (now, or one its thread kept) is raised unless `quiet` (an
        error is already on its way out) or already said."""
        try:
            self.board.close()
        except OSError as exc:
            self.failed = self.failed or exc
        finally:
            self._restore_hook()
        if self.failed is not None and not quiet and not self._said:
            self._said = True
            raise self._error(self.failed)

    def _guarded(self, fn, *args) -> None:
        if self.failed is None:
            try:
                fn(*args)
            except OSError as exc:
                self.failed = self.failed or exc
        if self.failed is not None:
            self._said = True
            raise self._error(self.failed)

    def _error(self, exc: OSError) -> FileSystemError:
        return os_error(OSError(exc.errno, exc.strerror or str(exc), str(self.folder)), doing="write in",
                        what="(train.tensorboard writes the run's events there; metrics.jsonl holds every row written "
                             "before.) Or set train.tensorboard = false.")

    def _thread_error(self, args) -> None:
        """threading.excepthook while the board is open: TensorBoard's writer thread's OSError is kept
        for the loop to raise; everything else goes to the hook there was."""
        if isinstance(args.exc_value, OSError) and type(args.thread).__module__.startswith("tensorboard."):
            self.failed = self.failed or args.exc_value
            return
        self._previous_hook(args)

    def _restore_hook(self) -> None:
        if threading.excepthook == self._thread_error:
            threading.excepthook = self._previous_hook


__all__ = ["TENSORBOARD_DIR", "GuardedBoard", "TensorBoard", "check_writable"]
