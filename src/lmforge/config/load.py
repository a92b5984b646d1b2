"""Reading a config: the `Config` of all sections, TOML files, `--set` overrides, the overlay of
`LMFORGE_CONFIG_OVERLAY`, and the tables derived from the fields' declarations (BOUNDS, CHOICES)."""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import re
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any

from lmforge.config.core import AUTO_MICRO_BATCH
from lmforge.config.fields import suggest
from lmforge.config.schema import SECTION_TYPES, OVERLAY_ENV, Config, default_of
from lmforge.errors import ConfigError, os_advice
from lmforge.fileio import path_from_text

#: The resolved config, written into every output folder and checkpoint.
CONFIG_FILE = "config.toml"


def field_types(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def coerce(section: str, key: str, value: Any, typ: type, where: str) -> Any:
    """Check `value` against the dataclass field type (int/float/bool/str); floats must be
    finite (NaN and infinity pass `x <= 0` checks and then fail deep inside torch)."""
    name = f"{section}.{key}"
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if name == "train.micro_batch_size" and value == "auto":
            return AUTO_MICRO_BATCH
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{where}: {name} = {value!r}: expected a finite number (default "
                                  f"{default_of(section, key)!r}).")
            return float(value)
    elif typ is str:
        if isinstance(value, str):
            value = path_from_text(value)  # a path config.toml keeps as bytes (Config.to_toml)
            bad = next((c for c in value if 0 < ord(c) < 32 or ord(c) == 127), None)  # NUL: the path check says it
            if bad is not None:
                raise ConfigError(f"{where}: {name} = {value!r} holds the control character {bad!r} (a line break, a "
                                  f"tab, ...): every text field of the config is one line. Give the value on one line "
                                  f"(default {default_of(section, key)!r}).")
            return value
    elif typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ)
        if isinstance(value, list) and all(isinstance(v, item) for v in value):
            return list(value)
    elif typ is dict:
        if isinstance(value, dict):
            return dict(value)
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    expected = getattr(typ, "__name__", typ)
    if typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ)
        expected = f"a list of {'tables' if item is dict else 'texts' if item is str else item.__name__}"
    if typ is dict:
        expected = "a table"
    raise ConfigError(
        f"{where}: {name} = {shown} has type {type(value).__name__}, expected {expected}. "
        f"Fix the value (for example {name}={default_of(section, key)!r}, the default)."
    )
def from_dict(raw: dict[str, Any], where: str = "config") -> Config:
    """Build a Config from nested dicts, strictly (unknown keys are errors)."""
    cfg = Config()
    for section, values in raw.items():
        if section not in SECTION_TYPES:
            raise ConfigError(
                f"{where}: unknown section [{section}].{suggest(section, list(SECTION_TYPES))}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: [{section}] must be a table of keys, got {values!r}.")
        obj = getattr(cfg, section)
        types = field_types(type(obj))
        for key, value in values.items():
            if key not in types:
                raise ConfigError(
                    f"{where}: unknown key {section}.{key}.{suggest(key, list(types))}"
                )
            setattr(obj, key, coerce(section, key, value, types[key], where))
    return cfg


def _parse_override_value(text: str) -> Any:
    """`--set` values are TOML literals; a bare word is taken as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        raise ConfigError(f"--set value {text[:40]!r}...: nested too deeply to read (Python's recursion limit). "
                          f"Give a plain value.") from None


def apply_overrides(cfg: Config, overrides: list[str] | None) -> Config:
    """Apply `section.key=value` strings (the repeatable `--set` flag)."""
    raw = cfg.to_dict()
    names: list[str] = []
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(
                f"--set {item!r}: expected section.key=value, for example --set train.steps=100."
            )
        dotted, text = item.split("=", 1)
        section, key = dotted.strip().split(".", 1)
        bad = next((c for c in item if 0 < ord(c) < 32 or ord(c) == 127), None)  # NUL: the path check says it
        if bad is not None:
            raise ConfigError(f"--set {item!r}: holds the control character {bad!r} (a line break, a tab, ...); a "
                              f"--set value is one line, e.g. --set train.steps=100.")
        if section not in raw:
            raise ConfigError(
                f"--set {item!r}: unknown section {section!r}.{suggest(section, list(raw))}"
            )
        key, _, option = key.partition(".")  # data.executor.partition: an option of a table
        if key not in raw[section]:
            raise ConfigError(
                f"--set {item!r}: unknown key {section}.{key}.{suggest(key, list(raw[section]))}"
            )
        value = _parse_override_value(text.strip())
        if option:
            if field_types(type(getattr(cfg, section)))[key] is not dict:
                raise ConfigError(f"--set {item!r}: {section}.{key} is not a table; expected --set {section}.{key}=VALUE.")
            raw[section][key] = {**raw[section][key], option: value}
            names.append(f"{section}.{key}")
            continue
        typ = field_types(type(getattr(cfg, section)))[key]
        if typ is str and isinstance(value, (list, dict)):
            kind = "a list" if isinstance(value, list) else "a table"
            raise ConfigError(f"--set {item!r}: {section}.{key} is a text field, and {text.strip()!r} is {kind}. Give "
                              f"one value (default {default_of(section, key)!r}); quote it (\"...\") if the brackets are "
                              f"part of it.")
        if typ is str and not isinstance(value, str):
            value = text.strip()  # e.g. --set sft.init=123 names a folder "123"
        raw[section][key] = value
        names.append(f"{section}.{key}")
    out = from_dict(raw, where="--set")
    out.set_keys = tuple(dict.fromkeys((*cfg.set_keys, *names)))
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                overlay: bool = True) -> Config:
    """Load a TOML recipe (or the defaults when `path` is None), apply overrides, then the
    overlay (`LMFORGE_CONFIG_OVERLAY`, unless `overlay` is False: a saved config.toml is a record,
    read as saved), validate. The overlay's keys are kept in `Config.overlay_keys`.

    Raises:
        ConfigError: missing file, TOML syntax error, unknown key, wrong type, bad shape.
    """
    if path is None:
        cfg = Config()
    else:
        path = Path(path)
        try:
            is_file = path.is_file()
        except OSError as exc:  # e.g. a name too long for the file system
            shown = str(path) if len(str(path)) <= 80 else str(path)[:80] + "..."
            raise ConfigError(f"config file {shown}: cannot be read ({exc.strerror}); {os_advice(exc)}.") from None
        if not is_file:
            gone = "is a link to nothing or a symbolic link loop" if path.is_symlink() else "does not exist"
            raise ConfigError(
                f"config file {path} {gone}. Pass an existing recipe, "
                f"for example --config configs/stdlib-tiny.toml."
            )
        text = read_config_text(path, f"config file {path}")  # a regular file, capped: never a hang
        raw = parse_toml(text, str(path), "Fix the file")
        cfg = from_dict(raw, where=str(path))
    cfg = apply_overrides(cfg, overrides)
    overlay = os.environ.get(OVERLAY_ENV) if overlay else None
    if not overlay:
        return cfg.validate()
    layered, keys = _overlaid(cfg, overlay)
    try:
        return layered.validate()
    except ConfigError as exc:  # the overlay's values are checked here: the error names it
        where = f"{OVERLAY_ENV}={overlay}"
        if any(re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", str(exc)) for k in keys):
            raise ConfigError(f"{where} sets {', '.join(keys)}: {exc}") from None
        raise ConfigError(f"{exc} ({where} was applied over --config and --set: it sets {', '.join(keys)}.)") from None


#: OVERLAY_ENV (lmforge.config.schema): an environment variable naming a TOML file whose keys are
#: applied after `--config` and `--set`: how tests/test_readme.py runs the README's commands, as
#: written, on a tiny model. It sets what a command runs, never what a saved file records: a
#: checkpoint's or run's config.toml is read as saved (`load_config(overlay=False)`).
_overlay_said: set[str] = set()


#: The largest config file read (--config or the overlay): a recipe is a few KB; anything past this
#: is not a recipe (and a device such as /dev/zero would never end).
MAX_CONFIG_BYTES = 1 << 20


def parse_toml(text: str, where: str, fix: str) -> dict:
    """The TOML document `text` of the config file `where` as a dict.

    Raises:
        ConfigError: not valid TOML, or nested past Python's recursion limit; the message starts
        with `where` and ends with `fix` ("Fix the file", ...).
    """
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}. {fix}.") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to read (Python's recursion limit); a config is sections of "
                          f"plain keys. {fix}.") from None


def read_config_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of the config file `path`, read only from a regular file of at most
    MAX_CONFIG_BYTES (a FIFO would block, a device never end). `what` starts every message
    ("config file X", "LMFORGE_CONFIG_OVERLAY=X").

    Raises:
        ConfigError: missing, not a regular file, unreadable, too large or not UTF-8.
    """
    from lmforge.fileio import SpecialFile, read_capped

    try:
        data = read_capped(path, MAX_CONFIG_BYTES)
    except SpecialFile as exc:
        raise ConfigError(f"{what} is {exc.kind}, not a regular file; a config is a TOML file. Point it at one.") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        if isinstance(exc, FileNotFoundError) or (isinstance(exc, OSError) and exc.errno == errno.ELOOP):
            gone = "is a link to nothing or a symbolic link loop" if Path(path).is_symlink() else "does not exist"
            raise ConfigError(f"{what} {gone}. Point it at a TOML file.") from None
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        advice = os_advice(exc) if isinstance(exc, OSError) else "give a path without it"
        raise ConfigError(f"{what}: cannot be read ({reason}); {advice}.") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{what}: larger than {MAX_CONFIG_BYTES:,} bytes; a config is a TOML file of a few "
                          f"sections. Point it at one.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what}: not UTF-8 text (byte {exc.start}: {exc.reason}); a TOML file is UTF-8. "
                          f"Re-save it as UTF-8.") from None


def apply_overlay(cfg: Config, path: str | None) -> Config:
    """`cfg` with the keys of the TOML file `path` (the `LMFORGE_CONFIG_OVERLAY` environment
    variable) replaced; None or "" changes nothing. One line on stderr names the file and its keys
    (once per process), so a run never takes them silently. Every error names the variable and
    the file.

    Raises:
        ConfigError: the file is missing, not a regular file, too large, not TOML, or holds an
        unknown key or a wrong type.
    """
    return _overlaid(cfg, path)[0] if path else cfg


def overlay_differences(saved: Config, section: str) -> tuple[str, list[tuple[str, Any, Any]]]:
    """What the overlay (`LMFORGE_CONFIG_OVERLAY`, when set) would change in the [section] of the
    saved config `saved` (a checkpoint's, read as saved): (the overlay's path, [(section.key, the
    overlay's value, the saved value)]), read without the line `apply_overlay` prints (nothing is
    applied). ("", []) without an overlay.

    Raises:
        ConfigError: the overlay cannot be read, or holds an unknown key or a wrong type (named).
    """
    path = os.environ.get(OVERLAY_ENV)
    if not path:
        return "", []
    layered, keys = _overlaid(saved, path, say=False)
    changed = []
    for name in keys:
        sec, key = name.split(".", 1)
        if sec == section and getattr(getattr(layered, sec), key) != getattr(getattr(saved, sec), key):
            changed.append((name, getattr(getattr(layered, sec), key), getattr(getattr(saved, sec), key)))
    return path, changed


def _overlaid(cfg: Config, path: str, say: bool = True) -> tuple[Config, list[str]]:
    """`apply_overlay` and the keys the overlay sets ("section.key"); `say`: print its line."""
    where = f"{OVERLAY_ENV}={path}"
    text = read_config_text(path, where)
    raw = parse_toml(text, where, f"Fix the file, or unset {OVERLAY_ENV}")
    merged = cfg.to_dict()
    keys = []
    for section, values in raw.items():
        if not isinstance(values, dict) or section not in merged:
            raise ConfigError(f"{where}: [{section}] is not a config section.{suggest(section, list(merged))}")
        merged[section].update(values)
        keys += [f"{section}.{k}" for k in values]
    out = from_dict(merged, where=where)
    out.set_keys = cfg.set_keys
    out.overlay_keys, out.overlay_path = tuple(keys), path
    if say and path not in _overlay_said:
        _overlay_said.add(path)
        print(f"config: {where} sets {', '.join(keys)} (over --config and --set)", file=sys.stderr)
    return out, keys
