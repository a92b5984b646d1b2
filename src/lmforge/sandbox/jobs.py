"""What a sandbox job is and what it comes to, decided in lmforge's own process: the limits a job
runs under (`check_limits`), its validation into what the child receives and what lmforge keeps
(`plan_job`: the child never gets an expected result), the judge that reads the child's report
line by line (`Judge`), and the verdict (`Result`: one of VERDICTS, or NODOC). No process starts
here: `runner.py` runs the child (`child.py`) and feeds its report to the judge.
"""

from __future__ import annotations

import ast
import keyword
import math
import unicodedata
from dataclasses import dataclass

from lmforge.errors import LmforgeError

VERDICTS = ("PASS", "FAIL", "TIMEOUT", "OOM", "ERROR")
#: Default limits of one job, and the ranges `run_job` and `Pool` accept.
TIMEOUT_S = 5.0
MAX_TIMEOUT_S = 3600.0
MEMORY_BYTES = 1 << 30
MIN_MEMORY_BYTES = 64 << 20  # the interpreter and the harness alone map ~20 MiB
FILE_BYTES = 1 << 20
#: The longest candidate source and expected text a job may carry (characters).
SOURCE_CHARS = 1 << 20
JOB_KINDS = ("doctest", "cases", "probe")
_FIELDS = {"doctest": ("kind", "module", "function", "source", "doc"),
           "cases": ("kind", "module", "function", "source", "cases"),
           "probe": ("kind", "module", "probes", "call_s")}


def _is_name(text: str) -> bool:
    """A name Python's code can define and look up as it is: an identifier (`str.isidentifier`:
    `fé` too), not a keyword, and already in the NFKC form the compiler turns names into (a `ﬁ`
    would define `fi`)."""
    return text.isidentifier() and not keyword.iskeyword(text) and unicodedata.normalize("NFKC", text) == text


def _is_module(text: str) -> bool:
    return all(_is_name(part) for part in text.split("."))


class SandboxError(LmforgeError):
    """The sandbox itself failed too often to trust the scores, or the isolation asked for is
    not available here."""


@dataclass(frozen=True)
class Result:
    """One job's verdict (one of VERDICTS, or NODOC), a one-line reason, the wall-clock seconds,
    and what a "probe" job found (`run_job`)."""

    verdict: str
    detail: str
    seconds: float
    data: object = None


# -- what a job is --------------------------------------------------------------------------------
def check_limits(timeout: object, memory_bytes: object) -> None:
    """Refuse limits a job cannot run under.

    Raises:
        TypeError: `timeout` is not a number, or `memory_bytes` not an int (bools refused).
        ValueError: `timeout` outside (0, MAX_TIMEOUT_S] (nan and inf included), `memory_bytes`
            below MIN_MEMORY_BYTES; each message names the value and the range.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout={timeout!r}: expected seconds as a number in (0, {MAX_TIMEOUT_S:g}]")
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout={timeout!r}: expected seconds in (0, {MAX_TIMEOUT_S:g}]")
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int):
        raise TypeError(f"memory_bytes={memory_bytes!r}: expected an int of bytes >= {MIN_MEMORY_BYTES} (64 MiB)")
    if not MIN_MEMORY_BYTES <= memory_bytes < 1 << 63:
        raise ValueError(f"memory_bytes={memory_bytes!r}: expected bytes in [{MIN_MEMORY_BYTES} (64 MiB), 2**63) "
                         f"(the interpreter and the harness alone map ~20 MiB; a job needs room besides)")


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} = {_short(value)}: expected a str")
    if len(value) > SOURCE_CHARS:
        raise ValueError(f"{where} has {len(value)} characters: at most {SOURCE_CHARS}")
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _args(value: object, where: str) -> str:
    text = _text(value, where)
    try:
        parsed = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        parsed = None
    if not isinstance(parsed, tuple):
        raise ValueError(f"{where} = {_short(text)}: expected the text of a tuple literal of arguments, "
                         f"e.g. \"(1, 'a')\"")
    return text


@dataclass
class Plan:
    """A validated job: what the child receives (`child`: never an expected result) and what
    lmforge keeps to judge its report (`expected`)."""

    kind: str
    child: dict
    expected: list | None  # cases: [(want, args_after | None)]; doctest: [(want, exc_msg)] or None (read at ready)
    names: tuple = ()  # probe: the functions probed


def plan_job(job: object) -> Plan:
    """Validate `job` (the shape `run_job` documents) and split it into what the child runs and
    what lmforge keeps.

    Raises:
        TypeError: `job` is not a dict, or a field has the wrong type (the field named).
        ValueError: an unknown kind or field, a name that is not an identifier, no case, a case
            that is not [args, want] or [args, want, args_after], args that are not a tuple
            literal, a call_s outside (0, 60] (the field and the value named).
    """
    if not isinstance(job, dict):
        raise TypeError(f"job = {_short(job)}: expected a dict with a 'kind' of {JOB_KINDS}")
    kind = job.get("kind")
    if kind not in JOB_KINDS:
        raise ValueError(f"job['kind'] = {_short(kind)}: expected one of {JOB_KINDS}")
    extra = sorted(str(k) for k in job if k not in _FIELDS[kind])
    if extra:
        raise ValueError(f"job has the unknown field(s) {extra}: a {kind!r} job takes {list(_FIELDS[kind])}")
    module = _text(job.get("module", ""), "job['module']")
    if module and not _is_module(module):
        raise ValueError(f"job['module'] = {module!r}: expected a dotted module name, or '' for none")
    child: dict = {"kind": kind, "module": module}
    if kind == "probe":
        return _plan_probe(job, child)
    function = job.get("function")
    if not isinstance(function, str):
        raise TypeError(f"job['function'] = {_short(function)}: expected the function's name (a str)")
    if not _is_name(function):
        raise ValueError(f"job['function'] = {function!r}: expected an identifier (not a keyword)")
    child.update(function=function, source=_text(job.get("source"), "job['source']"))
    if kind == "cases":
        return _plan_cases(job, child)
    doc = job.get("doc")
    if doc is None:  # the reference's docstring, which the child reads before the candidate exists
        child["examples"] = None
        return Plan(kind, child, None)
    examples = _examples(_text(doc, "job['doc']"))
    child["examples"] = [ex.source for ex in examples]
    return Plan(kind, child, [(ex.want, ex.exc_msg) for ex in examples])


def _plan_probe(job: dict, child: dict) -> Plan:
    """`plan_job` for a "probe" job (`child`: its kind and module so far): the probes and call_s checked."""
    probes = job.get("probes")
    if not isinstance(probes, dict):
        raise TypeError(f"job['probes'] = {_short(probes)}: expected a dict {{function name: [args, ...]}}")
    for name, inputs in probes.items():
        if not isinstance(name, str) or not _is_name(name):
            raise ValueError(f"job['probes'] has the key {_short(name)}: expected a function's name")
        if not isinstance(inputs, (list, tuple)):
            raise TypeError(f"job['probes'][{name!r}] = {_short(inputs)}: expected a list of argument tuples' text")
        for i, a in enumerate(inputs):
            _args(a, f"job['probes'][{name!r}][{i}]")
    call_s = job.get("call_s", 0.25)
    if isinstance(call_s, bool) or not isinstance(call_s, (int, float)) or not (math.isfinite(call_s)
                                                                                 and 0 < call_s <= 60):
        raise ValueError(f"job['call_s'] = {_short(call_s)}: expected seconds in (0, 60]")
    child.update(probes={n: list(v) for n, v in probes.items()}, call_s=float(call_s))
    return Plan(child["kind"], child, None, tuple(probes))


def _plan_cases(job: dict, child: dict) -> Plan:
    """`plan_job` for a "cases" job (`child`: its kind, module, function and source so far): the
    arguments go to the child, the expected texts (want, args_after or None) stay."""
    cases = job.get("cases")
    if not isinstance(cases, (list, tuple)):
        raise TypeError(f"job['cases'] = {_short(cases)}: expected a list of [args, want] or [args, want, "
                        f"args_after]")
    if not cases:
        raise ValueError("job['cases'] is empty: expected at least one case (none would pass anything)")
    args, expected = [], []
    for i, case in enumerate(cases):
        if not isinstance(case, (list, tuple)) or len(case) not in (2, 3):
            raise ValueError(f"job['cases'][{i}] = {_short(case)}: expected [args, want] or [args, want, "
                             f"args_after] (texts)")
        args.append(_args(case[0], f"job['cases'][{i}][0]"))
        expected.append((_text(case[1], f"job['cases'][{i}][1]"),
                         _text(case[2], f"job['cases'][{i}][2]") if len(case) == 3 else None))
    child["args"] = args
    return Plan(child["kind"], child, expected)


def _examples(doc: str) -> list:
    import doctest

    try:
        return doctest.DocTestParser().get_examples(doc)
    except ValueError:
        return []


# -- judging what the child reports (in lmforge's process) ------------------------------------------
class Judge:
    """lmforge's side of one job: fed the child's report line by line, it says the verdict
    (verdict, detail, data) as soon as the report decides it, else None."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.expected = plan.expected
        self.ready = False
        self.seen = 0
        self.kept: dict[str, list] = {n: [] for n in plan.names}

    @property
    def progress(self) -> str:
        n = len(self.expected) if self.expected is not None else "?"
        return f"after {self.seen} of {n} {'cases' if self.plan.kind == 'cases' else 'examples'}"

    def feed(self, msg: list) -> tuple | None:
        tag = msg[1] if len(msg) > 1 else None
        if not self.ready:  # written before any candidate code existed: trusted
            if tag == "error" and len(msg) == 3:
                return "ERROR", msg[2], None
            if tag != "ready" or len(msg) != 3:
                return "ERROR", f"the harness sent {_short(msg[1:])} before it was ready", None
            self.ready = True
            if self.plan.kind == "doctest":
                if self.expected is None:
                    self.expected = [(ex.want, ex.exc_msg) for ex in _examples(msg[2])]
                if not self.expected:
                    return "NODOC", f"{self.plan.child['function']} has no >>> examples", None
            return None
        # from here on, the candidate may have written any of it
        if tag == "done" and len(msg) == 2:
            if self.plan.kind == "probe":
                return "PASS", f"{sum(map(len, self.kept.values()))} cases kept", self.kept
            if self.seen != len(self.expected):
                return "FAIL", f"the report ended {self.progress}", None
            return "PASS", f"{self.seen} {'cases' if self.plan.kind == 'cases' else 'examples'}", None
        if tag == "compile" and len(msg) == 3:
            return "FAIL", f"did not compile: {msg[2][:160]}", None
        if tag == "kept" and self.plan.kind == "probe" and len(msg) == 6 and msg[2] in self.kept:
            self.kept[msg[2]].append(msg[3:])
            return None
        if tag == "obs" and self.plan.kind != "probe" and self.seen < len(self.expected):
            self.seen += 1
            return self._cases(msg[2:]) if self.plan.kind == "cases" else self._example(msg[2:])
        return "FAIL", f"a malformed report {self.progress}", None

    def _cases(self, obs: list) -> tuple | None:
        i = self.seen
        want, after = self.expected[i - 1]
        if obs == ["oom"]:
            return "OOM", f"case {i}: MemoryError", None
        if obs[:1] == ["value"] and len(obs) == 3:
            got = obs[1] if after is None or obs[2] == after else f"{obs[1]} (arguments left as {obs[2]})"
        elif obs[:1] == ["raise"] and len(obs) == 2:
            got = "raise " + obs[1]
        else:
            return "FAIL", f"case {i}: a malformed observation", None
        if got != want:
            return "FAIL", f"case {i}: got {got[:80]}, expected {want[:80]}", None
        return None

    def _example(self, obs: list) -> tuple | None:
        import doctest

        i = self.seen
        want, exc_msg = self.expected[i - 1]
        if obs == ["oom"]:
            return "OOM", f"example {i}: MemoryError", None
        if len(obs) != 2 or obs[0] not in ("out", "raise"):
            return "FAIL", f"example {i}: a malformed observation", None
        check, flags = doctest.OutputChecker(), doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        if obs[0] == "out":
            if exc_msg is not None or not check.check_output(want, obs[1], flags):
                return "FAIL", f"example {i}: wrong output", None
        elif exc_msg is None or not check.check_output(exc_msg, obs[1], flags):
            return "FAIL", f"example {i}: raised {obs[1].split(':')[0].strip()[:60]}", None
        return None


__all__ = ["FILE_BYTES", "JOB_KINDS", "MAX_TIMEOUT_S", "MEMORY_BYTES", "MIN_MEMORY_BYTES", "Result", "SOURCE_CHARS",
           "SandboxError", "TIMEOUT_S", "VERDICTS", "check_limits", "plan_job"]
