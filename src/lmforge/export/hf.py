"""Hugging Face format out (`lmforge export`); in (`lmforge import-hf`) is `hf_in`.

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
logit parity with `LlamaForCausalLM`). Hugging Face names appear in this module and `hf_in`
only, and every lmforge <-> HF weight name goes through one function, `map_name`, both ways.

A model with `model.qkv_bias` is written as a `Qwen2ForCausalLM`, and Llama 3.1 RoPE scaling
(`model.rope_scaling = "llama3"`) as config.json's `rope_scaling`.

The weight names (`map_name`, `to_hf_state`, `from_hf_state`), the config builders, FAMILIES and
the file names are shared by both directions and live here.

Neither direction needs `transformers`; only `export_hf(..., verify=True)` (the
`--verify` flag) imports it, lazily, to compare logits (`pip install "lmforge[hf]"`).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
import shutil
from pathlib import Path

import torch

from lmforge.config import ModelConfig
from lmforge.contract import Contract, padded_vocab_size
from lmforge.errors import require_package
from lmforge.export.options import ExportError, check_dtype_range, check_export_options
from lmforge.export.card import MODEL_CARD_FILE, model_card, read_evaluation
from lmforge.fileio import atomic_dir, check_output, loads_json, save_safetensors
from lmforge.loading import load_checkpoint
from lmforge.model.io import model_state
from lmforge.tokenizer import CHAT_TEMPLATE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer

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
        "head_dim": model.resolved_head_dim(),
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


# -- export ------------------------------------------------------------------------------
def export_hf(checkpoint: str | Path, out: str | Path, dtype: str = "float32", verify: bool = False,
              force: bool = False, evaluation: str | Path | None = None) -> Path:
    """Write a checkpoint as a Hugging Face `LlamaForCausalLM` folder (atomically).

    Args:
        checkpoint: a checkpoint folder, or a run folder (its newest checkpoint is used).
        out: the folder to write (absent, empty, or an earlier export, which is replaced).
        dtype: "float32" (default), "bfloat16" or "float16" for the weights.
        verify: load the result with `transformers` and compare logits with lmforge's
            (max abs difference below 1e-4 in float32; needs `pip install "lmforge[hf]"`).
        force: refused (an export replaces only an earlier export folder).
        evaluation: a results JSON of `lmforge eval --tasks --out FILE` for this checkpoint, put
            in the model card (`export.card`).
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
    results = read_evaluation(evaluation, path) if evaluation is not None else None  # before a write
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
        (tmp / MODEL_CARD_FILE).write_text(model_card(path, model, contract, out.name, results), encoding="utf-8")
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


__all__ = [
    "ExportError", "map_name", "to_hf_state", "from_hf_state", "hf_config", "generation_config",
    "export_hf", "verify_export", "require_transformers",
]
