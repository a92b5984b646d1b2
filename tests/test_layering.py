"""The import graph of `src/lmforge`: layered, arrows pointing down, no cycle.

Every import counts, the ones inside functions included (a lazy import is still a
dependency). Layers, lowest first (docs/design.md, "Layers"):

    errors                    0  the error family
    signals                   0.25  SIGINT/SIGTERM: a command unwinds, a training loop ends its step
    fileio                    0.5  the one writer
    config, runtime, sandbox  1  the typed config; device and precision; running generated code
    contract                  2
    tokenizer                 3
    model, data               4  the model sits at the bottom: it imports only layers 0-2
    loading                   4.5  a checkpoint with its tokenizer, the contract checked
    evaluate, generate        5  running a model over batches; decoding
    scorers                   5.5  grading what a model wrote (parse checks, doctests)
    evals                     5.75  evaluation suites (tasks, scoring rules, pass@k)
    train, export             6
    serve                     7
    stages                    8  one module per command
    cli_args                  8.5  each command's arguments
    cli                       9
    __main__                  10
A module may import its own package and any lower layer, never a higher one. Within
`stages`, no stage imports another stage: they share `stages.common` and `stages.tuning`;
only `stages.speedrun` (every stage in order, by design) and the package's `__init__` import
stages.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "lmforge"

LAYERS = {
    "errors": 0, "signals": 0.25, "fileio": 0.5,
    "config": 1, "runtime": 1, "sandbox": 1,
    "contract": 2,
    "tokenizer": 3,
    "model": 4, "data": 4,
    "loading": 4.5,
    "evaluate": 5, "generate": 5,
    "scorers": 5.5, "evals": 5.75,
    "train": 6, "export": 6,
    "serve": 7,
    "stages": 8,
    "cli_args": 8.5, "cli": 9, "__main__": 10,
}
#: Modules of `stages/` that are not a command: what the stages share.
STAGES_SHARED = {"common", "tuning"}
#: Modules of `stages/` that compose other stages.
STAGES_COMPOSING = {"speedrun"}
#: What `model/` may import besides itself: nothing above the contract.
MODEL_MAY_IMPORT = {"errors", "fileio", "config", "runtime", "contract"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every lmforge module `path` imports, at any depth of the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "lmforge"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "lmforge":
                continue
            for a in node.names:  # `from lmforge.model import io` imports the module lmforge.model.io
                sub = f"{base}.{a.name}"
                found.add(sub if _exists(sub) else base)
    return found


def _exists(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in sorted(SRC.rglob("*.py"))}


def top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "lmforge"


def test_every_module_has_a_layer():
    assert {top(m) for m in graph()} - {"lmforge"} <= set(LAYERS), "add the new package to LAYERS"


def test_imports_point_down():
    wrong = []
    for mod, deps in graph().items():
        here = top(mod)
        if here == "lmforge":  # the package's __init__: the version and the error base class only
            assert deps <= {"lmforge.errors"}, deps
            continue
        for dep in deps:
            there = top(dep)
            if there == here or there == "lmforge":
                continue
            if LAYERS[there] >= LAYERS[here]:
                wrong.append(f"{mod} -> {dep}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_model_imports_only_config_contract_and_errors_level_modules():
    for mod, deps in graph().items():
        if top(mod) == "model":
            outside = {top(d) for d in deps} - {"model"}
            assert outside <= MODEL_MAY_IMPORT, (mod, outside)


def test_no_cycle():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if d == m or d not in g:
                continue
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in g:
        if m not in state:
            visit(m)


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a fake tree with model -> train and a -> b -> a."""
    fake = tmp_path / "lmforge"
    (fake / "model").mkdir(parents=True)
    (fake / "train").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "model" / "__init__.py").write_text("")
    (fake / "train" / "__init__.py").write_text("")
    (fake / "model" / "a.py").write_text("def f():\n    from lmforge.train import b\n")
    (fake / "train" / "b.py").write_text("from lmforge.model import a\n")
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    import pytest

    with pytest.raises(AssertionError, match="cycle"):
        test_no_cycle()
    with pytest.raises(AssertionError, match="lmforge.model.a -> lmforge.train.b"):
        test_imports_point_down()


def stage_imports(g: dict[str, set[str]]) -> list[str]:
    """`a -> b` for every stage module importing another stage module (module docstring)."""
    def stage(name: str) -> str | None:
        parts = name.split(".")
        return parts[2] if len(parts) == 3 and parts[1] == "stages" else None

    wrong = []
    for mod, deps in g.items():
        here = stage(mod)
        if here is None or here in STAGES_SHARED | STAGES_COMPOSING:
            continue
        wrong += [f"{mod} -> {d}" for d in sorted(deps) if stage(d) and stage(d) not in STAGES_SHARED and d != mod]
    return wrong


def test_no_stage_imports_another_stage():
    wrong = stage_imports(graph())
    assert not wrong, "a stage imports another stage (share it through stages.common or stages.tuning):\n" + \
        "\n".join(wrong)


def test_the_stage_rule_can_fail():
    g = {"lmforge.stages.dpo": {"lmforge.stages.sft", "lmforge.stages.tuning"}, "lmforge.stages.tuning": set(),
         "lmforge.stages.speedrun": {"lmforge.stages.sft"}}
    assert stage_imports(g) == ["lmforge.stages.dpo -> lmforge.stages.sft"]
