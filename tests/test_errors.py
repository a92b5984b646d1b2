"""lmforge.errors: the one handling of a missing optional package."""

from __future__ import annotations

import sys

import pytest

from lmforge.errors import DataError, LmforgeError, require_package


def test_a_present_package_is_returned():
    import json

    assert require_package("json", "hf", "anything") is json


def test_a_missing_package_names_it_and_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(LmforgeError) as exc:
        require_package("gguf", "gguf", "GGUF export")
    assert str(exc.value) == ('GGUF export needs the gguf package: gguf is not installed. Install it: '
                              'pip install "lmforge[gguf]" (in a clone of lmforge: pip install -e ".[gguf]").')


def test_the_error_class_a_submodule_and_a_package_without_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r'f\.parquet: reading Parquet needs the pyarrow package: pyarrow is not '
                                        r'installed\. Install it: pip install "lmforge\[parquet\]"'):
        require_package("pyarrow.parquet", "parquet", "f.parquet: reading Parquet", DataError)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(LmforgeError, match=r"needs the llama-cpp-python package: .* pip install -e \"\.\[interop\]\""):
        require_package("llama_cpp", "interop", "make interop", package="llama-cpp-python")
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(LmforgeError, match=r"tiktoken is not installed\. Install it: pip install tiktoken\.$"):
        require_package("tiktoken", None, "faster pretokenizing")


def test_every_optional_import_goes_through_the_helper():
    """No module of src/ but errors.py catches ImportError itself."""
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "lmforge"
    catching = sorted(str(p.relative_to(src)) for p in src.rglob("*.py")
                      if "except ImportError" in p.read_text(encoding="utf-8") and p.name != "errors.py")
    assert catching == [], catching
