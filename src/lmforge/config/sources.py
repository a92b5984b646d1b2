"""The check of `data.sources` (a mixture's entries), which [data] runs on the value it is given."""

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
