"""Docstring examples as unit tests for SFT bodies (phi-1's task: Gunasekar et al. 2023,
arXiv 2306.11644, trained exactly this docstring -> body task and scored by execution).

Many standard-library docstrings carry `>>>` examples. For a held-out top-level function
whose reference body passes its own docstring's examples, the generated body is placed
under the signature, executed in a copy of the real module's namespace, and the same
examples are run against it in `lmforge.sandbox` (a generated body may loop forever, touch
the process or print a forged verdict). Methods and functions whose examples fail
with the reference body are not scored.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmforge.sandbox import TIMEOUT_S, Pool, run_job


def run_doctests(module: str, function: str, source: str, timeout: float = TIMEOUT_S) -> str:
    """"PASS", "FAIL" (wrong, raised, did not compile, did something the sandbox refuses), "TIMEOUT",
    "OOM", "NODOC" (the reference's docstring has no examples) or "ERROR" (the sandbox's own
    fault): `source` (defining `function`) replaces the reference in `module` and runs the
    reference's docstring examples, in `lmforge.sandbox` (the verdict cannot be printed by the
    body: it travels on a private pipe)."""
    return run_job({"kind": "doctest", "module": module, "function": function, "source": source},
                   timeout=timeout).verdict


def doctest_pass_rate(items: Sequence[dict], bodies: Sequence[dict], timeout: float = TIMEOUT_S) -> dict:
    """`items`: sft_val.jsonl records (name "module:qualname", signature, body); `bodies`: the
    matching `body_parse_rate` examples (body, stopped). Returns {"n": functions scored (top
    level, with examples their reference passes), "passed", "fraction", "names", "errors":
    functions left out because the sandbox itself failed on them (never counted as a fail)}.
    Runs on a `sandbox.Pool` (pre-started interpreters, as many at once as there are cores)."""
    from lmforge.data.stdlib_functions import place_body

    def job(module: str, qualname: str, signature: str, body: str) -> dict:
        return {"kind": "doctest", "module": module, "function": qualname, "source": place_body(signature, body)}

    todo = []
    for r, b in zip(items, bodies):
        module, _, qualname = r["name"].partition(":")
        if module and qualname and "." not in qualname and "signature" in r:
            todo.append((r, b, module, qualname))
    with Pool(timeout=timeout) as pool:
        refs = pool.map([job(m, q, r["signature"], r["body"]) for r, _, m, q in todo])
        todo = [t for t, ref in zip(todo, refs) if ref.verdict == "PASS"]  # else no examples, or the reference fails here
        ran = [t for t in todo if t[1]["stopped"]]
        verdicts = dict(zip(map(id, ran), pool.map([job(m, q, r["signature"], b["body"]) for r, b, m, q in ran])))
    scored, passed, names, errors = 0, 0, [], 0
    for t in todo:
        r = t[0]
        verdict = verdicts[id(t)].verdict if id(t) in verdicts else "FAIL"  # cut off: not run
        if verdict == "ERROR":
            errors += 1
            continue
        scored += 1
        ok = verdict == "PASS"
        passed += ok
        names.append({"name": r["name"], "passes": bool(ok)})
    return {"n": scored, "passed": passed, "fraction": passed / scored if scored else float("nan"), "names": names,
            "errors": errors}


__all__ = ["doctest_pass_rate", "run_doctests"]
