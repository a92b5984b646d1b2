"""The options of `lmforge export`, checked in one place: the formats, the weight types each
writes, and the flags that apply to one format only; and the range of each weight type
(`check_dtype_range`), so no exporter writes an infinity."""

from __future__ import annotations

import torch

from lmforge.errors import LmforgeError

#: Weight types per format ("hf": a transformers folder; "gguf": one file for llama.cpp).
EXPORT_DTYPES = {"hf": ("float32", "bfloat16", "float16"), "gguf": ("float32", "float16", "bfloat16", "q8_0"),
                 "peft": ("float32",)}  # peft: a LoRA checkpoint's adapters (lmforge.export.peft)


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
    if fmt == "peft" and (verify or force):
        raise ExportError("--format peft takes neither --verify nor --force: it writes the adapters only (load them "
                          "with peft on the --format hf export of the base) and replaces only an earlier export.")
    if fmt == "hf" and dtype == "q8_0":
        raise ExportError("--dtype q8_0 is for --format gguf; a Hugging Face export is float32, bfloat16 or float16.")
    if fmt == "hf" and force:
        raise ExportError("--force is for --format gguf; a Hugging Face export replaces only an earlier export "
                          "folder, never anything else.")
    if dtype not in EXPORT_DTYPES[fmt]:
        raise ExportError(f"--dtype {dtype!r}: --format {fmt} writes one of {', '.join(EXPORT_DTYPES[fmt])}.")


# -- the range of a weight type: one check for every exporter (export_hf, export_gguf) --------
#: dtype -> (the type a value is stored as, the divisor applied first). q8_0 (GGUF) stores blocks of
#: 32 values as int8 times one float16 scale |block max| / 127 (ggml's quantize_row_q8_0).
_NARROW_DTYPES = {"float16": (torch.float16, 1.0), "bfloat16": (torch.bfloat16, 1.0), "q8_0": (torch.float16, 127.0)}


def check_dtype_range(name: str, values: object, dtype: str, note: str = "") -> None:
    """Refuse to store `values` (a float tensor or array) as `dtype` when the largest magnitude
    would round to infinity there: float16 holds |x| <= 65504, bfloat16 |x| <= 3.39e38, q8_0
    |x| <= 127 x 65504 (its float16 block scale). float32 (and any other name) passes.
    Exact: the largest |x| is converted the way the writer converts it (float32 arithmetic,
    round to nearest), and conversion is monotonic.

    Raises:
        ExportError: naming the tensor, its largest magnitude, the dtype's range and the
        dtypes that would hold it.
    """
    if dtype not in _NARROW_DTYPES:
        return
    t = torch.as_tensor(values).detach()
    if t.numel() == 0 or not t.is_floating_point():
        return
    peak = t.abs().max().to(torch.float32)
    target, divisor = _NARROW_DTYPES[dtype]
    if bool(torch.isfinite((peak / divisor).to(target))):
        return
    limit = torch.finfo(target).max * divisor
    fits = [d for d in ("bfloat16", "float32") if d != dtype and (
        d == "float32" or bool(torch.isfinite((peak / _NARROW_DTYPES[d][1]).to(_NARROW_DTYPES[d][0]))))]
    raise ExportError(f"weight {name!r} holds a value of magnitude {float(peak):.6g}, beyond what {dtype} stores "
                      f"(|x| <= {limit:.6g}{note}): it would be written as infinity. Export with --dtype "
                      f"{' or '.join(fits)}, which holds it.")


__all__ = ["EXPORT_DTYPES", "ExportError", "check_dtype_range", "check_export_options"]
