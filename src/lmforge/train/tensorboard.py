"""`train.tensorboard`: a copy of a run's metrics for TensorBoard's viewer (metrics.jsonl stays
the record that needs nothing installed)."""

from __future__ import annotations

from pathlib import Path

from lmforge.errors import os_error, require_package

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


__all__ = ["TENSORBOARD_DIR", "TensorBoard", "check_writable"]
