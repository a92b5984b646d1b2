"""The shape of the source tree, kept (issue 54, "the joins closed"): no module over 400 lines, no
private name (`_x`) imported from another module (a name two modules share is public where it is
defined), and no name re-exported only so that a test can import it from elsewhere (tests import
from where a name lives). Each check names what breaks it."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
MAX_LINES = 400


def modules():
    for path in sorted(SRC.rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        yield path, name, path.read_text(encoding="utf-8")


def test_no_module_is_over_400_lines():
    over = {str(p.relative_to(SRC)): text.count("\n") for p, _, text in modules() if text.count("\n") > MAX_LINES}
    assert not over, f"split these modules (at most {MAX_LINES} lines each): {over}"


def private_imports(text: str, module: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmforge"):
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__") and node.module != module]
    return found


def test_no_private_name_crosses_a_module():
    found = {str(p.relative_to(SRC)): bad for p, name, text in modules() if (bad := private_imports(text, name))}
    assert not found, f"make these names public where they are defined (drop the underscore): {found}"


def test_the_check_sees_a_private_import():
    assert private_imports("from lmforge.data.records import _rows\n", "lmforge.data.sources") == \
        ["from lmforge.data.records import _rows"]
    assert private_imports("from lmforge.data.records import _rows\n", "lmforge.data.records") == []


def test_no_re_export_kept_for_a_test():
    found = [f"{p.relative_to(SRC)}:{i}" for p, _, text in modules() for i, line in enumerate(text.splitlines(), 1)
             if "noqa: F401" in line and "test" in line.split("noqa: F401", 1)[1]]
    assert not found, f"tests import from where a name lives; remove these re-exports: {found}"
