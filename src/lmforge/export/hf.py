"""Hugging Face format out (`lmforge export`) and in (`lmforge import-hf`).

An exported folder is what `transformers` writes for a `LlamaForCausalLM`:

    config.json              LlamaForCausalLM; vocab_size = the tokenizer's (P6)
    model.safetensors        HF names; the embedding's padding rows sliced off
    tokenizer.json           the lmforge tokenizer, byte for byte
    tokenizer_config.json    with the ChatML chat template and the special tokens
    generation_config.json   eos_token_id = every stop id (<|eos|>, <|im_end|>), pad_token_id

A model with `model.qk_norm` is written as a `Qwen3ForCausalLM` instead (Llama's layout plus
q_norm / k_norm), which transformers and llama.cpp (arch qwen3) both run.

lmforge's rotary embeddings use the half-split ("rotate_half") layout that HF's Llama
uses, so q/k weights map without a permutation (tests/test_export.py proves it by
logit parity with `LlamaForCausalLM`). Hugging Face names appear in this module only,
and every lmforge <-> HF weight name goes through one function, `map_name`, both ways.

A model with `model.qkv_bias` is written as a `Qwen2ForCausalLM`, and Llama 3.1 RoPE scaling
(`model.rope_scaling = "llama3"`) as config.json's `rope_scaling`.

Import reads a folder of the Llama family saved by `transformers` (FAMILIES: Llama, Mistral,
Qwen2, Qwen3; config.json, model.safetensors or its shards, tokenizer files) and writes a
plain lmforge checkpoint folder (config.toml, model.safetensors, contract.json, tokenizer
files) that `Transformer.from_checkpoint`, every stage and `sft.init` accept. It reads only
files inside the folder (`confined`), states every conversion it makes, and refuses anything
lmforge's model cannot represent exactly (another architecture, MLP or output biases, another
RoPE scaling, a sliding window that slides, another activation, integer weights) rather than
load it approximately.

Neither direction needs `transformers`; only `export_hf(..., verify=True)` (the
`--verify` flag) imports it, lazily, to compare logits (`pip install "lmforge[hf]"`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
import shutil
from pathlib import Path

import torch

from lmforge.config import Config, ModelConfig, from_dict, validate
from lmforge.contract import Contract, padded_vocab_size
from lmforge.errors import CheckpointError, ConfigError, require_package
from lmforge.export.options import ExportError, check_dtype_range, check_export_options
from lmforge.fileio import atomic_dir, check_output, check_readable, load_hf_tokenizer, loads_json, load_safetensors, save_safetensors
from lmforge.loading import load_checkpoint
from lmforge.model.io import MODEL_FILE, load_weights, model_state, write_model_files
from lmforge.tokenizer import CHAT_TEMPLATE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer, short_repr

HF_CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"  # Hugging Face's name (it happens to equal lmforge's MODEL_FILE)
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
EXPORT_OUTPUT, IMPORT_OUTPUT = "export", "import-hf"  # the marker commands (lmforge.fileio)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # EXPORT_DTYPES["hf"]


# -- names: the one place lmforge and Hugging Face names meet --------------------------
#: (lmforge name, HF name) with "{i}" for the layer index.
_NAME_PAIRS = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.attention.wq.bias", "model.layers.{i}.self_attn.q_proj.bias"),  # qkv_bias: Qwen2
    ("layers.{i}.attention.wk.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    ("layers.{i}.attention.wv.bias", "model.layers.{i}.self_attn.v_proj.bias"),
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),  # qk_norm: Qwen3
    ("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


_TO_HF = [(_pattern(a), b) for a, b in _NAME_PAIRS]
_TO_LMFORGE = [(_pattern(b), a) for a, b in _NAME_PAIRS]


def map_name(name: str, to_hf: bool = True) -> str:
    """Map one weight name: lmforge -> Hugging Face Llama (`to_hf`), or back.

    "layers.3.attention.wq.weight" <-> "model.layers.3.self_attn.q_proj.weight".
    Shapes are the same on both sides (no permutation: both use half-split RoPE).

    Raises:
        ExportError: a name with no counterpart (for example a bias, which lmforge lacks).
    """
    for pattern, target in _TO_HF if to_hf else _TO_LMFORGE:
        m = pattern.match(name)
        if m:
            return target.replace("{i}", m.group(1)) if m.groups() else target
    side = "lmforge" if to_hf else "Hugging Face Llama"
    raise ExportError(
        f"weight {name!r} is not a {side} weight lmforge knows how to map (known: "
        f"{', '.join(p[0 if to_hf else 1] for p in _NAME_PAIRS)}). lmforge's model has no other parameters "
        f"(biases on q, k and v only); this folder holds a model lmforge cannot represent."
    )


def to_hf_state(state: dict[str, torch.Tensor], vocab_size: int, tie_embeddings: bool,
                dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """lmforge state dict -> HF Llama state dict.

    Args:
        state: lmforge weights (`train.checkpoint.model_state`: a tied output weight is absent);
            embedding/output rows = the padded model vocab.
        vocab_size: the tokenizer's vocab size; rows past it (padding, P6) are sliced off.
        tie_embeddings: when True, "lm_head.weight" is left out (HF ties it on load).
        dtype: cast floating tensors to this dtype (default: keep).
    Returns:
        {HF name: contiguous tensor}.
    Raises:
        ExportError: a weight beyond `dtype`'s range (`check_dtype_range`).
    """
    out = {}
    for name, t in state.items():
        if name == "output.weight" and tie_embeddings:
            continue
        if name in ("tok_embeddings.weight", "output.weight"):
            t = t[:vocab_size]
        if dtype is not None and t.is_floating_point():
            check_dtype_range(name, t, str(dtype).removeprefix("torch."))  # never an infinity in the file
            t = t.to(dtype)
        out[map_name(name, to_hf=True)] = t.detach().contiguous().cpu()
    return out


def from_hf_state(state: dict[str, torch.Tensor], vocab_size: int, tie_embeddings: bool,
                  where: str = "the weights") -> dict[str, torch.Tensor]:
    """HF Llama state dict -> lmforge state dict (float32), as `model_state` stores it.

    Embedding/output rows are cut to `vocab_size` (the tokenizer's; rows past it are
    unreachable by the tokenizer) and zero-padded to the multiple of 64 (P6). With
    `tie_embeddings`, "lm_head.weight" must be absent or equal to the embedding.
    Rotary `inv_freq` buffers that old checkpoints carry are dropped.

    Raises:
        ExportError: unknown names (biases, ...), fewer embedding rows than the tokenizer's
        vocab, or an untied lm_head in a model that says it is tied.
    """
    padded = padded_vocab_size(vocab_size)
    out = {}
    for name, t in state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and tie_embeddings:
            emb = state.get("model.embed_tokens.weight")
            if emb is not None and not torch.equal(emb, t):
                raise ExportError(
                    f"{where}: config.json says tie_word_embeddings = true but lm_head.weight differs from "
                    f"model.embed_tokens.weight. Fix tie_word_embeddings in config.json."
                )
            continue
        ours = map_name(name, to_hf=False)
        t = t.detach().to(torch.float32)
        if ours in ("tok_embeddings.weight", "output.weight"):
            if t.shape[0] < vocab_size:
                raise ExportError(
                    f"{where}: {name} has {t.shape[0]} rows but the tokenizer has {vocab_size} tokens; ids "
                    f"past row {t.shape[0] - 1} would index past the embedding (P6). Use the tokenizer "
                    f"this model was trained with."
                )
            t = torch.cat([t[:vocab_size], t.new_zeros(padded - vocab_size, t.shape[1])])
        out[ours] = t.contiguous()
    if "tok_embeddings.weight" not in out:
        raise ExportError(f"{where}: no model.embed_tokens.weight; this is not a Llama causal LM's weights.")
    if not tie_embeddings and "output.weight" not in out:
        raise ExportError(
            f"{where}: no lm_head.weight and config.json says tie_word_embeddings = false. "
            f"Set tie_word_embeddings to true if the output layer shares the embedding."
        )
    return out


# -- config ------------------------------------------------------------------------------
def hf_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """The `config.json` of a `LlamaForCausalLM` equal to `model` (vocab = the tokenizer's);
    with `model.qk_norm`, of a `Qwen3ForCausalLM` (Llama's layout plus an RMSNorm over each
    head's q and k before the rotary embedding, which is what lmforge's qk_norm computes)."""
    if model.qk_norm and model.qkv_bias:
        raise ExportError("model.qk_norm with model.qkv_bias is no Hugging Face architecture (Qwen3 has QK-norm and no "
                          "biases, Qwen2 biases and no QK-norm); this model cannot be exported.")
    if model.qk_norm:
        return qwen3_config(model, contract, dtype)
    if model.qkv_bias:
        return qwen2_config(model, contract, dtype)
    rope_scaling = None
    if model.rope_scaling == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": model.rope_factor, "low_freq_factor": model.rope_low_freq_factor,
                        "high_freq_factor": model.rope_high_freq_factor,
                        "original_max_position_embeddings": model.rope_original_max_seq_len}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.dim,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": model.head_dim,
        "intermediate_size": model.resolved_ffn_dim(),
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": model.max_seq_len,
        "vocab_size": contract.vocab_size,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": contract.bos_id,
        "eos_token_id": contract.eos_id,
        "pad_token_id": contract.pad_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def qwen3_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a Qwen3ForCausalLM equal to a qk_norm `model` (llama.cpp: arch qwen3)."""
    cfg = hf_config(replace(model, qk_norm=False), contract, dtype)
    for key in ("pretraining_tp", "mlp_bias"):
        del cfg[key]
    cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=False, sliding_window=None,
               max_window_layers=model.n_layers)
    return cfg


def qwen2_config(model: ModelConfig, contract: Contract, dtype: torch.dtype = torch.float32) -> dict:
    """`config.json` of a Qwen2ForCausalLM equal to a qkv_bias `model` (Llama's layout plus
    biases on q, k and v; Qwen2 has no key for them)."""
    cfg = hf_config(replace(model, qkv_bias=False), contract, dtype)
    for key in ("pretraining_tp", "mlp_bias", "attention_bias", "head_dim"):
        del cfg[key]
    cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False, sliding_window=None,
               max_window_layers=model.n_layers)
    return cfg


#: The architectures import-hf reads: (model_type, architectures[0]) -> what they add to Llama.
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",  # Llama's layout with a sliding window (accepted when it never slides)
    "qwen2": "Qwen2ForCausalLM",  # Llama's layout with q/k/v biases
    "qwen3": "Qwen3ForCausalLM",  # Llama's layout with QK-norm
}
#: rope_type values that mean plain RoPE (transformers writes "default"; older configs nothing).
PLAIN_ROPE = (None, "default")


def _rope_settings(cfg: dict, where: str) -> dict:
    """The RoPE settings of a config as ModelConfig keys: rope_theta and, for Llama 3.1's
    scaling, rope_scaling = "llama3" and its four numbers. Reads transformers >= 5's
    `rope_parameters` and older `rope_theta` + `rope_scaling` (null, or rope_type / type
    "default" for plain RoPE).

    Raises:
        ExportError: another scaling (linear, dynamic, yarn, longrope, ...), partial rotation.
    """
    source, rope = "rope_parameters", {}
    for key in ("rope_parameters", "rope_scaling"):  # both may be present: a scaling in either counts
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ExportError(f"{where}: {key} = {value!r}: expected an object or null.")
        if not rope or value.get("rope_type", value.get("type")) not in PLAIN_ROPE:
            source, rope = key, {**rope, **value} if key == "rope_scaling" else value
    kind = rope.get("rope_type", rope.get("type"))
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    out: dict = {"rope_theta": _number(theta, "rope_theta", float, where)}
    for key in ("partial_rotary_factor",):
        value = cfg.get(key, rope.get(key))
        if value not in (None, 1, 1.0):
            raise ExportError(f"{where}: {key} = {value!r}, expected 1.0: lmforge rotates the whole head.")
    if rope.get("attention_factor") not in (None, 1, 1.0):
        raise ExportError(f"{where}: rope attention_factor = {rope['attention_factor']!r}, expected 1.0: lmforge "
                          f"does not scale attention; this model cannot be imported.")
    if kind in PLAIN_ROPE:
        return out
    if kind != "llama3":
        raise ExportError(f"{where}: {source} has rope_type = {kind!r}: lmforge implements plain RoPE (\"default\") and Llama "
                          f"3.1's \"llama3\" scaling only; this model cannot be imported.")
    out.update(rope_scaling="llama3",
               rope_factor=_number(rope.get("factor"), "rope factor", float, where),
               rope_low_freq_factor=_number(rope.get("low_freq_factor"), "rope low_freq_factor", float, where),
               rope_high_freq_factor=_number(rope.get("high_freq_factor"), "rope high_freq_factor", float, where),
               rope_original_max_seq_len=_number(rope.get("original_max_position_embeddings"),
                                                 "rope original_max_position_embeddings", int, where))
    return out


def _number(value, key: str, typ: type, where: str):
    if value is None:
        raise ExportError(f"{where}: missing field {key!r}; a transformers config.json of this family has it.")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (typ is float or value == int(value))
    if not ok:
        raise ExportError(f"{where}: {key} = {value!r}: expected {'an integer' if typ is int else 'a number'}.")
    return typ(value)


def model_config_from_hf(cfg: dict, where: str, log=None) -> ModelConfig:
    """lmforge ModelConfig from a `config.json` of the Llama family (FAMILIES): Llama (tied or
    untied head, plain or Llama 3.1-scaled RoPE), Mistral (a sliding window that never slides),
    Qwen2 (q/k/v biases -> `qkv_bias`), Qwen3 (QK-norm -> `qk_norm`).

    Args:
        log: called with one line per conversion stated (an empty `architectures` read by model_type).
    Raises:
        ExportError: not a JSON object, another architecture, MLP or o_proj biases, another
        activation, another RoPE scaling, a sliding window that slides, a head size lmforge does
        not derive, a missing field or one of the wrong type — each naming the field.
    """
    say = log or (lambda _msg: None)
    if not isinstance(cfg, dict):
        raise ExportError(f"{where}: expected a JSON object (a transformers config), found {type(cfg).__name__}.")
    family = cfg.get("model_type")
    archs = cfg.get("architectures")
    if family not in FAMILIES:
        raise ExportError(
            f"{where}: model_type = {family!r}, architectures = {archs}; lmforge imports model_type "
            f"{' / '.join(repr(k) for k in FAMILIES)} ({', '.join(FAMILIES.values())}). Other architectures differ "
            f"in ways lmforge's model does not represent.")
    if archs is None or archs == []:
        say(f"config.json: architectures = {archs!r}; reading it as {FAMILIES[family]} (model_type {family!r})")
    elif archs != [FAMILIES[family]]:
        raise ExportError(f"{where}: architectures = {archs!r} with model_type {family!r}; expected "
                          f"[\"{FAMILIES[family]}\"]. lmforge imports causal language models of the Llama family only.")
    refusals = [
        ("mlp_bias", False, "lmforge's MLP has no biases"),
        ("hidden_act", "silu", "lmforge's MLP is SwiGLU (silu)"),
        ("use_sliding_window", False, "lmforge has full attention only"),
    ]
    if family != "qwen2":  # Qwen2 always has q/k/v biases (and no key for them)
        refusals.append(("attention_bias", False, "lmforge's attention has biases on q/k/v only in Qwen2's layout"))
    for key, want, why in refusals:
        if cfg.get(key, want) != want:
            raise ExportError(f"{where}: {key} = {cfg[key]!r}, expected {want!r}: {why}; this model cannot be imported.")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or any(t != "full_attention" for t in layer_types)):
        raise ExportError(f"{where}: layer_types = {short_repr(layer_types)}: lmforge has full attention in every "
                          f"layer only (expected every entry \"full_attention\"); this model cannot be imported.")
    max_pos = _number(cfg.get("max_position_embeddings", 2048), "max_position_embeddings", int, where)
    window = cfg.get("sliding_window")
    if family == "mistral" and window is not None and _number(window, "sliding_window", int, where) < max_pos:
        raise ExportError(
            f"{where}: sliding_window = {window} is below max_position_embeddings = {max_pos}: attention would slide, "
            f"and lmforge has full attention only. Set sliding_window to null (or to at least {max_pos}) in "
            f"config.json if the model was trained with full attention; otherwise it cannot be imported.")
    rope = _rope_settings(cfg, where)
    dim, n_heads = _number(cfg.get("hidden_size"), "hidden_size", int, where), \
        _number(cfg.get("num_attention_heads"), "num_attention_heads", int, where)
    model = ModelConfig(
        dim=dim,
        n_layers=_number(cfg.get("num_hidden_layers"), "num_hidden_layers", int, where),
        n_heads=n_heads,
        n_kv_heads=_number(cfg.get("num_key_value_heads", n_heads), "num_key_value_heads", int, where),
        ffn_dim=_number(cfg.get("intermediate_size"), "intermediate_size", int, where),
        norm_eps=_number(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", float, where),
        max_seq_len=max_pos,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=family == "qwen3",
        qkv_bias=family == "qwen2",
        **rope,
    )
    sizes = {"hidden_size": dim, "num_attention_heads": n_heads, "num_hidden_layers": model.n_layers,
             "num_key_value_heads": model.n_kv_heads, "intermediate_size": model.ffn_dim,
             "max_position_embeddings": model.max_seq_len}
    bad = [f"{k} = {v}" for k, v in sizes.items() if v <= 0]
    if bad:
        raise ExportError(f"{where}: {', '.join(bad)}: expected positive sizes; this config.json does not describe a "
                          f"model. Fix it (or use the folder transformers saved).")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and _number(head_dim, "head_dim", int, where) * n_heads != dim:
        raise ExportError(
            f"{where}: head_dim = {head_dim} but hidden_size / num_attention_heads = {dim // n_heads}; lmforge "
            f"derives head_dim = dim / n_heads, so this model cannot be imported."
        )
    return model


# -- export ------------------------------------------------------------------------------
def export_hf(checkpoint: str | Path, out: str | Path, dtype: str = "float32", verify: bool = False,
              force: bool = False) -> Path:
    """Write a checkpoint as a Hugging Face `LlamaForCausalLM` folder (atomically).

    Args:
        checkpoint: a checkpoint folder, or a run folder (its newest checkpoint is used).
        out: the folder to write (absent, empty, or an earlier export, which is replaced).
        dtype: "float32" (default), "bfloat16" or "float16" for the weights.
        verify: load the result with `transformers` and compare logits with lmforge's
            (max abs difference below 1e-4 in float32; needs `pip install "lmforge[hf]"`).
        force: refused (an export replaces only an earlier export folder).
    Returns:
        `out`.
    Raises:
        CheckpointError / ContractError: the checkpoint is incomplete or inconsistent.
        ExportError: an option that does not apply (`check_export_options`), `out` holds other
            files, a weight beyond the dtype's range (`check_dtype_range`), or verification failed.
    """
    check_export_options("hf", dtype, verify, force)
    out = Path(out)
    check_output(out, EXPORT_OUTPUT, "`lmforge export`", replace_whole=True)  # before any work
    model, tok, cfg, path = load_checkpoint(checkpoint)
    contract = tok.contract
    torch_dtype = DTYPES[dtype]
    hf = to_hf_state(model_state(model), contract.vocab_size, cfg.model.tie_embeddings, torch_dtype)  # before a write
    with atomic_dir(out, EXPORT_OUTPUT, what="`lmforge export`") as tmp:
        save_safetensors(hf, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        config = hf_config(model.config, contract, torch_dtype)
        _write_json(tmp / HF_CONFIG_FILE, config)
        shutil.copy2(path / TOKENIZER_FILE, tmp / TOKENIZER_FILE)
        _write_json(tmp / TOKENIZER_CONFIG_FILE, _tokenizer_config(tok, cfg.model.max_seq_len))
        _write_json(tmp / GENERATION_CONFIG_FILE, generation_config(cfg.generate, contract))
        if verify:
            verify_export(model, tmp, tol=1e-4 if dtype == "float32" else None)
    return out


def generation_config(g, contract: Contract) -> dict:
    """`generation_config.json`: every stop id (<|eos|> ends a document, <|im_end|> a chat turn),
    the pad id, and lmforge's sampling defaults (`[generate]` of the checkpoint's config;
    temperature 0 = greedy)."""
    cfg = {
        "bos_token_id": contract.bos_id,
        "eos_token_id": list(dict.fromkeys([contract.eos_id, contract.im_end_id])),
        "pad_token_id": contract.pad_id,
        "max_new_tokens": g.max_new_tokens,
        "repetition_penalty": g.repetition_penalty,
    }
    if g.temperature == 0:
        return {**cfg, "do_sample": False}
    return {**cfg, "do_sample": True, "temperature": g.temperature, "top_k": g.top_k, "top_p": g.top_p}


def _tokenizer_config(tok: Tokenizer, max_seq_len: int) -> dict:
    """The checkpoint's tokenizer_config.json (its special-token spellings kept), with the
    contract's chat template (lmforge's ChatML, or an imported model's own), add_bos_token =
    the contract's add_bos (what lmforge's documents start with; transformers 5's generic
    tokenizer does not act on it, and chat rendering never adds a BOS the template lacks),
    no automatic EOS, and model_max_length = max_seq_len."""
    path = tok.folder / TOKENIZER_CONFIG_FILE
    cfg = loads_json(path.read_text(encoding="utf-8")) if path.is_file() else {}
    spell = tok.spellings
    cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for name in ("bos", "eos", "pad"):
        if spell[name] is not None:
            cfg.setdefault(f"{name}_token", spell[name])
    own = tok.contract.chat_template == CHAT_TEMPLATE
    if own:
        cfg.setdefault("additional_special_tokens", [spell["im_start"], spell["im_end"]])
    cfg.update({"add_bos_token": tok.contract.add_bos, "add_eos_token": False,
                "chat_template": tok.contract.chat_template, "model_max_length": max_seq_len})
    return cfg


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def require_transformers():
    """The `transformers` package.

    Raises:
        LmforgeError: transformers is not installed (`errors.require_package`).
    """
    return require_package("transformers", "hf", "comparing with transformers")


def verify_export(model: torch.nn.Module, folder: str | Path, tol: float | None = 1e-4, seq_len: int = 64) -> float:
    """Load `folder` with `transformers`' LlamaForCausalLM and compare its logits with
    `model`'s on a fixed random batch (2, min(seq_len, max_seq_len)), in float32.
    `tol` None (for bfloat16/float16 weights): 5% of the largest logit magnitude.

    Returns:
        the max abs logit difference.
    Raises:
        LmforgeError: transformers missing. ExportError: the difference exceeds `tol`.
    """
    transformers = require_transformers()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).float().eval()
    T = min(seq_len, model.config.max_seq_len)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (2, T), generator=gen)
    with torch.inference_mode():
        ours = model.float()(tokens)
        theirs = hf(tokens).logits
    if theirs.shape != ours.shape:
        raise ExportError(f"{folder}: transformers gives logits {tuple(theirs.shape)}, lmforge {tuple(ours.shape)}.")
    diff = float((ours - theirs).abs().max())
    if tol is None:
        tol = 0.05 * max(1.0, float(ours.abs().max()))
    if not diff <= tol:
        raise ExportError(
            f"{folder}: transformers' logits differ from lmforge's by {diff:.3g} (max abs; allowed {tol:g}). "
            f"The export is wrong; please report it with the checkpoint's config.toml."
        )
    return diff


# -- import ------------------------------------------------------------------------------


def model_root(folder: Path) -> Path:
    """The folder whose files an import may read: `folder` itself (resolved), or, for a snapshot
    of the Hugging Face hub cache (`.../models--ORG--NAME/snapshots/REV/`, whose files are links
    into `../../blobs/`), that model's own cache folder `models--ORG--NAME`."""
    try:
        real = folder.resolve()
    except (OSError, RuntimeError):
        return folder
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def confined(folder: Path, name: str, what: str | None = None) -> Path:
    """`folder / name`, refused unless it stays inside `folder` once resolved: no absolute
    path, no `..`, no symbolic link to a file elsewhere (import reads only the folder it is given).
    In a snapshot of the Hugging Face cache, links into the same model's cache folder
    (`../../blobs/HASH`) are inside (`model_root`); links anywhere else are still refused.

    Raises:
        ExportError: naming the file and where it leads.
    """
    what = what or repr(name)
    path = folder / name
    root = model_root(folder)
    try:
        inside = Path(name).is_absolute() is False and path.resolve().is_relative_to(root)
    except (OSError, RuntimeError, ValueError):  # a link loop, a name the OS cannot take
        inside = False
    if not inside:
        where = "the folder" if root == folder.resolve() else f"the model's cache folder {root}"
        raise ExportError(f"{folder}: {what} leads outside {where} ({path}); import-hf reads only files inside "
                          f"the folder it is given. Copy the file into {folder} under a plain name.")
    return path


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder: model.safetensors, its shards (index.json), or
    pytorch_model.bin (loaded with weights_only=True).

    Raises:
        ExportError: no weights file, or a damaged one.
    """
    state = None
    shards: list = []
    if (folder / WEIGHTS_INDEX_FILE).is_file() and not (folder / WEIGHTS_FILE).is_file():
        try:
            index = loads_json(confined(folder, WEIGHTS_INDEX_FILE).read_text(encoding="utf-8"))
            shards = sorted(set(index["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise ExportError(f"{folder / WEIGHTS_INDEX_FILE}: not an index of shards ({type(exc).__name__}: "
                              f"{str(exc)[:120]}); expected {{\"weight_map\": {{name: shard file}}}}.") from None
        for shard in shards:
            if not isinstance(shard, str):
                raise ExportError(f"{folder / WEIGHTS_INDEX_FILE}: shard name {shard!r} is not a file name.")
            confined(folder, shard, what=f"shard {shard!r} named in {WEIGHTS_INDEX_FILE}")
    reading = folder
    try:
        if (folder / WEIGHTS_FILE).is_file():
            reading = folder / WEIGHTS_FILE
            state = load_safetensors(confined(folder, WEIGHTS_FILE))
        elif shards:
            state = {}
            for shard in shards:
                reading = folder / shard
                state.update(load_safetensors(confined(folder, shard)))
        elif (folder / "pytorch_model.bin").is_file():
            reading = folder / "pytorch_model.bin"
            state = torch.load(confined(folder, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    except ExportError:
        raise
    except Exception as exc:  # safetensors, torch's unpickler, struct, json: a damaged file raises any of them
        for name in (WEIGHTS_FILE, WEIGHTS_INDEX_FILE, "pytorch_model.bin"):
            if (folder / name).is_file():
                check_readable(folder / name)  # permission denied is said as such, not as "damaged"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise ExportError(f"{reading}: cannot read the weights ({first}). The file is damaged or incomplete: "
                          f"download or copy it again.") from None
    if state is None:
        raise ExportError(
            f"{folder} has no {WEIGHTS_FILE}, {WEIGHTS_INDEX_FILE} or pytorch_model.bin; point at a folder "
            f"written by transformers' save_pretrained (or by `lmforge export`)."
        )
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ExportError(f"{folder}: the weights file does not hold a dictionary of tensors.")
    for name, t in state.items():
        if t.is_floating_point() and t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ExportError(f"{folder}: weight {name} has dtype {str(t.dtype).removeprefix('torch.')}; lmforge imports "
                              f"float32, bfloat16 and float16 weights only (a float8 or float64 weight would be "
                              f"converted, not read as it is). Use the model's float32, bfloat16 or float16 weights.")
        if not t.is_floating_point():
            raise ExportError(f"{folder}: weight {name} has dtype {str(t.dtype).removeprefix('torch.')}; lmforge imports "
                              f"float32, bfloat16 and float16 weights only (integer or quantized weights would need a "
                              f"conversion it does not make). Use the model's unquantized weights.")
    return state


def import_hf(folder: str | Path, out: str | Path, log=None, eos_token: str = "") -> Path:
    """Turn a Llama-architecture HF folder into an lmforge checkpoint folder (atomically).

    The tokenizer goes through `lmforge.tokenizer.import_tokenizer`: the contract is derived
    from the model's own tokenizer and conventions (its document terminator, its BOS or none,
    its chat template and end-of-turn token); the only token it may add is a distinct <|pad|>
    (and ChatML's two markers for a model without a chat template). Embedding and output rows
    of the tokenizer's original ids are copied; rows of added tokens start as the mean of the
    original rows; rows past the tokenizer's vocab are dropped, and the matrix is zero-padded
    to the multiple of 64 (P6). Every file read is inside `folder` (`confined`).

    The result holds config.toml, model.safetensors (float32), contract.json, tokenizer.json,
    tokenizer_config.json and state.json (step 0); it loads with
    `Transformer.from_checkpoint(out)` and serves as `sft.init` and as a `tokenizer.dir`.

    Args:
        log: called with one line per change or conversion made (the document terminator chosen,
            the BOS convention, an added pad, weights cast to float32, an empty `architectures`).
        eos_token: the document terminator where the folder's cannot be derived (the setting
            tokenizer.eos_token).
    Raises:
        ExportError: not a Llama-family folder, a feature lmforge lacks, integer weights,
        unreadable weights, a file outside the folder, fewer embedding rows than the tokenizer's
        ids, or `out` holding other files.
        ContractError: no tokenizer.json, or one lmforge cannot use (see import_tokenizer).
    """
    from lmforge.model import Transformer, resolve_model_config
    from lmforge.tokenizer import import_tokenizer, vocab_size_of

    say = log or (lambda _msg: None)
    folder, out = Path(folder), Path(out)
    cfg_path = folder / HF_CONFIG_FILE
    if not cfg_path.is_file():
        raise ExportError(f"{folder} has no {HF_CONFIG_FILE}; point at a folder written by save_pretrained.")
    for name in (HF_CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json",
                 "chat_template.jinja"):
        if (folder / name).exists() or (folder / name).is_symlink():
            confined(folder, name)
    try:
        raw = loads_json(cfg_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ExportError(f"{cfg_path}: not valid JSON ({exc}).") from None
    model_cfg = model_config_from_hf(raw, str(cfg_path), log=say)
    hf_vocab = raw.get("vocab_size")
    if hf_vocab is not None:
        hf_vocab = _number(hf_vocab, "vocab_size", int, str(cfg_path))
        if hf_vocab <= 0:
            raise ExportError(f"{cfg_path}: vocab_size = {hf_vocab}: expected the number of embedding rows (> 0).")
    with atomic_dir(out, IMPORT_OUTPUT, what="`lmforge import-hf`") as tmp:
        tok = import_tokenizer(folder, tmp / "tokenizer", log=say, eos_token=eos_token)
        contract = tok.contract
        original = vocab_size_of(load_hf_tokenizer(folder / TOKENIZER_FILE))
        hf_state = read_hf_weights(folder)
        rows = hf_state.get("model.embed_tokens.weight")
        if rows is not None and hf_vocab is not None and hf_vocab != rows.shape[0]:
            raise ExportError(
                f"{cfg_path}: vocab_size = {hf_vocab} but model.embed_tokens.weight has {rows.shape[0]} rows; "
                f"the config and the weights disagree. Fix vocab_size in config.json."
            )
        if rows is not None and rows.shape[0] < original:
            raise ExportError(
                f"{folder}: model.embed_tokens.weight has {rows.shape[0]} rows but {folder / TOKENIZER_FILE} "
                f"has ids up to {original - 1}; they would index past the embedding (P6). Use the tokenizer "
                f"this model was trained with."
            )
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in hf_state.values()} - {"float32"})
        if dtypes:
            say(f"weights: {', '.join(dtypes)} -> float32 (exact: every value is representable)")
        state = from_hf_state(hf_state, original, model_cfg.tie_embeddings, str(folder))
        if contract.vocab_size > original:
            say(f"embedding: {contract.vocab_size - original} added token row(s) start as the mean of the "
                f"{original} original rows")
            state = {k: _grow_rows(v, original, contract.vocab_size)
                     if k in ("tok_embeddings.weight", "output.weight") else v for k, v in state.items()}
        config = Config(model=model_cfg)
        config.tokenizer.vocab_size = contract.vocab_size
        config.tokenizer.dir = str(out)
        config.data.seq_len = min(config.data.seq_len, model_cfg.max_seq_len)
        config.generate.max_new_tokens = min(config.generate.max_new_tokens, max(1, model_cfg.max_seq_len // 2))
        try:
            validate(from_dict(config.to_dict(), where=str(cfg_path)))
        except ConfigError as exc:
            raise ExportError(f"{cfg_path} maps to an lmforge config lmforge rejects: {exc}") from None
        write_model_files(tmp, state, config, tmp / "tokenizer")  # the checkpoint layout of lmforge.model.io
        shutil.rmtree(tmp / "tokenizer")
        model = Transformer(resolve_model_config(model_cfg, contract))
        try:
            load_weights(model, tmp / MODEL_FILE)  # strict: names, shapes, finite values
        except CheckpointError as exc:
            raise ExportError(f"{folder}: the weights do not fit the model its config.json describes: {exc}") from None
    return out


def _grow_rows(t: torch.Tensor, original: int, vocab: int) -> torch.Tensor:
    """(padded(original), dim) -> (padded(vocab), dim): rows [original, vocab) = the mean of the
    original rows, the rest zero."""
    out = t.new_zeros(padded_vocab_size(vocab), t.shape[1])
    out[:original] = t[:original]
    out[original:vocab] = t[:original].mean(0)
    return out


__all__ = [
    "ExportError", "map_name", "to_hf_state", "from_hf_state", "hf_config", "generation_config", "model_config_from_hf",
    "export_hf", "import_hf", "verify_export", "read_hf_weights", "require_transformers",
]
