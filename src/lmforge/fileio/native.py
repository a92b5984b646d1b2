"""Native readers and writers (safetensors, tokenizers), also for a path whose bytes are not UTF-8."""

from __future__ import annotations

import json
import os
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
    """Every tensor of the safetensors file `path` (name -> CPU tensor, in the file's dtypes), as
    `safetensors.torch.load_file` gives them, read through `SafetensorsReader`: the process holds
    the tensors once (load_file's mapping of the file counts in resident memory beside its copy:
    twice the weights at its peak), and any path works, also one whose bytes are not UTF-8.

    Raises:
        OSError, ValueError: see `SafetensorsReader`."""
    import torch

    with SafetensorsReader(path) as reader:
        out = {}
        for name, (dtype, shape, _, _) in reader.entries.items():
            out[name] = torch.empty(shape, dtype=dtype)
            reader.read_into(name, out[name])
        return out


def save_safetensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, also into a folder whose name is not UTF-8."""
    from safetensors.torch import save, save_file

    native = _native(path)
    if native is not None:
        save_file(tensors, native, metadata=metadata)
    else:
        Path(path).write_bytes(save(tensors, metadata=metadata))


#: safetensors' dtype names (the format's specification, huggingface/safetensors) as torch dtypes.
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_READ_BYTES = 64 << 20  # one read() call at most: Linux returns at most ~2 GiB a call


class SafetensorsReader:
    """A safetensors file read tensor by tensor straight into tensors the caller owns: no copy of
    the file in memory and no mapping of it. (`safetensors.torch.load_file` maps the whole file
    and copies every tensor out of the mapping: twice the weights' bytes resident at once, which
    on a 1 GB model is the peak of a whole fine-tuning run.) The header is checked as
    safetensors' own reader checks it: a known dtype, each tensor's bytes = its elements x its
    element size, the data areas back to back from the header's end to the file's end.

    `entries`: name -> (torch dtype, shape, start, end), the byte offsets relative to the data
    area; `metadata`: the header's `__metadata__`. Use as a context manager.

    Raises:
        OSError: the file cannot be opened or read.
        ValueError: not a safetensors file, or a damaged one (named in the message).
    """

    def __init__(self, path: str | Path):
        import torch

        self.path = Path(path)
        self._f = open(path, "rb", buffering=0)
        try:
            head = self._f.read(8)
            if len(head) != 8:
                raise ValueError("shorter than a safetensors header")
            n = int.from_bytes(head, "little")
            size = os.fstat(self._f.fileno()).st_size
            if n > min(100 << 20, size - 8):
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(self._f.read(n))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            meta = header.pop("__metadata__", None)
            self.metadata = meta if isinstance(meta, dict) else {}
            self._data = 8 + n
            self.entries = {}
            for name, e in header.items():
                try:
                    dtype = getattr(torch, SAFETENSORS_DTYPES[e["dtype"]])
                    shape, (start, end) = tuple(int(x) for x in e["shape"]), (int(x) for x in e["data_offsets"])
                except (KeyError, TypeError, ValueError, AttributeError):
                    raise ValueError(f"tensor {name!r}: an entry safetensors does not define ({e!r:.200})") from None
                numel = 1
                for x in shape:
                    numel *= x
                if min(shape, default=0) < 0 or end - start != numel * dtype.itemsize:
                    raise ValueError(f"tensor {name!r}: {end - start} bytes for shape {list(shape)} of {dtype}")
                self.entries[name] = (dtype, shape, start, end)
            at = 0
            for _, _, start, end in sorted(self.entries.values(), key=lambda x: (x[2], x[3])):
                if start != at:
                    raise ValueError(f"the tensors' data areas are not back to back (byte {start}, expected {at})")
                at = end
            if self._data + at != size:
                raise ValueError(f"the data ends at byte {self._data + at}, the file at {size} (cut short or padded)")
        except BaseException:
            self._f.close()
            raise

    def read_into(self, name: str, out) -> None:
        """Tensor `name`'s bytes into `out`: a contiguous CPU tensor of the entry's dtype and shape."""
        dtype, shape, start, end = self.entries[name]
        if out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"tensor {name!r}: {dtype} {list(shape)} cannot be read into {out.dtype} "
                             f"{list(out.shape)} on {out.device}")
        if end == start:
            return
        import torch

        view = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")
        self._f.seek(self._data + start)
        done = 0
        while done < len(view):
            got = self._f.readinto(view[done:done + _READ_BYTES])
            if not got:
                raise ValueError(f"tensor {name!r}: the file ends inside its data")
            done += got

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
