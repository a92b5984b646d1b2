"""`lmforge export`, `lmforge import-hf` and `lmforge import-gguf`: to and from other runtimes (lmforge.export)."""

from __future__ import annotations

from pathlib import Path

from lmforge.errors import LmforgeError
from lmforge.export import export_gguf, export_hf, import_gguf, import_hf
from lmforge.stages.common import log


def export_stage(checkpoint: str | Path, out: str | Path, fmt: str = "hf", dtype: str = "float32",
                 verify: bool = False, force: bool = False) -> Path:
    """Write `checkpoint` in another runtime's format: "hf" (a Hugging Face folder) or "gguf"
    (one file for llama.cpp; `force` replaces an existing file).

    Raises:
        LmforgeError: a flag that does not apply to the format; see `export_hf`, `export_gguf`.
    """
    if fmt == "gguf":
        if verify:
            raise LmforgeError("--verify compares with transformers (--format hf); for GGUF run `make interop`.")
        return export_gguf(checkpoint, out, dtype=dtype, force=force)
    if dtype == "q8_0":
        raise LmforgeError("--dtype q8_0 is for --format gguf; a Hugging Face export is float32, bfloat16 or float16.")
    if force:
        raise LmforgeError("--force is for --format gguf; a Hugging Face export replaces only an earlier export "
                           "folder, never anything else.")
    return export_hf(checkpoint, out, dtype=dtype, verify=verify)


def import_hf_stage(folder: str | Path, out: str | Path, eos_token: str = "") -> Path:
    """A Hugging Face Llama-family folder -> an lmforge checkpoint folder (`eos_token`: the
    setting tokenizer.eos_token, the document terminator where the folder's is not found)."""
    return import_hf(folder, out, log=lambda msg: log(f"import-hf: {msg}"), eos_token=eos_token)


def import_gguf_stage(path: str | Path, out: str | Path, eos_token: str = "") -> Path:
    """A GGUF file (llama, qwen2, qwen3) -> an lmforge checkpoint folder (through import-hf's checks)."""
    return import_gguf(path, out, log=lambda msg: log(f"import-gguf: {msg}"), eos_token=eos_token)
