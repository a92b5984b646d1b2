"""GGUF in (`lmforge import-gguf FILE --out DIR`): a GGUF file of llama.cpp's `llama`, `qwen2`,
`qwen3`, `gemma3`, `gemma2` or `olmo2` architecture as an lmforge checkpoint.

The file is read with the `gguf` package (`GGUFReader`); every tensor is dequantized to float32
with `gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, the K-quants); the
tokenizer is rebuilt from the file's vocabulary (the inverse of `gguf_vocab.gguf_vocab`: a byte-level
BPE with the pre-tokenizer the file names and its merges, or, for `llama`, a SentencePiece-style
BPE with byte fallback whose merges are every split of every token ordered by the token's score,
as transformers converts a SentencePiece model, with a "▁" put before the text only where
`add_space_prefix` is true: Gemma's is false). The result is the folder `save_pretrained` would
write (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the file's
chat template, special tokens and add_bos_token), built in a temporary folder and brought in
with `import_hf`: every check and contract rule of `lmforge import-hf` applies.

Families. The architecture picks the family record (`ARCHS`: the first of `families.FAMILIES`
with that `gguf_arch`; a `llama` file is Llama's, Mistral's included). Tensors are renamed
through the record's two name maps (GGUF -> lmforge -> HF), so Gemma's and OLMo 2's
`post_attention_norm` becomes their `post_attention_layernorm` (the norm after attention) and
Llama's `ffn_norm` its `post_attention_layernorm` (the norm before the MLP). Norms are given back
their HF form (`*norm.weight` minus `Family.gguf_norm_shift`: Gemma's GGUF norms hold 1 + w), and
Q/K rows are un-permuted where the record permutes them (`llama`: llama.cpp rotates adjacent
pairs, lmforge and HF the two halves; the inverse of `gguf._permute_rope_rows`).

config.json says what llama.cpp computes from the file (`llama_cpp.LLAMA_CPP_ARCHS`), in the keys
export/hf_config_out.py writes for the family: head_dim = key_length; for Gemma, GeGLU
(`hidden_activation` gelu_pytorch_tanh), `query_pre_attn_scalar` = head_dim (llama.cpp scales
queries by 1/sqrt(head_dim); dim / heads at the 27B's depth), `layer_types` from llama.cpp's
hard-coded pattern (gemma3: 5 sliding, 1 full; gemma2: alternating), `sliding_window`,
`rope_parameters` per layer type (gemma3: full = rope.freq_base, sliding = 10000) and the
soft-caps (gemma2: the file's, or llama.cpp's 50 and 30). A file without
`tokenizer.chat_template` (the public Gemma 3 270M GGUF has none) gets its family's template
(`families.chat_template_of`), said in one line, where `import_hf` gives a transformers folder
without one the same: one chat format for a model whichever door it comes in by.

Refused, by name: any other architecture or tokenizer; Llama 3.1 RoPE scaling (`rope_freqs`:
its four parameters are not recoverable exactly from the per-frequency factors) and any
`rope.scaling.*` other than none; keys llama.cpp ignores for the architecture while they say
something else (a gemma3 `rope.freq_base_swa` other than 10000, a gemma3 final or attention
soft-cap), a gemma3 file without a window, an olmo2 file with one (OLMo 3's); a tensor this
mapping does not know.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import numpy as np
import torch

from lmforge.config import ModelConfig
from lmforge.export.families import FAMILIES, LLAMA_CPP_ARCHS, Family
from lmforge.export.gguf_in_tokenizer import rebuild_tokenizer, typed_key
from lmforge.export.llama_cpp import require_gguf
from lmforge.export.hf_in import import_hf, renamed
from lmforge.errors import LmforgeError
from lmforge.export.options import ExportError
from lmforge.fileio import save_safetensors

def _families_by_arch() -> dict[str, Family]:
    """llama.cpp architecture -> the family a file of it is imported as (the first record with
    that `gguf_arch`: "llama" is Llama, Mistral's files included)."""
    out: dict[str, Family] = {}
    for family in FAMILIES.values():
        if family.gguf_arch in LLAMA_CPP_ARCHS:
            out.setdefault(family.gguf_arch, family)
    return out


#: llama.cpp architecture -> the family record it is imported as
ARCHS: dict[str, Family] = _families_by_arch()


def _tensor_names(family: Family) -> dict[str, str]:
    """GGUF tensor name -> HF name, "{i}" the layer, from the family's two name maps."""
    hf = dict(family.hf_names)
    return {g: hf[ours] for ours, g in family.gguf_names if ours in hf}


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `gguf._permute_rope_rows`: interleaved pairs per head -> half-split rows."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_config(family: Family, kv: dict, path: Path, real, size, shape: dict) -> dict:
    """The config.json (as `save_pretrained` writes it, and as export/hf_config_out.py writes the family's)
    of the model llama.cpp computes from the file's keys, `LLAMA_CPP_ARCHS` supplying what its
    runtime hard-codes (Gemma's layer pattern, sliding RoPE base, attention scale, soft-caps).

    Raises:
        ExportError: a key whose value llama.cpp ignores or lmforge cannot hold (named).
    """
    arch = family.gguf_arch
    dim, n_heads, n_layers, hd = shape["dim"], shape["n_heads"], shape["n_layers"], shape["head_dim"]
    theta = real("rope.freq_base", 10000.0, "rope_theta")
    for key in ("rope.scaling.type", "rope.scaling.factor"):
        value = kv.get(f"{arch}.{key}")
        if value not in (None, "none", 1, 1.0):
            raise ExportError(f"{path}: {arch}.{key} = {value!r}: lmforge's RoPE has no such scaling (expected none, "
                              f"or factor 1); import the model's Hugging Face folder with `lmforge import-hf` instead.")
    config = {"architectures": [family.architecture], "model_type": family.model_type, "hidden_size": dim,
              "intermediate_size": size("feed_forward_length"), "num_hidden_layers": n_layers,
              "num_attention_heads": n_heads, "num_key_value_heads": shape["n_kv_heads"], "head_dim": hd,
              "rms_norm_eps": real("attention.layer_norm_rms_epsilon", None, "norm_eps"),
              "max_position_embeddings": size("context_length"), "vocab_size": shape["vocab_size"],
              "tie_word_embeddings": shape["tied"], "torch_dtype": "float32"}
    if family.gguf_in_config is not None:  # what llama.cpp computes for the architecture (Gemma's)
        return family.gguf_in_config(family, kv, path, real, size, shape, config, theta)
    window = kv.get(f"{arch}.attention.sliding_window")
    if window and not LLAMA_CPP_ARCHS[arch].window_ignored:  # phi3's is read and not applied
        raise ExportError(f"{path}: {arch}.attention.sliding_window = {window!r}: lmforge imports {arch} "
                          f"files without sliding-window attention (expected none; OLMo 3's, for olmo2) only; "
                          f"import the model's Hugging Face folder with `lmforge import-hf` instead.")
    config.update(hidden_act="silu", rope_theta=theta, rope_scaling=None, **family.gguf_in_keys)
    if family.gguf_in_extra is not None:  # what the architecture adds to Llama's keys (Granite's scalars)
        config.update(family.gguf_in_extra(kv, arch, real, hd))
    nope = LLAMA_CPP_ARCHS[arch].nope_layers(n_layers)
    if nope:  # the layers llama.cpp runs without RoPE, whatever the file says (SmolLM3's every 4th)
        config["no_rope_layers"] = [0 if i in nope else 1 for i in range(n_layers)]
    return config


def hf_folder_from_gguf(path: str | Path, folder: Path, log=None) -> None:
    """Write `folder` as `save_pretrained` would for the model in GGUF `path` (float32 weights).

    The file's architecture picks the family record (`ARCHS`); tensors are renamed through the
    family's GGUF and HF name maps, norms given back their HF form (minus `gguf_norm_shift`),
    q/k rows un-permuted where the family permutes them. A file without `tokenizer.chat_template`
    gives a folder without one, as transformers saves such a model (`import_hf` then takes the
    family's template: `families.chat_template_of`).

    Raises:
        ExportError: an architecture, tokenizer, key or tensor lmforge does not map back (named).
    """
    gguf = require_gguf()
    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError, struct and numpy errors on a damaged file
        raise ExportError(f"{path}: cannot read it as GGUF ({str(exc)[:160]}).") from None
    kv = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = kv.get("general.architecture")
    if arch not in ARCHS:
        raise ExportError(f"{path}: general.architecture = {arch!r}; lmforge imports {', '.join(ARCHS)}.")
    family = ARCHS[arch]

    def num(key: str, default=None):
        value = kv.get(f"{arch}.{key}", default)
        if value is None:
            raise ExportError(f"{path}: no {arch}.{key}; a {arch} GGUF has it.")
        return value

    def real(key: str, default=None, field: str | None = None) -> float:
        """A float key: a finite number (refused naming the key otherwise), within the range of the
        ModelConfig `field` it becomes."""
        value = typed_key(kv, f"{arch}.{key}", "number", path, default)
        if value is None:
            raise ExportError(f"{path}: no {arch}.{key}; a {arch} GGUF has it.")
        value = float(value)
        if field is not None:
            low, high, low_open, high_open = ModelConfig.__dataclass_fields__[field].metadata["bounds"]
            if not ((low < value if low_open else low <= value) and (value < high if high_open else value <= high)):
                raise ExportError(f"{path}: {arch}.{key} = {value!r}: expected {low:g} {'<' if low_open else '<='} "
                                  f"value {'<' if high_open else '<='} {high:g} (lmforge's model.{field}); lmforge "
                                  f"cannot hold this model. Re-convert it from the model's Hugging Face folder.")
        return value

    def size(key: str, default=None) -> int:
        """A size field: a positive integer, or the file is refused naming the field."""
        value = num(key, default)
        ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
            and np.isfinite(value) and value == int(value) and int(value) > 0
        if not ok:
            raise ExportError(f"{path}: {arch}.{key} = {value!r}: expected a positive integer; the file does not "
                              f"describe a model lmforge can build. Re-convert it from the model's Hugging Face "
                              f"folder.")
        return int(value)

    dim, n_heads = size("embedding_length"), size("attention.head_count")
    n_kv = size("attention.head_count_kv", n_heads)
    hd = size("attention.key_length", dim // n_heads if dim % n_heads == 0 else 0)
    if size("attention.value_length", hd) != hd or size("rope.dimension_count", hd) != hd:
        raise ExportError(f"{path}: key_length {hd}, value_length {num('attention.value_length', hd)}, rope over "
                          f"{num('rope.dimension_count', hd)}: lmforge's heads have one size for keys and values and "
                          f"rotate whole heads (expected all three equal).")
    names = _tensor_names(family)
    shift = np.float32(family.gguf_norm_shift)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        pattern = names.get(f"blk.{{i}}.{m.group(2)}" if m else t.name)
        if pattern is None:
            known = ", ".join(n.replace("{i}", "N") for n in names)
            why = ("Llama 3.1 RoPE scaling, whose four parameters a GGUF does not keep" if t.name.startswith("rope_freqs")
                   else f"known in {arch}: {known}")
            raise ExportError(f"{path}: tensor {t.name!r} has no lmforge counterpart ({why}); import the model's "
                              f"Hugging Face folder with `lmforge import-hf` instead.")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        if shift and t.name.endswith("norm.weight"):
            a = a - shift  # llama.cpp's Gemma norms hold 1 + w; transformers' hold w
        if family.gguf_permute_qk and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            a = _unpermute_rope_rows(a, n_heads if ".attn_q." in t.name else n_kv)
        state[pattern.format(i=m.group(1)) if m else pattern] = torch.from_numpy(np.ascontiguousarray(a))
    if "model.embed_tokens.weight" not in state:
        raise ExportError(f"{path}: no token_embd.weight tensor.")
    shape = {"dim": dim, "n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd, "n_layers": size("block_count"),
             "vocab_size": int(state["model.embed_tokens.weight"].shape[0]), "tied": "lm_head.weight" not in state}
    config = _hf_config(family, kv, path, real, size, shape)
    window = kv.get(f"{arch}.attention.sliding_window")
    if window and LLAMA_CPP_ARCHS[arch].window_ignored and log is not None:
        log(f"{path}: {arch}.attention.sliding_window = {window}: llama.cpp does not apply it (ggml-org/llama.cpp#13676); "
            f"every layer attends to every key, as llama.cpp computes")
    tj, tok_config = rebuild_tokenizer(kv, path, family.end_of_turn)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_safetensors(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False),
                                                  encoding="utf-8")


def import_gguf(path: str | Path, out: str | Path, log=None, eos_token: str = "") -> Path:
    """Turn a GGUF file into an lmforge checkpoint folder (atomically, through `import_hf`).

    Args:
        path: the .gguf file (architecture llama, qwen2, qwen3, gemma3, gemma2 or olmo2; any
            quantization gguf reads).
        out: the checkpoint folder to write (refused if it holds other files, as import-hf does).
        log, eos_token: as `import_hf` (its lines name `path` where they would name the
            converted folder, a temporary: "chat template: FILE has none; using ...").
    Raises:
        ExportError: not a file; see `hf_folder_from_gguf` and `import_hf`.
    """
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path} is not a file; give the .gguf file to import.")
    with tempfile.TemporaryDirectory(prefix="lmforge-gguf-") as tmp:
        hf_folder_from_gguf(path, Path(tmp), log=log)
        said = (lambda msg: log(msg.replace(str(tmp), str(path)))) if log else None
        try:
            return import_hf(tmp, out, log=said, eos_token=eos_token, command="`lmforge import-gguf`")
        except LmforgeError as exc:  # its words name the converted folder, a temporary: name the file given
            parts = [("config.json", "its model keys"),
                     ("tokenizer_config.json", "its tokenizer.ggml.* special tokens, add_bos_token and "
                                               "tokenizer.chat_template"),
                     ("tokenizer.json", "its tokenizer.ggml.* vocabulary"), ("model.safetensors", "its tensors")]
            raise renamed(exc, [(f"--from {tmp}", str(path)),
                                *((f"{Path(tmp) / name}", f"{path} ({what})") for name, what in parts),
                                (f"{tmp}/", f"{path}: "), (str(tmp), str(path))]) from None


__all__ = ["ARCHS", "import_gguf", "hf_folder_from_gguf"]
