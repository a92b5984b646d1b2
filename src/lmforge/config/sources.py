"""The checks of `data.sources` (a mixture's entries), `data.executor` (its options) and
`data.filters`, which [data] runs on the value it is given."""

from __future__ import annotations

import math
import re

from lmforge.errors import ConfigError

#: The keys of a data.sources entry.
SOURCE_KEYS = ("source", "weight", "text_field", "name")
#: The most sources a mixture may have.
MAX_SOURCES = 256


def check_sources(name: str, sources: list[dict]) -> None:
    """Each data.sources entry: a table of SOURCE_KEYS with a non-empty `source`, a finite
    weight > 0, a non-empty text_field and a folder-safe name; no source twice, no name twice."""
    example = '[{source = "corpus/*.parquet", weight = 3}, {source = "code.jsonl.zst", text_field = "content"}]'
    if len(sources) > MAX_SOURCES:
        raise ConfigError(f"{name} lists {len(sources)} sources; at most {MAX_SOURCES}. Merge some into one folder.")
    seen: dict[tuple, int] = {}
    names: dict[str, int] = {}
    for i, entry in enumerate(sources):
        where = f"{name}[{i}]"
        unknown = sorted(set(entry) - set(SOURCE_KEYS))
        if unknown:
            raise ConfigError(f"{where} has the key {unknown[0]!r}; a source takes {', '.join(SOURCE_KEYS)} "
                              f"(e.g. {name} = {example}).")
        src = entry.get("source")
        if not isinstance(src, str) or not src:
            raise ConfigError(f"{where} = {entry!r}: `source` must be a non-empty text (what data.source takes), "
                              f"e.g. {name} = {example}.")
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"{where}.weight = {weight!r}: expected a finite number > 0 (its share of the rows is "
                              f"weight / the sum of the weights; default 1).")
        field = entry.get("text_field", "text")
        if not isinstance(field, str) or not field:
            raise ConfigError(f"{where}.text_field = {field!r}: expected a non-empty text (default \"text\").")
        own = entry.get("name")
        if own is not None and (not isinstance(own, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", own)):
            raise ConfigError(f"{where}.name = {own!r}: expected 1 to 64 letters, digits, '.', '_' or '-' (it names "
                              f"the source's folder in data.dir), or no name (derived from the source).")
        key = (src, field)
        if key in seen:
            raise ConfigError(f"{where} repeats {name}[{seen[key]}] (source {src!r}, text_field {field!r}); list a "
                              f"source once and give it the summed weight.")
        seen[key] = i
        if own is not None:
            if own in names:
                raise ConfigError(f"{where}.name = {own!r} is also {name}[{names[own]}]'s; give each a name of its own.")
            names[own] = i


#: data.executor's options and the Python types each takes.
EXECUTOR_OPTIONS = {"tasks": int, "partition": str, "time": str, "cpus_per_task": int, "mem_per_cpu_gb": int,
                    "qos": str, "venv_path": str, "address": str}


def check_executor(name: str, value: dict) -> None:
    import datetime

    for key, v in value.items():
        if key not in EXECUTOR_OPTIONS:
            raise ConfigError(f"{name}.{key}: unknown option; expected one of {', '.join(EXECUTOR_OPTIONS)}.")
        want = EXECUTOR_OPTIONS[key]
        ok = isinstance(v, want) and not isinstance(v, bool) or (key == "time" and isinstance(v, datetime.time))
        if not ok or (want is int and v < 1):
            raise ConfigError(f"{name}.{key} = {v!r}: expected {'an integer >= 1' if want is int else 'a text'}.")


#: data.filters' names (lmforge.data.quality.FILTERS: datatrove's filter of each) and data.dedup's values.
FILTER_NAMES = ("gopher_quality", "gopher_repetition", "c4_quality", "fineweb_quality")
DEDUP = ("exact", "minhash")


def check_filters(name: str, value) -> None:
    """ConfigError unless `value` is a list of distinct FILTER_NAMES."""
    if not isinstance(value, list) or any(not isinstance(v, str) or v not in FILTER_NAMES for v in value) \
            or len(set(value)) != len(value):
        raise ConfigError(f"{name} = {value!r}: expected a list of distinct filter names among "
                          f"{', '.join(map(repr, FILTER_NAMES))} (datatrove's, applied in the order listed), or [] "
                          f"(no filter).")
