"""Hugging Face format in (`lmforge import-hf DIR --out DIR`): a folder saved by `transformers`
as an lmforge checkpoint. The weight names and file names it shares with the way out are in
`hf`; config.json is read in `hf_config_in`; what is family-specific is the family's record in
`families`.

Import reads a folder saved by `transformers` of a family lmforge imports (FAMILIES: Llama,
Mistral, Qwen2, Qwen3, Gemma 3 text, Gemma 2, OLMo 2; config.json, model.safetensors or its
shards, tokenizer files) and writes a plain lmforge checkpoint folder (config.toml,
model.safetensors, contract.json, tokenizer files) that `Transformer.from_checkpoint`, every
stage and `sft.init` accept. It reads only files inside the folder (`confined`), states every
conversion it makes, and refuses anything lmforge's model cannot represent exactly (another
architecture, Gemma 3's image-text model, MLP or output biases, RoPE scaling lmforge lacks,
another activation, integer weights) rather than load it approximately.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from lmforge.config import Config, from_dict, validate
from lmforge.contract import padded_vocab_size
from lmforge.errors import CheckpointError, ConfigError, LmforgeError
from lmforge.export.families import chat_template_of
from lmforge.export.hf import HF_CONFIG_FILE, IMPORT_OUTPUT, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, from_hf_state
from lmforge.export.hf_config_in import family_of_hf_config, model_config_from_hf
from lmforge.export.hf_rope_in import number
from lmforge.export.options import ExportError
from lmforge.fileio import atomic_dir, check_readable, load_hf_tokenizer, loads_json, load_safetensors
from lmforge.model.io import MODEL_FILE, all_finite, load_weights, write_model_files
from lmforge.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE


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
        if t.is_floating_point() and t.dtype in (torch.float32, torch.bfloat16, torch.float16) \
                and not all_finite(t):
            raise ExportError(f"{folder}: weight {name} holds NaN or infinite values; no model computes with them. "
                              f"The weights are damaged: download or copy them again.")
        if t.is_floating_point() and t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ExportError(f"{folder}: weight {name} has dtype {str(t.dtype).removeprefix('torch.')}; lmforge imports "
                              f"float32, bfloat16 and float16 weights only (a float8 or float64 weight would be "
                              f"converted, not read as it is). Use the model's float32, bfloat16 or float16 weights.")
        if not t.is_floating_point():
            raise ExportError(f"{folder}: weight {name} has dtype {str(t.dtype).removeprefix('torch.')}; lmforge imports "
                              f"float32, bfloat16 and float16 weights only (integer or quantized weights would need a "
                              f"conversion it does not make). Use the model's unquantized weights.")
    return state


def renamed(exc: LmforgeError, replacements) -> LmforgeError:
    """`exc` with each (old, new) text of `replacements` replaced in its message, in order (an
    error naming a temporary folder, or a flag the user never typed, names what the user gave);
    `exc` itself where its class takes other arguments."""
    msg = str(exc)
    for old, new in replacements:
        msg = msg.replace(old, new)
    if msg == str(exc):
        return exc
    try:
        out = type(exc)(msg)
    except TypeError:
        return exc
    out.__dict__.update(exc.__dict__)
    return out


def import_hf(folder: str | Path, out: str | Path, log=None, eos_token: str = "",
              command: str = "`lmforge import-hf`") -> Path:
    """Turn a HF folder of a family lmforge imports (`model_config_from_hf`) into an lmforge
    checkpoint folder (atomically); the weights are read in the family's names (`map_name`).

    The tokenizer goes through `lmforge.tokenizer.import_tokenizer`: the contract is derived
    from the model's own tokenizer and conventions (its document terminator, its BOS or none,
    its chat template and end-of-turn token); the only token it may add is a distinct <|pad|>.
    A folder without a chat template takes its family's (`families.chat_template_of`: the record's
    template and end of turn, no token added), as import-gguf, which imports through here, does
    for a file without one; only a family whose record has none gets lmforge's ChatML (and its
    two markers where the vocabulary lacks them). One log line says which. Embedding and output rows
    of the tokenizer's original ids are copied; rows of added tokens start as the mean of the
    original rows; rows past the tokenizer's vocab are dropped, and the matrix is zero-padded
    to the multiple of 64 (P6). Every file read is inside `folder` (`confined`).

    The result holds config.toml, model.safetensors (float32), contract.json, tokenizer.json,
    tokenizer_config.json and state.json (step 0); it loads with
    `Transformer.from_checkpoint(out)` and serves as `sft.init` and as a `tokenizer.dir`.

    Args:
        log: called with one line per change or conversion made (the document terminator chosen,
            the BOS convention, the chat template taken, an added pad, weights cast to float32, an
            empty `architectures`).
        eos_token: the document terminator where the folder's cannot be derived (the setting
            tokenizer.eos_token).
        command: the command the user ran, as its errors name it (import-gguf imports through here).
    Raises:
        ExportError: not a folder of a family lmforge imports, a feature lmforge lacks, integer weights,
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
        hf_vocab = number(hf_vocab, "vocab_size", int, str(cfg_path))
        if hf_vocab <= 0:
            raise ExportError(f"{cfg_path}: vocab_size = {hf_vocab}: expected the number of embedding rows (> 0).")
    family = family_of_hf_config(raw, str(cfg_path))
    with atomic_dir(out, IMPORT_OUTPUT, what=command) as tmp:
        try:
            tok = import_tokenizer(folder, tmp / "tokenizer", log=say, eos_token=eos_token,
                                   family=chat_template_of(family))
        except LmforgeError as exc:  # import-tokenizer's words: its --from is this command's DIR, its --out ours
            raise renamed(exc, [(f"--from {folder}", str(folder)), (f"--out {tmp / 'tokenizer'}", f"--out {out}"),
                                (str(tmp / "tokenizer"), str(out))]) from None
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
        state = from_hf_state(hf_state, original, model_cfg.tie_embeddings, str(folder), family, model_cfg)
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
        except CheckpointError as exc:  # its words name the temporary copy: say them of the folder's weights
            detail = str(exc).replace(f"{tmp / MODEL_FILE}: ", "").replace(str(tmp / MODEL_FILE), "the weights")
            raise ExportError(f"{folder}: the weights do not fit the model its config.json describes: {detail}") \
                from None
    return out


def _grow_rows(t: torch.Tensor, original: int, vocab: int) -> torch.Tensor:
    """(padded(original), dim) -> (padded(vocab), dim): rows [original, vocab) = the mean of the
    original rows, the rest zero."""
    out = t.new_zeros(padded_vocab_size(vocab), t.shape[1])
    out[:original] = t[:original]
    out[original:vocab] = t[:original].mean(0)
    return out



__all__ = ["import_hf", "read_hf_weights", "renamed"]
