"""Reading a Hugging Face tokenizer folder's JSON files: the token strings of
tokenizer_config.json, its add_prefix_space checked against tokenizer.json's pre-tokenizer,
and the variables a chat template sees."""

from __future__ import annotations

from pathlib import Path

from lmforge.errors import ContractError, os_error
from lmforge.fileio import loads_json


def _read_json(path: str | Path) -> dict:
    try:
        raw = loads_json(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:  # the system's refusal, in its own words (not a damaged file)
        raise os_error(exc, path, "read") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ContractError(f"{path}: not readable JSON ({exc}). Restore the file from where it came from.") from None
    if not isinstance(raw, dict):
        raise ContractError(f"{path}: expected a JSON object, found {type(raw).__name__}.")
    return raw


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _prefix_space_settings(node) -> list[tuple[str, bool]]:
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
            found += _prefix_space_settings(value)
    elif isinstance(node, list):
        for value in node:
            found += _prefix_space_settings(value)
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
    for kind, has in _prefix_space_settings(tokenizer_json.get("pre_tokenizer")):
        if has != bool(want):
            raise ContractError(
                f"{config_path} sets add_prefix_space = {bool(want)}, but the {kind} pre-tokenizer in "
                f"{tokenizer_path} has it {has}: the two would tokenize the same text differently (P4). "
                f"Make them agree (set add_prefix_space to {has} in {config_path}), then import again."
            )


def _template_vars(config: dict) -> dict[str, str]:
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        text = _token_text(config.get(name))
        if text:
            out[name] = text
    return out
