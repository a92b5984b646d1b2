"""Hugging Face format out (`lmforge export`); in (`lmforge import-hf`) is `hf_in`.

An exported folder is what `transformers` writes for the model's family:

    config.json              the family's class and every key it reads; vocab_size = the tokenizer's (P6)
    model.safetensors        the family's names; the embedding's padding rows sliced off
    tokenizer.json           the lmforge tokenizer, byte for byte
    tokenizer_config.json    with the chat template and the special tokens
    generation_config.json   eos_token_id = every stop id (<|eos|>, <|im_end|>), pad_token_id

The family is `families.family_of(model)`: the first record of `export/families/` (one per
family) that carries every mechanism the model sets. A plain model is a `LlamaForCausalLM`;
`model.qk_norm` makes it a `Qwen3ForCausalLM`, `model.qkv_bias` a `Qwen2ForCausalLM`, a window
sliding in every layer a `MistralForCausalLM`; an imported Gemma 3 (`Gemma3ForCausalLM`, model_type
gemma3_text), Gemma 2 or OLMo 2 is written back as itself. A model no family carries is refused.
Llama 3.1 RoPE scaling (`model.rope_scaling = "llama3"`) is config.json's `rope_scaling`.

lmforge's rotary embeddings use the half-split ("rotate_half") layout that HF's models use, so
q/k weights map without a permutation (tests/test_export.py, tests/test_families_hf.py prove it
by logit parity). Hugging Face names appear in this module, `hf_in`, `hf_config_out`,
`hf_config_in` and `families` only, and every lmforge <-> HF weight name goes through one
function, `map_name`, both ways, in the family's names (`Family.hf_names`:
`post_attention_layernorm` is Llama's norm before the MLP but Gemma's and OLMo 2's norm after
attention).

The weight names (`map_name`, `to_hf_state`, `from_hf_state`) and the file names are shared by
both directions and live here; config.json is `hf_config_out` (`hf_config`, one builder per
family) and `hf_config_in` (`model_config_from_hf`).

Neither direction needs `transformers`; only `export_hf(..., verify=True)` (the
`--verify` flag) imports it, lazily, to compare logits (`pip install "lmforge[hf]"`).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

from lmforge.contract import Contract, padded_vocab_size
from lmforge.errors import require_package
from lmforge.config import ModelConfig
from lmforge.export import families
from lmforge.export.families.shared import fuse, unfuse
from lmforge.export.options import ExportError, check_dtype_range, check_export_options
from lmforge.export.card import MODEL_CARD_FILE, model_card, read_evaluation
from lmforge.export.hf_config_out import hf_config
from lmforge.fileio import atomic_dir, check_output, loads_json, save_safetensors
from lmforge.loading import load_checkpoint
from lmforge.model.io import model_state
from lmforge.tokenizer import CHAT_TEMPLATE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer
from lmforge.tokenizer.hf_json import with_document_start

HF_CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"  # Hugging Face's name (it happens to equal lmforge's MODEL_FILE)
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
EXPORT_OUTPUT, IMPORT_OUTPUT = "export", "import-hf"  # the marker commands (lmforge.fileio)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # EXPORT_DTYPES["hf"]


# -- names: the one place lmforge and Hugging Face names meet --------------------------
#: Without a family: Llama's layout with Qwen2's q/k/v biases and Qwen3's QK-norm, the names of
#: every family with pre-norms only (what `map_name` has always taken; the PEFT export's names).
_LLAMA_LAYOUT = tuple(dict.fromkeys(pair for f in families.FAMILIES.values()
                                    if f.fixed.get("norm_placement") == "pre" and not f.fused for pair in f.hf_names))


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


@functools.lru_cache(maxsize=None)
def _name_maps(model_type: str | None) -> tuple[tuple, list, list]:
    """(pairs, lmforge -> HF patterns, HF -> lmforge patterns) of a family (None: `_LLAMA_LAYOUT`)."""
    pairs = _LLAMA_LAYOUT if model_type is None else families.FAMILIES[model_type].hf_names
    return pairs, [(_pattern(a), b) for a, b in pairs], [(_pattern(b), a) for a, b in pairs]


def map_name(name: str, to_hf: bool = True, family: families.Family | str | None = None) -> str:
    """Map one weight name: lmforge -> Hugging Face (`to_hf`), or back, in `family`'s names
    (`families.Family.hf_names`; a Family or its model_type). Without a family: Llama's layout
    (with Qwen2's q/k/v biases and Qwen3's q_norm / k_norm).

    "layers.3.attention.wq.weight" <-> "model.layers.3.self_attn.q_proj.weight"; in Gemma 2/3
    "layers.3.attention_post_norm.weight" <-> "model.layers.3.post_attention_layernorm.weight",
    which is Llama's "layers.3.ffn_norm.weight". Shapes are the same on both sides (no
    permutation: both use half-split RoPE).

    Raises:
        ExportError: a name with no counterpart in the family (for example an o_proj bias).
    """
    model_type = family.model_type if isinstance(family, families.Family) else family
    if model_type is not None and model_type not in families.FAMILIES:
        raise ExportError(f"model family {model_type!r}: expected one of {', '.join(families.FAMILIES)}.")
    pairs, to_theirs, to_ours = _name_maps(model_type)
    for pattern, target in to_theirs if to_hf else to_ours:
        m = pattern.match(name)
        if m:
            return target.replace("{i}", m.group(1)) if m.groups() else target
    known = ", ".join(p[0 if to_hf else 1] for p in pairs)
    if model_type is None:
        side = "lmforge" if to_hf else "Hugging Face Llama"
        raise ExportError(
            f"weight {name!r} is not a {side} weight lmforge knows how to map (known: {known}). lmforge's model "
            f"has no other parameters (biases on q, k and v only); this folder holds a model lmforge cannot represent."
        )
    arch = families.FAMILIES[model_type].architecture
    side = "an lmforge" if to_hf else f"a Hugging Face {arch}"
    raise ExportError(
        f"weight {name!r} is not {side} weight lmforge maps for {arch} (known: {known}). lmforge's {arch} has no "
        f"other parameters; this model holds one lmforge cannot represent."
    )


def to_hf_state(state: dict[str, torch.Tensor], vocab_size: int, tie_embeddings: bool,
                dtype: torch.dtype | None = None,
                family: families.Family | str | None = None) -> dict[str, torch.Tensor]:
    """lmforge state dict -> HF state dict, in `family`'s names (None: Llama's layout; see `map_name`).

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
    record = families.FAMILIES[family] if isinstance(family, str) else family
    if record is not None:  # Phi-3's qkv_proj and gate_up_proj: the parts stacked (`shared.fuse`)
        state = fuse(state, record.fused)
    out = {}
    for name, t in state.items():
        if name == "output.weight" and tie_embeddings:
            continue
        if name in ("tok_embeddings.weight", "output.weight"):
            t = t[:vocab_size]
        if dtype is not None and t.is_floating_point():
            check_dtype_range(name, t, str(dtype).removeprefix("torch."))  # never an infinity in the file
            t = t.to(dtype)
        out[map_name(name, to_hf=True, family=family)] = t.detach().contiguous().cpu()
    return out


def from_hf_state(state: dict[str, torch.Tensor], vocab_size: int, tie_embeddings: bool,
                  where: str = "the weights", family: families.Family | str | None = None,
                  model: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """HF state dict in `family`'s names (None: Llama's layout; see `map_name`) -> lmforge state
    dict (float32), as `model_state` stores it. A family's fused weights (`Family.fused`: Phi-3's
    qkv_proj, gate_up_proj) are split into lmforge's, each part's rows from `model`.

    Embedding/output rows are cut to `vocab_size` (the tokenizer's; rows past it are
    unreachable by the tokenizer) and zero-padded to the multiple of 64 (P6). With
    `tie_embeddings`, "lm_head.weight" must be absent or equal to the embedding.
    Rotary `inv_freq` buffers that old checkpoints carry are dropped.

    Raises:
        ExportError: unknown names (biases, ...), fewer embedding rows than the tokenizer's
        vocab, an untied lm_head in a model that says it is tied, or a fused weight whose rows
        are not its parts'.
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
        ours = map_name(name, to_hf=False, family=family)
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
    record = families.FAMILIES[family] if isinstance(family, str) else family
    if record is not None and record.fused:
        out = unfuse(out, record.fused, model, where, dict(record.hf_names))
    if "tok_embeddings.weight" not in out:
        raise ExportError(f"{where}: no model.embed_tokens.weight; this is not the weights of a causal LM "
                          f"lmforge imports.")
    if not tie_embeddings and "output.weight" not in out:
        raise ExportError(
            f"{where}: no lm_head.weight and config.json says tie_word_embeddings = false. "
            f"Set tie_word_embeddings to true if the output layer shares the embedding."
        )
    return out


# -- export ------------------------------------------------------------------------------
def export_hf(checkpoint: str | Path, out: str | Path, dtype: str = "float32", verify: bool = False,
              force: bool = False, evaluation: str | Path | None = None) -> Path:
    """Write a checkpoint as a Hugging Face folder (atomically), in the family `families.family_of`
    picks for its model (LlamaForCausalLM unless its mechanisms are another family's; see `hf_config`).

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
            files, a model no family carries (`hf_config`), a weight beyond the dtype's range
            (`check_dtype_range`), or verification failed.
    """
    check_export_options("hf", dtype, verify, force)
    out = Path(out)
    check_output(out, EXPORT_OUTPUT, "`lmforge export`", replace_whole=True)  # before any work
    model, tok, cfg, path = load_checkpoint(checkpoint)
    results = read_evaluation(evaluation, path) if evaluation is not None else None  # before a write
    contract = tok.contract
    torch_dtype = DTYPES[dtype]
    family = families.family_of(model.config)  # before a write: a model no family carries is refused
    config = hf_config(model.config, contract, torch_dtype)
    hf = to_hf_state(model_state(model), contract.vocab_size, cfg.model.tie_embeddings, torch_dtype, family)
    with atomic_dir(out, EXPORT_OUTPUT, what="`lmforge export`") as tmp:
        save_safetensors(hf, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        _write_json(tmp / HF_CONFIG_FILE, config)
        _write_json(tmp / TOKENIZER_FILE, hf_tokenizer_json(tok))
        _write_json(tmp / TOKENIZER_CONFIG_FILE, _tokenizer_config(tok, cfg.model.max_seq_len))
        _write_json(tmp / GENERATION_CONFIG_FILE, generation_config(cfg.generate, contract))
        (tmp / MODEL_CARD_FILE).write_text(model_card(path, model, contract, out.name, results), encoding="utf-8")
        if verify:
            verify_export(model, tmp, tol=1e-4 if dtype == "float32" else None)
            verify_tokenizer(tok, tmp)
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


def hf_tokenizer_json(tok: Tokenizer) -> dict:
    """The exported tokenizer.json: the checkpoint's, with a post-processor that adds the BOS
    exactly where lmforge's contract does (`add_bos`; nothing where it is false), so that
    `AutoTokenizer(text)` gives the ids lmforge trained on (`tokenizer.hf_json.with_document_start`).
    The contract's `tokenizer_sha256` does not cover the post-processor: the export re-imports
    with the same contract."""
    raw = loads_json((tok.folder / TOKENIZER_FILE).read_text(encoding="utf-8"))
    add = tok.contract.add_bos
    return with_document_start(raw, tok.spellings["bos"] if add else None, tok.bos_id if add else None)


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
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def require_transformers():
    """The `transformers` package.

    Raises:
        LmforgeError: transformers is not installed (`errors.require_package`).
    """
    return require_package("transformers", "hf", "comparing with transformers")


#: Texts the exported tokenizer is checked on (`verify_tokenizer`): code, prose, unicode, spaces.
VERIFY_TEXTS = ("def value(self):\n    return None  # note", "  x = 1\n\n\ty", "für 12345 ünïcode ✓",
                "Hello, world! The quick brown fox.", "")
VERIFY_CHAT = ({"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "    return a + b\n"},
               {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You are welcome."})


def verify_tokenizer(tok: Tokenizer, folder: str | Path) -> None:
    """Load `folder`'s tokenizer with `transformers`' AutoTokenizer and check that it encodes as
    lmforge does: `AutoTokenizer(text)` (special tokens added, as lm-evaluation-harness and vLLM
    call it) equals the contract's document start + `tok.encode(text)` for VERIFY_TEXTS, and
    `apply_chat_template` equals `tok.render_chat` with and without the generation prompt.

    Raises:
        LmforgeError: transformers missing. ExportError: the first text or chat that differs,
        with both id lists.
    """
    transformers = require_transformers()
    auto = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in VERIFY_TEXTS:
        theirs, ours = list(auto(text)["input_ids"]), tok.contract.document_start + tok.encode(text)
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
            raise ExportError(f"{folder}: transformers' AutoTokenizer encodes {text!r} as {theirs[at:at + 8]} from "
                              f"position {at} on, lmforge as {ours[at:at + 8]} (add_bos = {tok.contract.add_bos}). "
                              f"The export is wrong; please report it with the checkpoint's tokenizer folder.")
    for prompt in (False, True):
        messages = list(VERIFY_CHAT[:3] if prompt else VERIFY_CHAT)
        theirs = list(auto.apply_chat_template(messages, tokenize=True, return_dict=False,
                                               add_generation_prompt=prompt))
        ours = tok.render_chat(messages, add_generation_prompt=prompt).ids
        if theirs != ours:
            raise ExportError(f"{folder}: transformers' apply_chat_template gives {theirs[:12]}..., lmforge's "
                              f"render_chat {ours[:12]}... (add_generation_prompt={prompt}). The export is wrong; "
                              f"please report it with the checkpoint's tokenizer folder.")


def verify_export(model: torch.nn.Module, folder: str | Path, tol: float | None = 1e-4, seq_len: int = 64) -> float:
    """Load `folder` with `transformers` (AutoModelForCausalLM: the family its config.json names,
    with eager attention, transformers' reference that computes every mechanism, soft-caps
    included) and compare its logits with `model`'s on a fixed random batch
    (2, min(seq_len, max_seq_len)), in float32.
    `tol` None (for bfloat16/float16 weights): 5% of the largest logit magnitude.

    Returns:
        the max abs logit difference.
    Raises:
        LmforgeError: transformers missing. ExportError: the difference exceeds `tol`.
    """
    transformers = require_transformers()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").float().eval()
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
    "ExportError", "map_name", "to_hf_state", "from_hf_state", "generation_config",
    "export_hf", "verify_export", "verify_tokenizer", "hf_tokenizer_json", "require_transformers",
]
