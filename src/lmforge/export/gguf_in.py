"""GGUF in (`lmforge import-gguf FILE --out DIR`): a GGUF file of llama.cpp's `llama`, `qwen2`
or `qwen3` architecture as an lmforge checkpoint.

The file is read with the `gguf` package (`GGUFReader`); every tensor is dequantized to float32
with `gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, the K-quants); the
tokenizer is rebuilt from the file's vocabulary (the inverse of `gguf.gguf_vocab`: a byte-level
BPE with the pre-tokenizer the file names and its merges, or, for `llama`, a SentencePiece-style
BPE with byte fallback whose merges are every split of every token ordered by the token's score,
as transformers converts a SentencePiece model). The result is the folder `save_pretrained`
would write (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the
file's chat template, special tokens and add_bos_token), built in a temporary folder and brought
in with `import_hf`: every check and contract rule of `lmforge import-hf` applies.

Q and K rows of the `llama` architecture are un-permuted (llama.cpp rotates adjacent pairs,
lmforge and HF the two halves: the inverse of `gguf._permute_rope_rows`). Refused, by name: any
other architecture or tokenizer, Llama 3.1 RoPE scaling (`rope_freqs`: its four parameters are
not recoverable exactly from the per-frequency factors), a tensor this mapping does not know.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import numpy as np
import torch

from lmforge.export.gguf import LLAMA3_PATTERN, QWEN2_PATTERN, SPM_SPACE, require_gguf
from lmforge.export.hf_in import import_hf
from lmforge.errors import LmforgeError
from lmforge.export.options import ExportError
from lmforge.fileio import save_safetensors

#: llama.cpp architecture -> (HF architectures entry, model_type)
ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
         "qwen3": ("Qwen3ForCausalLM", "qwen3")}
#: GGUF tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}.")
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `gguf._permute_rope_rows`: interleaved pairs per head -> half-split rows."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_level_pre(pre: str, path: Path) -> tuple[dict, bool]:
    """(tokenizer.json pre_tokenizer, model.ignore_merges) for llama.cpp's pre-tokenizer `pre`."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre in ("gpt-2", "gpt2"):
        return byte_level, False
    if pre == "smollm":
        return {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}, False
    patterns = {"llama-bpe": (LLAMA3_PATTERN, True), "smaug-bpe": (LLAMA3_PATTERN, False), "qwen2": (QWEN2_PATTERN, False)}
    if pre not in patterns:
        raise ExportError(f"{path}: tokenizer.ggml.pre = {pre!r}; lmforge rebuilds gpt-2, smollm, llama-bpe, smaug-bpe "
                          f"and qwen2 byte-level tokenizers (and SentencePiece-style `llama` ones). Convert the model "
                          f"from its Hugging Face folder with `lmforge import-hf` instead.")
    pattern, ignore = patterns[pre]
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, {**byte_level, "use_regex": False}]}, ignore


def rebuild_tokenizer(kv: dict, path: Path) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) from a GGUF's tokenizer.* keys.

    Raises:
        ExportError: a tokenizer model or pre-tokenizer lmforge does not rebuild; no tokens.
    """
    gguf = require_gguf()
    T = gguf.TokenType
    model, tokens = kv.get("tokenizer.ggml.model"), kv.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ExportError(f"{path}: no tokenizer.ggml.tokens; the file has no vocabulary to rebuild a tokenizer from.")
    types = kv.get("tokenizer.ggml.token_type") or [int(T.NORMAL)] * len(tokens)
    added, vocab = [], {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == T.UNUSED:
            continue  # an id the tokenizer never produces
        if kind in (T.CONTROL, T.USER_DEFINED):
            added.append({"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": kind == T.CONTROL})
        vocab[text] = i  # added tokens too: HF gives an added token the model's id for its text
    unk = kv.get("tokenizer.ggml.unknown_token_id")
    if model == "gpt2":
        pre, ignore_merges = _byte_level_pre(kv.get("tokenizer.ggml.pre", "gpt-2"), path)
        merges = [m.split(" ") for m in kv.get("tokenizer.ggml.merges") or []]
        bpe = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
               "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
               "vocab": vocab, "merges": merges}
        tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
              "pre_tokenizer": pre, "post_processor": None,
              "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
              "model": bpe}
    elif model == "llama":
        scores = kv.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        pieces = {t: i for t, i in vocab.items() if types[i] not in (T.CONTROL, T.USER_DEFINED, T.UNKNOWN, T.BYTE)}
        merges = []  # every split into two pieces, by the score of the whole (transformers' SentencePiece converter)
        for t in sorted(pieces, key=lambda t: (-scores[pieces[t]], pieces[t])):
            splits = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in pieces and t[k:] in pieces]
            merges += sorted(splits, key=lambda p: (pieces[p[0]], pieces[p[1]]))
        prefix = bool(kv.get("tokenizer.ggml.add_space_prefix", True))
        replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPM_SPACE}
        norm = [{"type": "Prepend", "prepend": SPM_SPACE}, replace] if prefix else [replace]
        decoder = [{"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "}, {"type": "ByteFallback"},
                   {"type": "Fuse"}] + ([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else [])
        bpe = {"type": "BPE", "dropout": None, "unk_token": tokens[unk] if unk is not None else None,
               "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
               "ignore_merges": False, "vocab": vocab, "merges": [list(m) for m in merges]}
        tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
              "normalizer": {"type": "Sequence", "normalizers": norm}, "pre_tokenizer": None, "post_processor": None,
              "decoder": {"type": "Sequence", "decoders": decoder}, "model": bpe}
    else:
        raise ExportError(f"{path}: tokenizer.ggml.model = {model!r}; lmforge rebuilds `gpt2` (byte-level BPE) and "
                          f"`llama` (SentencePiece-style BPE) tokenizers.")
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                    "add_bos_token": bool(kv.get("tokenizer.ggml.add_bos_token", model == "llama")),
                    "add_eos_token": False}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"),
                      ("unk", "unknown_token_id")):
        i = kv.get(f"tokenizer.ggml.{key}")
        if i is not None and 0 <= i < len(tokens):
            config[f"{name}_token"] = tokens[i]
    if not config["add_bos_token"] and config.get("bos_token") == config.get("eos_token"):
        config.pop("bos_token", None)  # lmforge's export writes the EOS as a BOS-less model's bos_token_id
    if kv.get("tokenizer.chat_template"):
        config["chat_template"] = kv["tokenizer.chat_template"]
    return tj, config


def hf_folder_from_gguf(path: str | Path, folder: Path) -> None:
    """Write `folder` as `save_pretrained` would for the model in GGUF `path` (float32 weights).

    Raises:
        ExportError: an architecture, tokenizer or tensor lmforge does not map back (named).
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

    def num(key: str, default=None):
        value = kv.get(f"{arch}.{key}", default)
        if value is None:
            raise ExportError(f"{path}: no {arch}.{key}; a {arch} GGUF has it.")
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
    if hd * n_heads != dim or int(num("rope.dimension_count", hd)) != hd:
        raise ExportError(f"{path}: head size {hd} (rope over {num('rope.dimension_count', hd)}) with {n_heads} heads "
                          f"of a {dim}-wide model; lmforge rotates whole heads of dim / n_heads.")
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name) or re.fullmatch(r"(\w+)\.(weight|bias)", t.name)
        base = _LAYER.get(m.group(2)) if m and m.lastindex == 3 else _TOP.get(m.group(1)) if m else None
        if base is None:
            why = ("Llama 3.1 RoPE scaling, whose four parameters a GGUF does not keep" if t.name.startswith("rope_freqs")
                   else f"known: token_embd, output_norm, output, blk.N.{{{', '.join(_LAYER)}}}")
            raise ExportError(f"{path}: tensor {t.name!r} has no lmforge counterpart ({why}); import the model's "
                              f"Hugging Face folder with `lmforge import-hf` instead.")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        kind = m.group(2) if m.lastindex == 3 else m.group(1)
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            a = _unpermute_rope_rows(a, n_heads if kind == "attn_q" else n_kv)
        name = f"model.layers.{m.group(1)}.{base}.{m.group(3)}" if m.lastindex == 3 else f"{base}.{m.group(2)}"
        state[name] = torch.from_numpy(np.ascontiguousarray(a))
    if "model.embed_tokens.weight" not in state:
        raise ExportError(f"{path}: no token_embd.weight tensor.")
    hf_arch, model_type = ARCHS[arch]
    config = {"architectures": [hf_arch], "model_type": model_type, "hidden_size": dim,
              "intermediate_size": size("feed_forward_length"), "num_hidden_layers": size("block_count"),
              "num_attention_heads": n_heads, "num_key_value_heads": n_kv, "head_dim": hd, "hidden_act": "silu",
              "rms_norm_eps": float(num("attention.layer_norm_rms_epsilon")),
              "rope_theta": float(num("rope.freq_base", 10000.0)), "max_position_embeddings": size("context_length"),
              "vocab_size": int(state["model.embed_tokens.weight"].shape[0]),
              "tie_word_embeddings": "lm_head.weight" not in state, "torch_dtype": "float32"}
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if arch == "qwen2":
        config.update(use_sliding_window=False)
    tj, tok_config = rebuild_tokenizer(kv, path)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_safetensors(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False),
                                                  encoding="utf-8")


def import_gguf(path: str | Path, out: str | Path, log=None, eos_token: str = "") -> Path:
    """Turn a GGUF file into an lmforge checkpoint folder (atomically, through `import_hf`).

    Args:
        path: the .gguf file (architecture llama, qwen2 or qwen3; any quantization gguf reads).
        out: the checkpoint folder to write (refused if it holds other files, as import-hf does).
        log, eos_token: as `import_hf`.
    Raises:
        ExportError: not a file; see `hf_folder_from_gguf` and `import_hf`.
    """
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path} is not a file; give the .gguf file to import.")
    with tempfile.TemporaryDirectory(prefix="lmforge-gguf-") as tmp:
        hf_folder_from_gguf(path, Path(tmp))
        try:
            return import_hf(tmp, out, log=log, eos_token=eos_token)
        except LmforgeError as exc:  # its words name the converted folder, a temporary: name the file given
            msg = str(exc).replace(f"{tmp}/", f"{path} (converted to Hugging Face files) ").replace(str(tmp), str(path))
            try:
                renamed = type(exc)(msg)
            except TypeError:  # an error class with other arguments: keep it as it is
                raise exc from None
            raise renamed from None


__all__ = ["import_gguf", "hf_folder_from_gguf", "rebuild_tokenizer"]
