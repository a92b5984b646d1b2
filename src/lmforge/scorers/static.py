"""A generated function body judged without running it (the reward ladder's V1: cheap, in
process, for every function): it parses under its signature as that one function and nothing
else, ends its turn, is not trivial and every name it loads resolves.

Only the function: text after its body (a statement at module level, another definition, a
decorator, a class) would run when the module is executed, before and outside the function the
check judged; it is refused here ("text after the function") and never run by the sandbox.

Trivial (reward hacking's first moves, allenai/open-instruct PR #659): only `pass`, `...`,
`raise NotImplementedError`, a docstring, or returns of constants only (`return None`,
`return 0`, a table of the docstring's example outputs keyed on constant comparisons); a body
that reads none of its parameters. A loaded name resolves when it is a parameter, a name the
function binds anywhere (assignments, loops, imports, nested definitions, comprehensions,
`except ... as`), a top-level name of the function's module (read with `ast` from the module's
source, never imported), or a builtin.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.machinery
import os
import sysconfig
from dataclasses import dataclass

from lmforge.data.stdlib_functions import place_body

_BUILTINS = frozenset(dir(builtins)) | {"__name__", "__file__", "__doc__", "__class__", "__debug__"}


@dataclass(frozen=True)
class StaticVerdict:
    """`ok`: the body passes every check; `reason`: the first check it failed ("" when ok):
    "cut off" (no end of turn), "does not parse", "text after the function", "trivial", "reads
    no parameter", "unresolved name NAME"."""

    ok: bool
    reason: str = ""

    @property
    def trivial(self) -> bool:
        """A stub: only pass / ... / raise NotImplementedError / a docstring, or constants only."""
        return self.reason == "trivial"


#: `module_names` of a module whose names cannot all be read (a star import from a C module).
ANY = frozenset({"*"})


def _find_spec(module: str):
    """`module`'s spec found on sys.path by the path finder alone, package by package, never
    importing anything: `importlib.util.find_spec("a.b")` imports the package `a` (its
    `__init__` would run in lmforge's process, and a prompt file names the module)."""
    spec, path = None, None
    parts = module.split(".")
    for i in range(len(parts)):
        if i and path is None:  # not a package: it has no submodules
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), path)
        if spec is None:
            return None
        path = spec.submodule_search_locations
    return spec


@functools.lru_cache(maxsize=4096)
def module_names(module: str) -> frozenset[str]:
    """The top-level names the module `module` binds, read from its source with `ast` (never
    imported), star imports followed; empty when its source cannot be found; ANY when a star
    import's names cannot be read (then every name resolves)."""
    try:
        spec = _find_spec(module)
    except (ImportError, ValueError):
        return frozenset()
    origin = getattr(spec, "origin", None) if spec else None
    if not origin or not origin.endswith(".py"):  # a frozen module (os, posixpath, codecs, ...): its source file
        base = os.path.join(sysconfig.get_paths()["stdlib"], *module.split("."))
        origin = next((p for p in (base + ".py", os.path.join(base, "__init__.py")) if os.path.isfile(p)), None)
        if origin is None:
            return frozenset()
    try:
        with open(origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return frozenset()
    names: set[str] = set()
    for node in tree.body:
        names |= _bound(node, top=True)
        for n in ast.walk(node):
            if isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names):
                star = module_names(n.module or "") if not n.level else frozenset()
                if not star:
                    return ANY  # `from _codecs import *`: names that cannot be read
                names |= star
    return frozenset(names)


def _bound(node: ast.AST, top: bool = False) -> set[str]:
    """Names `node` binds (at any depth, or only its own statement level when `top`)."""
    found: set[str] = set()
    for n in ([node] if top else ast.walk(node)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            found |= {(a.asname or a.name).split(".")[0] for a in n.names if a.name != "*"}
        elif isinstance(n, ast.ExceptHandler) and n.name:
            found.add(n.name)
        elif isinstance(n, ast.arg):
            found.add(n.arg)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            found |= set(n.names)
        elif isinstance(n, ast.MatchAs) and n.name or isinstance(n, ast.MatchStar) and n.name:
            found.add(n.name)
    if top:
        for n in ast.walk(node) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With,
                                                      ast.If, ast.Try)) else ():
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                found.add(n.id)
            if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
                found |= _bound(n, top=True)
    else:
        found |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return found


def _constant(node: ast.AST | None) -> bool:
    if node is None:
        return True
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_constant(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _constant(k) for k in node.keys) and all(_constant(v) for v in node.values)
    if isinstance(node, ast.UnaryOp):
        return _constant(node.operand)
    return False


def _table_test(node: ast.AST, params: set[str]) -> bool:
    """`param == constant` (or `in`, `is`, their negations, joined by and/or): an example's input."""
    if isinstance(node, ast.BoolOp):
        return all(_table_test(v, params) for v in node.values)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        sides = (node.left, node.comparators[0])
        return any(isinstance(s, ast.Name) and s.id in params for s in sides) and any(_constant(s) for s in sides)
    return False


def _trivial(fn: ast.FunctionDef, params: set[str]) -> bool:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # a docstring
    stubs = [s for s in body if not (isinstance(s, ast.Pass) or isinstance(s, ast.Expr) and _constant(s.value))]
    if not stubs:
        return True
    if all(isinstance(s, ast.Raise) and (s.exc is None or "NotImplementedError" in ast.dump(s.exc)) for s in stubs):
        return True
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
    tests = [n.test for n in ast.walk(fn) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    calls_or_loops = any(isinstance(n, (ast.Call, ast.For, ast.While, ast.comprehension, ast.BinOp, ast.Subscript,
                                        ast.Attribute, ast.Yield, ast.YieldFrom)) for n in ast.walk(fn))
    if returns and all(_constant(r.value) for r in returns) and all(_table_test(t, params) for t in tests) \
            and not calls_or_loops:
        return True  # constants only: a stub, or a table of the examples' outputs
    return False


def parse_body(signature: str, body: str) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef | None, str]:
    """The function `body` placed under `signature` defines and ""; or None and why not: "does
    not parse" (the text, or a signature that defines no function), "text after the function"
    (anything else at module level: a statement, another definition, a decorator, a class).
    Raises nothing."""
    try:
        tree = ast.parse(place_body(signature, body))
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None, "does not parse"
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not defs:
        return None, "does not parse"
    if len(tree.body) != 1:
        return None, "text after the function"
    return defs[0], ""


def static_verdict(signature: str, body: str, stopped: bool = True, module: str = "") -> StaticVerdict:
    """Judge `body` (the generated text under `signature`, without the end-of-turn token) for the
    function of `module` (its top-level names resolve; "" = builtins only). `stopped`: the model
    ended its turn (a body cut off by the token budget scores nothing)."""
    if not stopped:
        return StaticVerdict(False, "cut off")
    fn, why = parse_body(signature, body)
    if fn is None:
        return StaticVerdict(False, why)
    a = fn.args
    params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None}
    if _trivial(fn, params):
        return StaticVerdict(False, "trivial")
    loaded = [n.id for stmt in fn.body for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    if params and not params & set(loaded):
        return StaticVerdict(False, "reads no parameter")
    top = module_names(module)
    if top == ANY:
        return StaticVerdict(True)
    known = params | _BUILTINS | top | {n for stmt in fn.body for n in _bound(stmt)} | {fn.name}
    for stmt in fn.body:
        for n in ast.walk(stmt):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                known |= _bound(n)
    missing = next((name for name in loaded if name not in known), None)
    if missing is not None:
        return StaticVerdict(False, f"unresolved name {missing}")
    return StaticVerdict(True)


def static_reward(signature: str, body: str, stopped: bool = True, module: str = "") -> float:
    """1.0 when `static_verdict` passes, else 0.0."""
    return 1.0 if static_verdict(signature, body, stopped, module).ok else 0.0


__all__ = ["StaticVerdict", "module_names", "parse_body", "static_reward", "static_verdict"]
