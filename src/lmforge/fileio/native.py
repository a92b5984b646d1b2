"""Native readers and writers (safetensors, tokenizers), also for a path whose bytes are not UTF-8."""

from __future__ import annotations

import json
from pathlib import Path


# -- native readers and writers (safetensors, tokenizers) take str paths, which must be UTF-8 ------
def _native(path: str | Path) -> str | None:
    """str(path) when a native library can take it, None when its bytes are not UTF-8."""
    try:
        str(path).encode("utf-8")
        return str(path)
    except UnicodeEncodeError:
        return None


def load_safetensors(path: str | Path) -> dict:
    """`safetensors.torch.load_file`, also for a path whose bytes are not UTF-8 (read by Python)."""
    from safetensors.torch import load, load_file

    native = _native(path)
    return load_file(native) if native is not None else load(Path(path).read_bytes())


def save_safetensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, also into a folder whose name is not UTF-8."""
    from safetensors.torch import save, save_file

    native = _native(path)
    if native is not None:
        save_file(tensors, native, metadata=metadata)
    else:
        Path(path).write_bytes(save(tensors, metadata=metadata))


def safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file (its JSON header), read without the weights.

    Raises:
        ValueError: not a safetensors header.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n > 100 * 1024 * 1024:
            raise ValueError(f"a header of {n} bytes")
        header = json.loads(f.read(n))
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def load_hf_tokenizer(path: str | Path):
    """`tokenizers.Tokenizer.from_file`, also for a path whose bytes are not UTF-8."""
    from tokenizers import Tokenizer

    native = _native(path)
    return Tokenizer.from_file(native) if native is not None else Tokenizer.from_str(
        Path(path).read_text(encoding="utf-8"))


def save_hf_tokenizer(tok, path: str | Path) -> None:
    """`tokenizers.Tokenizer.save` (pretty JSON), also into a folder whose name is not UTF-8."""
    native = _native(path)
    if native is not None:
        tok.save(native)
    else:
        Path(path).write_text(tok.to_str(pretty=True), encoding="utf-8")
