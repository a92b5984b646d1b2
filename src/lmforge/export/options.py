"""The options of `lmforge export`, checked in one place: the formats, the weight types each
writes, and the flags that apply to one format only."""

from __future__ import annotations

from lmforge.errors import LmforgeError

#: Weight types per format ("hf": a transformers folder; "gguf": one file for llama.cpp).
EXPORT_DTYPES = {"hf": ("float32", "bfloat16", "float16"), "gguf": ("float32", "float16", "bfloat16", "q8_0")}


class ExportError(LmforgeError):
    """A checkpoint cannot be exported as asked, or a folder cannot be imported from the
    Hugging Face format."""


def check_export_options(fmt: str, dtype: str = "float32", verify: bool = False, force: bool = False) -> None:
    """Refuse an export option that does not apply: called first by `export_hf` and `export_gguf`.

    Raises:
        ExportError: an unknown format or weight type, q8_0 or --force with "hf", --verify with "gguf".
    """
    if fmt not in EXPORT_DTYPES:
        raise ExportError(f"--format {fmt!r}: expected one of {', '.join(EXPORT_DTYPES)}.")
    if fmt == "gguf" and verify:
        raise ExportError("--verify compares with transformers (--format hf); for GGUF run `make interop`.")
    if fmt == "hf" and dtype == "q8_0":
        raise ExportError("--dtype q8_0 is for --format gguf; a Hugging Face export is float32, bfloat16 or float16.")
    if fmt == "hf" and force:
        raise ExportError("--force is for --format gguf; a Hugging Face export replaces only an earlier export "
                          "folder, never anything else.")
    if dtype not in EXPORT_DTYPES[fmt]:
        raise ExportError(f"--dtype {dtype!r}: --format {fmt} writes one of {', '.join(EXPORT_DTYPES[fmt])}.")


__all__ = ["EXPORT_DTYPES", "ExportError", "check_export_options"]
