"""`lmforge export` and `lmforge import-hf`: to and from other runtimes (lmforge.export)."""

from __future__ import annotations

from pathlib import Path

from lmforge.export import export_hf, import_hf
from lmforge.stages.common import log


def export_stage(checkpoint: str | Path, out: str | Path, fmt: str = "hf", dtype: str = "float32",
                 verify: bool = False) -> Path:
    """Write `checkpoint` in another runtime's format: "hf" (a Hugging Face folder)."""
    return export_hf(checkpoint, out, dtype=dtype, verify=verify)


def import_hf_stage(folder: str | Path, out: str | Path) -> Path:
    """A Hugging Face Llama folder -> an lmforge checkpoint folder."""
    return import_hf(folder, out, log=lambda msg: log(f"import-hf: {msg}"))
