"""Reading a Hugging Face tokenizer folder's JSON files: the token strings of
tokenizer_config.json, its add_prefix_space checked against tokenizer.json's pre-tokenizer,
and the variables a chat template sees."""

from __future__ import annotations

from pathlib import Path

from lmforge.errors import ContractError, os_error
from lmforge.fileio import loads_json


def read_json(path: str | Path) -> dict:
    try:
        raw = loads_json(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:  # the system's refusal, in its own words (not a damaged file)
        raise os_error(exc, path, "read") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ContractError(f"{path}: not readable JSON ({exc}). Restore the file from where it came from.") from None
    if not isinstance(raw, dict):
        raise ContractError(f"{path}: expected a JSON object, found {type(raw).__name__}.")
    return raw


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def prefix_space_settings(node) -> list[tuple[str, bool]]:
    """(type, adds a prefix space) for each ByteLevel / Metaspace in a pre-tokenizer JSON tree."""
    found: list[tuple[str, bool]] = []
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "ByteLevel" and "add_prefix_space" in node:
            found.append((kind, bool(node["add_prefix_space"])))
        elif kind == "Metaspace":
            scheme = node.get("prepend_scheme", "always" if node.get("add_prefix_space", True) else "never")
            found.append((kind, scheme != "never"))
        for value in node.values():
            found += prefix_space_settings(value)
    elif isinstance(node, list):
        for value in node:
            found += prefix_space_settings(value)
    return found


def check_prefix_space(tokenizer_json: dict, config: dict, tokenizer_path: str | Path,
                       config_path: str | Path) -> None:
    """P4: `add_prefix_space` in tokenizer_config.json, when set, must agree with the pre-tokenizer
    in tokenizer.json (else `transformers` and lmforge tokenize the same text differently).

    Raises:
        ContractError: naming both files and both values.
    """
    want = config.get("add_prefix_space")
    if want is None:
        return
    for kind, has in prefix_space_settings(tokenizer_json.get("pre_tokenizer")):
        if has != bool(want):
            raise ContractError(
                f"{config_path} sets add_prefix_space = {bool(want)}, but the {kind} pre-tokenizer in "
                f"{tokenizer_path} has it {has}: the two would tokenize the same text differently (P4). "
                f"Make them agree (set add_prefix_space to {has} in {config_path}), then import again."
            )


def template_vars(config: dict) -> dict[str, str]:
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        text = token_text(config.get(name))
        if text:
            out[name] = text
    return out


#: Post-processors that add special tokens (replaced at the HF border); others (ByteLevel: offsets
#: only) are kept in front of the template.
_ADDING_PROCESSORS = ("TemplateProcessing", "BertProcessing", "RobertaProcessing")


def with_document_start(tokenizer_json: dict, bos: str | None, bos_id: int | None) -> dict:
    """`tokenizer_json` (a tokenizer.json object) with a post-processor that makes an HF
    `encode(text)` (add_special_tokens=True, as `transformers`' `AutoTokenizer(text)`) start as
    lmforge's documents and prompts do: `[bos] text` when `bos` is given (the contract's
    `add_bos`), `text` alone when None; never an EOS. Llama's own tokenizer.json carries the same
    `TemplateProcessing` (pair: `[bos] A [bos] B`, B with type id 1). A ByteLevel post-processor
    already there (offsets only) is kept in front of it; one that adds tokens is replaced.

    Args:
        bos, bos_id: the BOS's spelling and id (both or neither).
    Returns:
        a new object; `tokenizer_json` is not modified.
    """
    def piece(name: str, type_id: int) -> dict:
        return {"SpecialToken": {"id": name, "type_id": type_id}}

    def seq(name: str, type_id: int) -> dict:
        return {"Sequence": {"id": name, "type_id": type_id}}

    start = [piece(bos, 0)] if bos is not None else []
    start_b = [piece(bos, 1)] if bos is not None else []
    template = {"type": "TemplateProcessing", "single": [*start, seq("A", 0)],
                "pair": [*start, seq("A", 0), *start_b, seq("B", 1)],
                "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}} if bos is not None else {}}
    old = tokenizer_json.get("post_processor")
    kept = old.get("processors", []) if isinstance(old, dict) and old.get("type") == "Sequence" else [old]
    kept = [p for p in kept if isinstance(p, dict) and p.get("type") not in _ADDING_PROCESSORS]
    processor = {"type": "Sequence", "processors": [*kept, template]} if kept else template
    return {**tokenizer_json, "post_processor": processor}
