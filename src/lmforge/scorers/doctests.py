"""Docstring examples as unit tests for SFT bodies (phi-1's task: Gunasekar et al. 2023,
arXiv 2306.11644, trained exactly this docstring -> body task and scored by execution).

Many standard-library docstrings carry `>>>` examples. For a held-out top-level function
whose reference body passes its own docstring's examples, the generated body is placed
under the signature, executed in a copy of the real module's namespace, and the same
examples are run against it with `doctest` in a subprocess with a timeout (a generated
body may loop forever or touch the process). Methods and functions whose examples fail
with the reference body are not scored.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

_RUNNER = r"""
import doctest, importlib, json, sys
spec = json.loads(sys.stdin.read())
mod = importlib.import_module(spec["module"])
ref = getattr(mod, spec["function"], None)
doc = getattr(ref, "__doc__", None) or ""
if ">>>" not in doc:
    print("NODOC"); sys.exit(3)
ns = dict(vars(mod))
exec(compile(spec["source"], "<sft-body>", "exec"), ns)
test = doctest.DocTestParser().get_doctest(doc, ns, spec["function"], None, 0)
runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
runner.run(test, out=lambda s: None)
print("PASS" if runner.failures == 0 and runner.tries > 0 else "FAIL"); sys.exit(0)
"""


def run_doctests(module: str, function: str, source: str, timeout: float = 5.0) -> str:
    """"PASS", "FAIL" (wrong, raised, timed out or did not compile) or "NODOC" (no examples)."""
    spec = json.dumps({"module": module, "function": function, "source": source})
    try:
        r = subprocess.run([sys.executable, "-c", _RUNNER], input=spec, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return "FAIL"
    out = r.stdout.strip().splitlines()
    return out[-1] if out and out[-1] in ("PASS", "FAIL", "NODOC") else "FAIL"


def doctest_pass_rate(items: Sequence[dict], bodies: Sequence[dict], timeout: float = 5.0) -> dict:
    """`items`: sft_val.jsonl records (name "module:qualname", signature, body); `bodies`: the
    matching `body_parse_rate` examples (body, stopped). Returns {"n": functions scored (top
    level, with examples their reference passes), "passed", "fraction", "names"}."""
    from lmforge.data.stdlib_functions import place_body

    scored, passed, names = 0, 0, []
    for r, b in zip(items, bodies):
        module, _, qualname = r["name"].partition(":")
        if not module or not qualname or "." in qualname or "signature" not in r:
            continue
        if run_doctests(module, qualname, place_body(r["signature"], r["body"]), timeout) != "PASS":
            continue  # no examples, or the reference itself fails them here
        scored += 1
        ok = b["stopped"] and run_doctests(module, qualname, place_body(r["signature"], b["body"]), timeout) == "PASS"
        passed += ok
        names.append({"name": r["name"], "passes": bool(ok)})
    return {"n": scored, "passed": passed, "fraction": passed / scored if scored else float("nan"), "names": names}


__all__ = ["doctest_pass_rate", "run_doctests"]
