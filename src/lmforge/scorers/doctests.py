"""Docstring examples as unit tests for SFT bodies (phi-1's task: Gunasekar et al. 2023,
arXiv 2306.11644, trained exactly this docstring -> body task and scored by execution).

Many standard-library docstrings carry `>>>` examples. For a held-out top-level function
whose reference body passes its own docstring's examples, the generated body is placed
under the signature, executed in a copy of the real module's namespace, and the same
examples are run against it in `lmforge.sandbox` (a generated body may loop forever, touch
the process or try to forge its verdict): the sandbox reports each example's output and
lmforge compares it with the docstring's, in its own process. Methods and functions whose
examples fail with the reference body are not scored.

The examples are the function's published ones: a body can read them (the standard library's
sources are readable) and answer from a table; the behaviour reward's unseen inputs cannot be
read that way.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmforge.sandbox import TIMEOUT_S, Pool, run_job


def doctest_job(module: str, function: str, source: str) -> dict:
    """The sandbox job that runs `module.function`'s docstring examples against `source` (exactly
    one definition of `function`, which replaces the reference in `module`; anything after it is
    a FAIL): for `run_job` or a `Pool`, which check it (TypeError / ValueError) before running."""
    return {"kind": "doctest", "module": module, "function": function, "source": source}


def run_doctests(module: str, function: str, source: str, timeout: float = TIMEOUT_S) -> str:
    """"PASS", "FAIL" (wrong, raised, did not compile, text after the function, did something the
    sandbox refuses), "TIMEOUT", "OOM", "NODOC" (the reference's docstring has no examples) or
    "ERROR" (the sandbox's own fault): `source` (defining `function`) replaces the reference in
    `module` and runs the reference's docstring examples in `lmforge.sandbox`, which reports
    their outputs; the verdict is decided here, out of the body's reach.

    Raises:
        TypeError, ValueError: names that are not str / identifiers, a timeout outside (0, 3600].
    """
    return run_job(doctest_job(module, function, source), timeout=timeout).verdict


def doctest_pass_rate(items: Sequence[dict], bodies: Sequence[dict], timeout: float = TIMEOUT_S) -> dict:
    """`items`: sft_val.jsonl records (name "module:qualname", signature, body); `bodies`: the
    matching `body_parse_rate` examples (body, stopped). Returns {"n": functions scored (top
    level, with examples their reference passes), "passed", "fraction", "names", "errors":
    functions left out because the sandbox itself failed on them (never counted as a fail)}.
    Runs on a `sandbox.Pool` (pre-started interpreters, as many at once as there are cores)."""
    from lmforge.data.stdlib_functions import place_body

    todo = []
    for r, b in zip(items, bodies):
        module, _, qualname = r["name"].partition(":")
        if module and qualname and "." not in qualname and "signature" in r:
            todo.append((r, b, module, qualname))
    with Pool(timeout=timeout) as pool:
        refs = pool.map([doctest_job(m, q, place_body(r["signature"], r["body"])) for r, _, m, q in todo])
        todo = [t for t, ref in zip(todo, refs) if ref.verdict == "PASS"]  # else no examples, or the reference fails here
        ran = iter(pool.map([doctest_job(m, q, place_body(r["signature"], b["body"]))
                             for r, b, m, q in todo if b["stopped"]]))
        verdicts = [next(ran).verdict if b["stopped"] else "FAIL" for _, b, _, _ in todo]  # cut off: not run
    scored, passed, names, errors = 0, 0, [], 0
    for (r, _, _, _), verdict in zip(todo, verdicts):
        if verdict == "ERROR":
            errors += 1
            continue
        scored += 1
        ok = verdict == "PASS"
        passed += ok
        names.append({"name": r["name"], "passes": bool(ok)})
    return {"n": scored, "passed": passed, "fraction": passed / scored if scored else float("nan"), "names": names,
            "errors": errors}


__all__ = ["doctest_job", "doctest_pass_rate", "run_doctests"]
