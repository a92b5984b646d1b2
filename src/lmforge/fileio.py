"""Output folders that lmforge replaces whole: refuse ones holding anything else."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from lmforge.errors import LmforgeError


def check_replaceable(out: Path, known: Collection[str], what: str,
                      error: type[LmforgeError] = LmforgeError) -> None:
    """Raise `error` unless `out` is absent, or a folder holding only `known` file names
    (an earlier result of `what`, which is replaced whole)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise error(f"{out} is a file, not a folder. Choose a folder for {what}.")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in known)
    if foreign:
        raise error(
            f"{out} already holds files that {what} did not write ({', '.join(foreign[:5])}); "
            f"{what} replaces the whole folder, so it refuses. Choose an empty or new folder."
        )
