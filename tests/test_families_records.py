"""A family is one module (issue 54): the import and export code outside `export/families/` asks a
family's record and never tests a family's name — no comparison, membership test or dictionary
key there names a model_type, an architecture or a llama.cpp architecture of a record — and each
family's module defines one record that `FAMILIES` lists."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from lmforge.export.families import FAMILIES, LLAMA_CPP_ARCHS, Family

SRC = Path(__file__).resolve().parent.parent / "src" / "lmforge"
RECORDS = SRC / "export" / "families"
#: GGUF's tokenizer names ("llama": tokenizer.ggml.model SentencePiece-style; "qwen2": a
#: tokenizer.ggml.pre split) are llama.cpp's tokenizer kinds, not model families
TOKENIZER_MODULES = ("gguf_vocab.py", "gguf_in_tokenizer.py")


def family_names() -> set[str]:
    names = {f.model_type for f in FAMILIES.values()} | {f.architecture for f in FAMILIES.values()}
    return names | {f.gguf_arch for f in FAMILIES.values() if f.gguf_arch} | {"gemma", "gemma3"}


def name_tests(text: str) -> list[str]:
    """Where `text` tests a family's name: a string constant of `family_names()` compared (==, !=,
    in, not in) or used as a dictionary key."""
    names, found = family_names(), []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Compare):
            consts = [c for c in [node.left, *node.comparators] for c in ast.walk(c)
                      if isinstance(c, ast.Constant) and c.value in names]
            found += [f"line {node.lineno}: compares with {c.value!r}" for c in consts]
        elif isinstance(node, ast.Dict):
            found += [f"line {node.lineno}: key {k.value!r}" for k in node.keys
                      if isinstance(k, ast.Constant) and k.value in names]
    return found


def test_import_and_export_code_never_tests_a_family_name():
    found = {}
    for path in sorted((SRC / "export").glob("*.py")):
        if path.name in TOKENIZER_MODULES:
            continue
        bad = name_tests(path.read_text(encoding="utf-8"))
        if bad:
            found[path.name] = bad
    assert not found, f"ask the family's record (export/families/) instead of testing its name: {found}"


def test_the_check_sees_a_name_test():
    assert name_tests("if arch == 'gemma3':\n    pass\n") == ["line 1: compares with 'gemma3'"]
    assert name_tests("x = name in ('qwen2', 'other')\n") == ["line 1: compares with 'qwen2'"]
    assert name_tests("d = {'olmo2': 1}\n") == ["line 1: key 'olmo2'"]
    assert name_tests("if family.gguf_in_config is not None:\n    pass\n") == []


def test_each_family_module_defines_the_record_families_lists():
    modules = sorted(p.stem for p in RECORDS.glob("*.py") if p.stem not in ("__init__", "record", "shared", "gemma"))
    records = [importlib.import_module(f"lmforge.export.families.{m}").FAMILY for m in modules]
    assert all(isinstance(r, Family) for r in records)
    assert sorted(r.model_type for r in records) == sorted(FAMILIES)
    assert all(FAMILIES[r.model_type] is r for r in records)
    # every llama.cpp architecture a record names has its runtime rules
    assert {f.gguf_arch for f in FAMILIES.values() if f.gguf_arch} == set(LLAMA_CPP_ARCHS)
    # each record builds its own config.json
    assert all(callable(f.hf_config_out) for f in FAMILIES.values())
