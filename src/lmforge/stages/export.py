"""`lmforge export`, `lmforge import-hf` and `lmforge import-gguf`: to and from other runtimes (lmforge.export)."""

from __future__ import annotations

from pathlib import Path

from lmforge.export import check_export_options, export_gguf, export_hf, export_peft, import_gguf, import_hf
from lmforge.export.hf import EXPORT_OUTPUT, IMPORT_OUTPUT
from lmforge.export.peft import PEFT_OUTPUT
from lmforge.fileio import check_not_input, check_output, check_user_file
from lmforge.stages.common import log


def export_stage(checkpoint: str | Path, out: str | Path, fmt: str = "hf", dtype: str = "float32",
                 verify: bool = False, force: bool = False, evaluation: str | Path | None = None) -> Path:
    """Write `checkpoint` in another runtime's format: "hf" (a Hugging Face folder) or "gguf"
    (one file for llama.cpp; `force` replaces an existing file) or "peft" (a LoRA checkpoint's
    adapters as a PEFT adapter folder).

    Raises:
        ExportError: a format, weight type or flag that does not apply (the one check,
        `lmforge.export.check_export_options`, run by each writer); see `export_hf`, `export_gguf`.
    """
    writers = {"hf": export_hf, "gguf": export_gguf, "peft": export_peft}
    if fmt not in writers:
        check_export_options(fmt)  # an unknown format: refused with the one check's message
    if evaluation is not None:
        if fmt != "hf":
            from lmforge.export import ExportError

            raise ExportError(f"--evaluation applies to --format hf (the model card); --format {fmt} has no card.")
    # never an input, --force or not: the checkpoint's files, the evaluation JSON the card reads
    inputs = [("--checkpoint", checkpoint), ("--evaluation", evaluation)]
    check_not_input(out, inputs, own_check=export_output_check(fmt, out, force, inputs))
    if evaluation is not None:
        return export_hf(checkpoint, out, dtype=dtype, verify=verify, force=force, evaluation=evaluation)
    return writers[fmt](checkpoint, out, dtype=dtype, verify=verify, force=force)


def import_hf_stage(folder: str | Path, out: str | Path, eos_token: str = "") -> Path:
    """A Hugging Face Llama-family folder -> an lmforge checkpoint folder (`eos_token`: the
    setting tokenizer.eos_token, the document terminator where the folder's is not found)."""
    check_not_input(out, [("the Hugging Face folder", folder)], own_check=_import_output(out))  # never inside it
    return import_hf(folder, out, log=lambda msg: log(f"import-hf: {msg}"), eos_token=eos_token)


def import_gguf_stage(path: str | Path, out: str | Path, eos_token: str = "") -> Path:
    """A GGUF file (llama, qwen2, qwen3, gemma3, gemma2, olmo2) -> an lmforge checkpoint folder (through import-hf's checks)."""
    check_not_input(out, [("the GGUF file", path)], own_check=_import_output(out, "`lmforge import-gguf`"))
    return import_gguf(path, out, log=lambda msg: log(f"import-gguf: {msg}"), eos_token=eos_token)


def export_output_check(fmt: str, out: str | Path, force: bool, inputs=()):
    """The export writer's own check of `out` (it runs it again before any work), as a function;
    an unknown format has none (the one check of the options refuses it). `inputs`: what a
    GGUF file may not be ((name, path) pairs, `fileio.check_user_file`), said before "exists"."""
    if fmt not in ("hf", "gguf", "peft"):
        return None
    if fmt == "gguf":
        return lambda: check_user_file(out, force, inputs)
    return _export_output(fmt, out, force)


def _export_output(fmt: str, out: str | Path, force: bool):
    """The export writer's own check of `out` (it runs it again before any work)."""
    if fmt == "gguf":
        return lambda: check_user_file(out, force)
    command, what = {"hf": (EXPORT_OUTPUT, "`lmforge export`"), "peft": (PEFT_OUTPUT, "`lmforge export --format peft`")}[fmt]
    return lambda: check_output(Path(out), command, what, replace_whole=True)


def import_output_check(out: str | Path, command: str = "`lmforge import-hf`"):
    """import-hf's (or import-gguf's) own check of `out`, as a function (for the command line's
    check of its settings files, `cli._not_settings`)."""
    return _import_output(out, command)


def _import_output(out: str | Path, command: str = "`lmforge import-hf`"):
    """import-hf's (or import-gguf's) own check of `out` (it runs it again before any write)."""
    return lambda: check_output(Path(out), IMPORT_OUTPUT, command, replace_whole=True)
