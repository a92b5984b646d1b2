"""`/v1/completions` with `echo` and `logprobs` (lmforge.serve.echo), driven by the official
`openai` client: the prompt's log-probabilities in OpenAI's format, read the way
lm-evaluation-harness's `local-completions` reads them, equal `lmforge eval`'s
(lmforge.evals.scoring) within 1e-4; token-id prompts; every bad request a 400 naming its field."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from lmforge.evals.scoring import encode_pair, loglikelihoods  # noqa: E402
from test_serve import ckpt, client, loaded, served  # noqa: E402,F401  (the same tiny server)

PAIRS = [("def value(self):\n    return ", "self"), ("import ", "os"), ("x = 1\ny =", " x + 1")]


def lm_eval_reads(choice, ctxlen: int) -> tuple[float, bool]:
    """What lm-eval's LocalCompletionsAPI.parse_logprobs takes from a choice."""
    lps = choice.logprobs.token_logprobs[ctxlen:-1]
    tops = choice.logprobs.top_logprobs[ctxlen:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))


def test_echo_of_token_prompts_is_what_lmforge_eval_scores(client, loaded):
    model, tok = loaded
    encoded = [encode_pair(tok, c, x) for c, x in PAIRS]
    r = client.completions.create(model="tiny", prompt=[ids for ids, _ in encoded], echo=True, logprobs=1,
                                  max_tokens=1, temperature=0, seed=1234)
    want = loglikelihoods(model, tok, PAIRS)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice, (ids, split), w in zip(sorted(r.choices, key=lambda c: c.index), encoded, want):
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        total, greedy = lm_eval_reads(choice, split)
        assert total == pytest.approx(w.logprob, abs=1e-4) and greedy == w.greedy
        assert all(len(t) == 1 for t in lp.top_logprobs[1:])
        assert lp.text_offset[0] == 0 and choice.text == "".join(lp.tokens)
    assert r.usage.prompt_tokens == sum(len(ids) for ids, _ in encoded) and r.usage.completion_tokens == 3


def test_echo_of_a_text_prompt_with_no_new_token(client, loaded):
    model, tok = loaded
    r = client.completions.create(model="tiny", prompt="def value(self):", echo=True, logprobs=3, max_tokens=0)
    lp = r.choices[0].logprobs
    ids = tok.encode_prompt("def value(self):")
    assert len(lp.tokens) == len(ids) and all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])  # ids may read alike
    assert all(lp.token_logprobs[i] <= max(lp.top_logprobs[i].values()) + 1e-6 for i in range(1, len(ids)))
    assert r.usage.completion_tokens == 0


def test_a_token_id_prompt_generates_what_its_text_generates(client, loaded):
    _, tok = loaded
    text = client.completions.create(model="tiny", prompt="def ", max_tokens=8, temperature=0).choices[0].text
    ids = tok.encode_prompt("def ")
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0).choices[0].text == text
    assert client.completions.create(model="tiny", prompt=[ids], max_tokens=8, temperature=0).choices[0].text == text


@pytest.mark.parametrize("kw, param", [
    (dict(prompt="x", echo=True, logprobs=6, max_tokens=1), "logprobs"),
    (dict(prompt="x", echo=True, logprobs=1, max_tokens=5), "max_tokens"),
    (dict(prompt=[1, 10 ** 6], echo=True, max_tokens=0), "prompt"),
    (dict(prompt=[[]], echo=True, max_tokens=0), "prompt"),
    (dict(prompt="x", logprobs=1, max_tokens=4), "logprobs"),
    (dict(prompt="x", echo=True, max_tokens=0, stream=True), "stream"),
    (dict(prompt=["a", "b"], max_tokens=4), "prompt"),
])
def test_bad_echo_requests_get_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", **kw)
    err = info.value.response.json()["error"]
    assert err["param"] == param and err["message"]
