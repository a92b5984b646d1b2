"""A generation task scored by running what the model wrote: `functions`.

The model writes the body of held-out standard-library functions (the SFT task: the user turn
is `STDLIB_PROMPT` + signature + docstring, rendered with the chat template), and each body is
run in `lmforge.sandbox`: against the real function's behaviour cases where
`scorers.behaviour` finds some (differential testing), else against the function's own
docstring examples when the real body passes them; a function neither can check is left out.
The functions are the top-level ones of the modules the checkpoint never read
(`evals.builtin.held_out_documents`) whose real body fits the token budget.

Figures (HumanEval's, Chen et al. 2021, arXiv 2107.03374): pass@1 of the greedy body (the
task's accuracy, with its 95% Wilson interval; the baseline is 0), and with `samples` n > 0,
n bodies per function at `temperature` (no top-k, top-p or repetition penalty) and the unbiased
pass@k for each k <= n (`evals.metrics.pass_at_k`), averaged over the functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmforge.config import SamplingConfig
from lmforge.data.prompts import Prompt
from lmforge.data.stdlib_functions import STDLIB_PROMPT, function_examples, place_body
from lmforge.errors import ConfigError
from lmforge.evals.builtin import held_out_documents
from lmforge.evals.metrics import pass_at_k, rate_interval
from lmforge.generate import generate
from lmforge.sandbox import Pool, check_errors
from lmforge.scorers.behaviour import Behaviour
from lmforge.scorers.doctests import doctest_job

GENERATION_TASKS = ("functions",)
#: New tokens a body may take (a function whose real body is longer is left out).
MAX_NEW_TOKENS = 160
BATCH = 16


def function_prompts(val_fraction: float, include_tests: bool, tok, limit: int = 0,
                     max_new_tokens: int = MAX_NEW_TOKENS) -> list[Prompt]:
    """The held-out top-level functions as prompts (with the fields the checks read), their real
    body at most `max_new_tokens` - 1 tokens, at most `limit` (0: all), in a stable order."""
    from lmforge.data.conversations import cap_examples

    out = []
    for doc in held_out_documents(val_fraction, include_tests):
        for ex in function_examples(doc.text, doc.key):
            if "." in ex.qualname or len(tok.encode(ex.body)) >= max_new_tokens:
                continue
            user = STDLIB_PROMPT + ex.signature + "\n" + ex.docstring
            out.append(Prompt([{"role": "user", "content": user}], f"{ex.module}:{ex.qualname}",
                              f"{ex.module}:{ex.qualname}", {"module": ex.module, "qualname": ex.qualname,
                                                              "signature": ex.signature, "reference": ex.body}))
    return cap_examples(out, limit * 4, lambda p: p.key) if limit else out


class Checker:
    """Which check each prompt gets ("behaviour", "doctests" or none), and the verdicts of bodies."""

    def __init__(self, pool: Pool, prompts: Sequence[Prompt]):
        self.pool = pool
        self.behaviour = Behaviour(pool)
        self.behaviour.prepare(prompts)
        self.kind: dict[str, str] = {}
        rest = []
        for p in prompts:
            if self.behaviour.cases.get(p.where):
                self.kind[p.where] = "behaviour"
            else:
                rest.append(p)
        for p, r in zip(rest, pool.map([self._doctest(p, p.fields["reference"]) for p in rest])):
            if r.verdict == "PASS":
                self.kind[p.where] = "doctests"

    @staticmethod
    def _doctest(p: Prompt, body: str) -> dict:
        f = p.fields
        return doctest_job(f["module"], f["qualname"], place_body(f["signature"], body))

    def passes(self, prompts: Sequence[Prompt], bodies: Sequence[str], stopped: Sequence[bool]) -> list[bool]:
        """Per body: it ended its turn and passes its prompt's check (in the sandbox)."""
        out = [False] * len(bodies)
        b_idx = [i for i, p in enumerate(prompts) if self.kind[p.where] == "behaviour"]
        d_idx = [i for i, p in enumerate(prompts) if self.kind[p.where] == "doctests" and stopped[i]]
        scores, results = self.behaviour.score([prompts[i] for i in b_idx], [bodies[i] for i in b_idx],
                                               [stopped[i] for i in b_idx])
        for i, v in zip(b_idx, scores):
            out[i] = v == 1.0
        found = self.pool.map([self._doctest(prompts[i], bodies[i]) for i in d_idx])
        for i, r in zip(d_idx, found):
            out[i] = r.verdict == "PASS"
        check_errors(list(results) + list(found), "eval functions")
        return out


def _bodies(model, tok, ids: Sequence[Sequence[int]], sampling: SamplingConfig, runtime, generator=None):
    stops = [tok.im_end_id, tok.eos_id]
    bodies, stopped = [], []
    for i in range(0, len(ids), BATCH):
        outs = generate(model, ids[i: i + BATCH], stops, sampling, tok.pad_id, truncate=True, generator=generator,
                        runtime=runtime)
        for x in outs:
            s = bool(x) and x[-1] in stops
            bodies.append(tok.decode(x[:-1] if s else x))
            stopped.append(s)
    return bodies, stopped


def functions_task(model, tok, prompts: Sequence[Prompt], samples: int = 0, temperature: float = 0.8,
                   ks: Sequence[int] = (1,), seed: int = 0, runtime=None,
                   max_new_tokens: int = MAX_NEW_TOKENS, limit: int = 0) -> dict:
    """The `functions` task's figures (module docstring): {"kind": "generation", "n", "accuracy"
    (greedy pass@1), "baseline" 0, "centred", "interval", "centred_interval", "checked_by",
    "samples", and with samples: "temperature", "pass@k" {k: value}, "sample_pass_rate",
    "sample_interval"}.

    Raises:
        ConfigError: a k above `samples` (or below 1); no held-out function can be checked.
    """
    if samples and any(not 1 <= k <= samples for k in ks):
        raise ConfigError(f"--k {','.join(map(str, ks))} with --samples {samples}: pass@k needs 1 <= k <= samples. "
                          f"Lower k or draw more samples.")
    from lmforge.data.conversations import cap_examples

    with Pool() as pool:
        checker = Checker(pool, prompts)
        kept = [p for p in prompts if p.where in checker.kind]
        kept = cap_examples(kept, limit, lambda p: p.key)
        if not kept:
            raise ConfigError("the functions task found no held-out function it can check (behaviour cases or "
                              "doctests that the real body passes).")
        ids = [tok.render_chat(p.messages, add_generation_prompt=True).ids for p in kept]
        greedy = SamplingConfig(max_new_tokens=max_new_tokens, greedy=True, repetition_penalty=1.0)
        bodies, stopped = _bodies(model, tok, ids, greedy, runtime)
        ok = checker.passes(kept, bodies, stopped)
        n = len(kept)
        lo, hi = rate_interval(sum(ok), n)
        res = {"kind": "generation", "n": n, "accuracy": sum(ok) / n, "baseline": 0.0, "centred": sum(ok) / n,
               "interval": [lo, hi], "centred_interval": [lo, hi], "too_long": 0,
               "about": "held-out function bodies, run in the sandbox (greedy pass@1)",
               "checked_by": {k: sum(checker.kind[p.where] == k for p in kept) for k in ("behaviour", "doctests")},
               "samples": samples}
        if samples:
            sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=0, top_p=1.0,
                                      repetition_penalty=1.0, greedy=False)
            generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
            rows = [x for x in ids for _ in range(samples)]
            s_bodies, s_stopped = _bodies(model, tok, rows, sampling, runtime, generator)
            s_ok = checker.passes([p for p in kept for _ in range(samples)], s_bodies, s_stopped)
            correct = [sum(s_ok[i * samples:(i + 1) * samples]) for i in range(n)]
            lo, hi = rate_interval(sum(correct), n * samples)
            res.update(temperature=temperature,
                       **{"pass@k": {str(k): sum(pass_at_k(samples, c, k) for c in correct) / n for k in ks}},
                       sample_pass_rate=sum(correct) / (n * samples), sample_interval=[lo, hi])
    return res


__all__ = ["GENERATION_TASKS", "MAX_NEW_TOKENS", "Checker", "function_prompts", "functions_task"]
