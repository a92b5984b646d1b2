"""The README's Layout block lists every module of src/lmforge, each once, and no module that
is not there: a newcomer reads the package's map in one place, and it cannot fall behind."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "lmforge"


def layout_modules() -> list[str]:
    """The module paths the Layout block names, e.g. "model/attention.py" (a line "  name/"
    opens a package, a more indented "name.py" line is one of its modules; packages nest)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Layout"):]
    block = section[section.index("```\nsrc/lmforge/") + 4:]
    block = block[: block.index("```")]
    names, open_packages = [], []  # (indent, "name/") of the packages the next line may be in
    for line in block.splitlines()[1:]:
        m = re.match(r"^( +)(\S+)", line)
        if not m:
            continue
        indent, word = len(m.group(1)), m.group(2)
        open_packages = [(i, p) for i, p in open_packages if i < indent]
        if word.endswith("/"):
            open_packages.append((indent, word))
        elif word.endswith(".py"):
            names.append("".join(p for _, p in open_packages) + word)
    return names


def test_layout_lists_every_module_once():
    listed = layout_modules()
    assert len(listed) == len(set(listed)), sorted({n for n in listed if listed.count(n) > 1})
    present = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    assert sorted(present - set(listed)) == [], "modules missing from README.md's Layout block"
    assert sorted(set(listed) - present) == [], "README.md's Layout block names modules that do not exist"


def test_the_check_reads_packages_and_top_level_modules():
    listed = layout_modules()
    assert "errors.py" in listed and "model/attention.py" in listed and "export/families/gemma3.py" in listed
