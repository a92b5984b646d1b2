"""Every file the text points at exists (issue 54): a path such as `tests/test_dpo.py`,
`docs/data.md`, `bench/bench_rl.py` or `src/lmforge/train/plan.py` named in a docstring or a
comment of src/, in README.md or in docs/*.md is a file of this repository, and a
`tests/FILE.py::test_name` names a function (or class) of that file (`test_t9_...` a prefix of one);
a bare root-level name such as `CHANGELOG.md` is a file at the root; and every relative link of
README.md and docs/*.md (`[text](docs/rl.md#anchor)`) reaches a file and, where it names one, a
heading of that file (GitHub's anchors), so a section moved out of the README stays one click away.

A path of another project (lm-eval's `docs/model_guide.md`) is not ours: `OTHER_PROJECTS` names
each with the project its text names beside it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: a repository path as prose names it: not inside a longer path or a URL (no `/`, `.` or word
#: character before it), ending at its extension, with an optional `::name` (or `::prefix...`)
PATH = re.compile(r"(?<![\w./-])((?:tests|docs|bench|src|configs)/[\w./-]*?\.(?:py|md|png|toml))(?![\w-])"
                  r"(?:::(\w+)(\.\.\.)?)?")
#: a file at the root named alone, e.g. CHANGELOG.md (and not MODEL-FAMILIES.md, which is not here)
ROOT_DOC = re.compile(r"(?<![\w./-])([A-Z][A-Z0-9_-]+\.md)\b")
#: paths of other projects' repositories, each with the name its text gives the project (within
#: the 80 characters before the path)
OTHER_PROJECTS = {"docs/source/dataset_formats.md": "huggingface/trl", "docs/model_guide.md": "lm-eval"}
#: a placeholder, as `src/lmforge/stages/NAME.py` (no module of ours is named in capitals)
PLACEHOLDER = re.compile(r"(?:^|/)[A-Z_]{3,}\.py$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def texts() -> list[tuple[Path, str]]:
    """The files whose text may name a path: every module of src/, README.md, docs/*.md."""
    files = [*sorted((ROOT / "src").rglob("*.py")), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [(f, f.read_text(encoding="utf-8")) for f in files if "egg-info" not in f.parts]


def defines(path: Path, name: str, prefix: bool) -> bool:
    end = "" if prefix else r"\b"
    pattern = rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}{end}"
    return re.search(pattern, path.read_text(encoding="utf-8"), re.M) is not None


def dangling_paths(where: str, text: str, root: Path = ROOT) -> list[str]:
    """`where: path` for every path of `text` that is not in `root` (see the module docstring)."""
    out = []
    for m in PATH.finditer(text):
        rel, name, ellipsis = m.group(1), m.group(2), m.group(3)
        if rel in OTHER_PROJECTS and OTHER_PROJECTS[rel] in text[max(0, m.start() - 80): m.start()]:
            continue
        if PLACEHOLDER.search(rel):
            continue
        line = text.count("\n", 0, m.start()) + 1
        if not (root / rel).is_file():
            out.append(f"{where}:{line}: {rel} is not a file of the repository")
        elif name and rel.endswith(".py") and not defines(root / rel, name, prefix=bool(ellipsis)):
            out.append(f"{where}:{line}: {rel} defines no {name}{ellipsis or ''}")
    for m in ROOT_DOC.finditer(text):
        if not (root / m.group(1)).is_file():
            out.append(f"{where}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)} is not a file at the root")
    return out


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of `markdown` (fenced blocks left out): lower case,
    punctuation but `-` and `_` dropped, spaces to `-`, a repeated one suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path, text: str) -> list[str]:
    """Every relative link of the Markdown file `path` whose file or heading is not there."""
    out = []
    prose = FENCE.sub("", text)
    for m in LINK.finditer(prose):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        if not file:
            if anchor not in github_anchors(text):
                out.append(f"{path.name}: [{target}]: no heading #{anchor}")
            continue
        dest = (path.parent / file).resolve()
        if not dest.exists():
            out.append(f"{path.name}: [{target}]: no file {file}")
        elif anchor and dest.suffix == ".md" and anchor not in github_anchors(dest.read_text(encoding="utf-8")):
            out.append(f"{path.name}: [{target}]: {dest.name} has no heading #{anchor}")
    return out


def test_every_path_the_text_names_exists():
    dangling = [d for f, text in texts() for d in dangling_paths(str(f.relative_to(ROOT)), text)]
    assert not dangling, "\n".join(dangling)


def test_every_link_of_the_readme_and_docs_reaches_its_file_and_heading():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [b for p in pages for b in broken_links(p, p.read_text(encoding="utf-8"))]
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_page_of_docs():
    """A page of docs/ that the README does not link is a page no reader finds."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {m.group(1).partition("#")[0] for m in LINK.finditer(readme)}
    missing = [f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in linked]
    assert not missing, f"README.md links none of {missing}"


def test_the_checks_catch_what_they_are_for(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_one():\n    pass\n\n\ndef test_t9_loss():\n    pass\n")
    (tmp_path / "CHANGELOG.md").write_text("")
    text = ("see tests/test_a.py, tests/test_a.py::test_one and tests/test_a.py::test_t9_... (prefix);\n"
            "tests/test_families.py is gone, tests/test_a.py::test_two never was, MODEL-FAMILIES.md\n"
            "neither; CHANGELOG.md is here, src/lmforge/stages/NAME.py a placeholder; https://github.com/o/r/blob/main/tests/x.py and\n"
            "lm-eval's `docs/model_guide.md` are other projects'.\n")
    assert dangling_paths("t", text, tmp_path) == [
        "t:2: tests/test_families.py is not a file of the repository",
        "t:2: tests/test_a.py defines no test_two",
        "t:2: MODEL-FAMILIES.md is not a file at the root",
    ]
    assert github_anchors("# A: `lmforge eval --tasks`\n```\n# not a heading\n```\n## llama.cpp, Ollama\n## LoRA\n"
                          "## LoRA\n") == {"a-lmforge-eval---tasks", "llamacpp-ollama", "lora", "lora-1"}
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "rl.md").write_text("# RL\n\n## Rewards\n")
    page = tmp_path / "README.md"
    md = "[a](docs/rl.md#rewards) [b](docs/rl.md#nope) [c](docs/gone.md) [d](https://x.org/y) [e](#here) [f](#gone)\n# Here\n"
    assert broken_links(page, md) == ["README.md: [docs/rl.md#nope]: rl.md has no heading #nope",
                                      "README.md: [docs/gone.md]: no file docs/gone.md",
                                      "README.md: [#gone]: no heading #gone"]
