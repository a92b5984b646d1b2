"""The tokenizer of a GGUF file rebuilt as a tokenizer.json (`rebuild_tokenizer`, for
`lmforge import-gguf`): a byte-level BPE with the pre-tokenizer the file names and its merges, or,
for `llama`, a SentencePiece-style BPE with byte fallback; every key read typed (`typed_key`: a
value of another type is refused naming the key, as llama.cpp refuses it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lmforge.export.gguf_vocab import LLAMA3_PATTERN, QWEN2_PATTERN, SPM_SPACE
from lmforge.export.llama_cpp import require_gguf, rstrip_by_name, rstrip_rule
from lmforge.export.options import ExportError


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)) \
        and bool(np.isfinite(value))


def typed_key(kv: dict, key: str, kind: str, path: Path, default=None):
    """GGUF key `key` as `kind` ("number", "int", "bool", "str", "strs": a list of strings, "numbers",
    "ints"), or `default` where the file has no such key.

    Raises:
        ExportError: a value of another type (a number written as a string, ...), naming the key,
        the value and the type expected.
    """
    value = kv.get(key)
    if value is None:
        return default
    scalar = {"number": _is_number, "int": lambda v: _is_number(v) and v == int(v),
              "bool": lambda v: isinstance(v, (bool, np.bool_)), "str": lambda v: isinstance(v, str)}
    item = {"strs": "str", "numbers": "number", "ints": "int"}.get(kind)
    ok = isinstance(value, list) and all(scalar[item](v) for v in value) if item else scalar[kind](value)
    if not ok:
        want = {"number": "a number (float32)", "int": "an integer", "bool": "a boolean", "str": "a string",
                "strs": "an array of strings", "numbers": "an array of numbers",
                "ints": "an array of integers"}[kind]
        shown = repr(value) if not isinstance(value, list) else f"an array of {len(value)} ({repr(value[:3])[:80]}...)"
        raise ExportError(f"{path}: {key} = {shown}: expected {want}, as llama.cpp's convert_hf_to_gguf.py writes it "
                          f"(llama.cpp refuses such a file too). Re-convert the model from its Hugging Face folder, or "
                          f"import that folder with `lmforge import-hf`.")
    if kind in ("number", "int"):
        return float(value) if kind == "number" else int(value)
    if kind == "bool":
        return bool(value)
    return value


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


def rebuild_tokenizer(kv: dict, path: Path, end_of_turn: str | None = None) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) from a GGUF's tokenizer.* keys.

    CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens. A token that
    ends generation (the file's EOS, EOT or EOM id, or spelled `end_of_turn`: the family's turn
    end, Gemma's "<end_of_turn>") is special even where the file types it NORMAL: llama.cpp's
    converter wrote Gemma's <end_of_turn> as a normal token, and llama.cpp's loader makes such a
    token a control token (`llama_vocab::impl::load`); lmforge does as llama.cpp does. Where the
    file's general.name holds "phi3" / "phi-3", llama.cpp strips the spaces after its specials
    (`llama_cpp.rstrip_rule`): those added tokens get rstrip = true.

    Raises:
        ExportError: a tokenizer model or pre-tokenizer lmforge does not rebuild; no tokens.
    """
    gguf = require_gguf()
    T = gguf.TokenType
    model = typed_key(kv, "tokenizer.ggml.model", "str", path)
    tokens = typed_key(kv, "tokenizer.ggml.tokens", "strs", path)
    if not tokens:
        raise ExportError(f"{path}: no tokenizer.ggml.tokens; the file has no vocabulary to rebuild a tokenizer from.")
    types = list(typed_key(kv, "tokenizer.ggml.token_type", "ints", path) or [int(T.NORMAL)] * len(tokens))
    if len(types) != len(tokens):
        raise ExportError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} "
                          f"tokenizer.ggml.tokens: expected one type per token. Re-convert the model.")
    ids = {k: typed_key(kv, f"tokenizer.ggml.{k}", "int", path) for k in
           ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "padding_token_id", "unknown_token_id")}
    named = [ids[f"{k}_token_id"] for k in ("eos", "eot", "eom")]
    named += [i for i, t in enumerate(tokens) if end_of_turn and t == end_of_turn]
    for i in named:
        if isinstance(i, int) and 0 <= i < len(tokens) and types[i] == T.NORMAL:
            types[i] = int(T.CONTROL)
    added, vocab = [], {}
    stripped = rstrip_rule(tokens, types) if rstrip_by_name(typed_key(kv, "general.name", "str", path, "")) else set()
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == T.UNUSED:
            continue  # an id the tokenizer never produces
        if kind in (T.CONTROL, T.USER_DEFINED):  # rstrip: llama.cpp's Phi-3 rule, by the file's name
            added.append({"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": i in stripped,
                          "normalized": False, "special": kind == T.CONTROL})
        vocab[text] = i  # added tokens too: HF gives an added token the model's id for its text
    unk = ids["unknown_token_id"]
    if unk is not None and not 0 <= unk < len(tokens):
        unk = None  # as llama.cpp: an id past the vocabulary names no token
    if model == "gpt2":
        tj = _byte_level_json(kv, path, vocab, added)
    elif model == "llama":
        tj = _sentencepiece_json(kv, path, tokens, types, vocab, added, unk)
    else:
        raise ExportError(f"{path}: tokenizer.ggml.model = {model!r}; lmforge rebuilds `gpt2` (byte-level BPE) and "
                          f"`llama` (SentencePiece-style BPE) tokenizers.")
    return tj, _tokenizer_config(kv, path, tokens, ids, add_bos_default=model == "llama")


def _byte_level_json(kv: dict, path: Path, vocab: dict, added: list) -> dict:
    """tokenizer.json of a `gpt2` GGUF tokenizer (byte-level BPE with its merges and pre-tokenizer)."""
    pre, ignore_merges = _byte_level_pre(typed_key(kv, "tokenizer.ggml.pre", "str", path, "gpt-2"), path)
    raw_merges = typed_key(kv, "tokenizer.ggml.merges", "strs", path)
    if raw_merges is None:
        raise ExportError(f"{path}: tokenizer.ggml.model = 'gpt2' (a byte-level BPE) but the file has no "
                          f"tokenizer.ggml.merges: without its merges the vocabulary would split text into single "
                          f"bytes, not the tokens the model was trained on (llama.cpp refuses such a file: "
                          f"\"cannot find tokenizer merges\"). Re-convert the model with its merges, or import its "
                          f"Hugging Face folder with `lmforge import-hf`.")
    bad = next((m for m in raw_merges if len(m.split(" ")) != 2), None)
    if bad is not None:
        raise ExportError(f"{path}: tokenizer.ggml.merges has the entry {bad!r}: expected two tokens separated by "
                          f"one space (\"a b\"). Re-convert the model.")
    merges = [m.split(" ") for m in raw_merges]
    bpe = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
           "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
           "vocab": vocab, "merges": merges}
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
          "pre_tokenizer": pre, "post_processor": None,
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
          "model": bpe}
    return tj


def _sentencepiece_json(kv: dict, path: Path, tokens: list, types: list, vocab: dict, added: list,
                        unk: int | None) -> dict:
    """tokenizer.json of a `llama` GGUF tokenizer (SentencePiece-style BPE: merges from the scores,
    byte fallback, "▁" for spaces)."""
    T = require_gguf().TokenType
    scores = typed_key(kv, "tokenizer.ggml.scores", "numbers", path) or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise ExportError(f"{path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} "
                          f"tokenizer.ggml.tokens: expected one score per token. Re-convert the model.")
    pieces = {t: i for t, i in vocab.items() if types[i] not in (T.CONTROL, T.USER_DEFINED, T.UNKNOWN, T.BYTE)}
    merges = []  # every split into two pieces, by the score of the whole (transformers' SentencePiece converter)
    for t in sorted(pieces, key=lambda t: (-scores[pieces[t]], pieces[t])):
        splits = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in pieces and t[k:] in pieces]
        merges += sorted(splits, key=lambda p: (pieces[p[0]], pieces[p[1]]))
    prefix = typed_key(kv, "tokenizer.ggml.add_space_prefix", "bool", path, True)
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
    return tj


def _tokenizer_config(kv: dict, path: Path, tokens: list, ids: dict, add_bos_default: bool) -> dict:
    """tokenizer_config.json: the file's BOS/EOS/pad/unk tokens, whether it prepends the BOS
    (`tokenizer.ggml.add_bos_token`, default `add_bos_default`), its chat template."""
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                    "add_bos_token": typed_key(kv, "tokenizer.ggml.add_bos_token", "bool", path, add_bos_default),
                    "add_eos_token": False}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"),
                      ("unk", "unknown_token_id")):
        i = ids[key]
        if i is not None and 0 <= i < len(tokens):
            config[f"{name}_token"] = tokens[i]
    if not config["add_bos_token"] and config.get("bos_token") == config.get("eos_token"):
        config.pop("bos_token", None)  # lmforge's export writes the EOS as a BOS-less model's bos_token_id
    template = typed_key(kv, "tokenizer.chat_template", "str", path)
    if template:
        config["chat_template"] = template
    return config


__all__ = ["rebuild_tokenizer", "typed_key"]
