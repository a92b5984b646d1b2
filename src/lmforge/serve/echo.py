"""`/v1/completions` with `echo` and `logprobs`: the log-probabilities of a prompt's own tokens,
what evaluation harnesses send to score a continuation (lm-evaluation-harness's
`local-completions` sends `{"prompt": [[ids...]], "echo": true, "logprobs": 1, "max_tokens": 1,
"temperature": 0}` and reads `choices[i].logprobs.token_logprobs[ctxlen:-1]`).

Prompts: a string, an array of strings, an array of token ids, or an array of arrays of token
ids (OpenAI's four forms; a batch gives one choice per prompt, `index` in order). A string is a
document start + its text (as every completion prompt here); token ids are taken as they are.

The answer follows OpenAI's legacy completions format: per choice `text` (the prompt's tokens
as text, the document start's included, plus the greedy next token when `max_tokens` is 1), and `logprobs` = {"tokens" (each token's text),
"token_logprobs" (nats; null for the first token, which nothing predicts), "top_logprobs" (null,
then the `logprobs` most likely tokens at each position, {text: log-probability}), "text_offset"
(each token's character offset in `text`)}. Computed in fp32 by one forward pass per prompt,
without the generation queue: the numbers are `lmforge eval`'s (lmforge.evals.scoring).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from lmforge.serve.request import BadRequest, short, type_name

#: The most `logprobs` (alternatives per position) a request may ask for (OpenAI's limit).
MAX_LOGPROBS = 5
#: The most prompts one echo request may score.
MAX_PROMPTS = 64

_lock = threading.Lock()


def token_prompts(prompt: Any, tok, vocab_size: int, context: int, many: bool) -> list[tuple[list[int], str]]:
    """[(ids, text)] of a completions `prompt` in any of OpenAI's four forms (`many`: a batch is
    allowed; else exactly one prompt).

    Raises:
        BadRequest: another type, an empty prompt, an id outside the vocabulary, a prompt longer
        than the context, a batch where one prompt is expected, more than MAX_PROMPTS.
    """
    if isinstance(prompt, str):
        batch: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        batch = [prompt]  # one prompt of token ids
    elif isinstance(prompt, list) and prompt and (all(isinstance(x, str) for x in prompt)
                                                  or all(isinstance(x, list) for x in prompt)):
        batch = list(prompt)
    else:
        raise BadRequest(f"prompt = {short(prompt)} is {type_name(prompt)}: expected a string, an array of strings, "
                         f"an array of token ids or an array of arrays of token ids.", "prompt",
                         "invalid_type" if prompt is not None else "missing_required_parameter")
    if not many and len(batch) != 1:
        raise BadRequest(f"prompt holds {len(batch)} prompts: generation takes one prompt per request (scoring with "
                         f"\"echo\": true takes up to {MAX_PROMPTS}).", "prompt", "invalid_value")
    if len(batch) > MAX_PROMPTS:
        raise BadRequest(f"prompt holds {len(batch)} prompts: at most {MAX_PROMPTS} per request.", "prompt",
                         "invalid_value")
    out = []
    for i, p in enumerate(batch):
        where = f"prompt[{i}]" if len(batch) > 1 else "prompt"
        if isinstance(p, str):
            ids = tok.encode_prompt(p)
        else:
            bad = next((x for x in p if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < vocab_size),
                       None) if p else "empty"
            if bad is not None:
                raise BadRequest(f"{where} holds {short(bad)}: token ids are integers in [0, {vocab_size}) and a "
                                 f"prompt has at least one.", "prompt", "invalid_value")
            ids = list(p)
        if len(ids) > context:
            raise BadRequest(f"{where} is {len(ids)} tokens: the model's context is {context} tokens. Shorten it.",
                             "prompt", "context_length_exceeded")
        out.append((ids, p if isinstance(p, str) else tok.decode(ids)))
    return out


def echo_options(body: dict) -> tuple[int, int]:
    """(logprobs k, max_tokens) of an echo request.

    Raises:
        BadRequest: `logprobs` not an integer in [0, MAX_LOGPROBS]; `max_tokens` other than 0 or 1.
    """
    k = body.get("logprobs")
    k = 0 if k is None or k is False else k
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
        raise BadRequest(f"logprobs = {short(body.get('logprobs'))}: expected an integer in [0, {MAX_LOGPROBS}] "
                         f"(the most likely tokens to list at each position).", "logprobs", "invalid_value")
    n = body.get("max_tokens")
    n = 16 if n is None else n  # OpenAI's default, refused below: scoring asks for 0 or 1
    if isinstance(n, bool) or not isinstance(n, int) or n not in (0, 1):
        raise BadRequest(f"max_tokens = {short(n)} with \"echo\": true: this server scores a prompt and adds at most "
                         f"the greedy next token; send max_tokens 0 or 1.", "max_tokens", "invalid_value")
    return k, n


@torch.no_grad()
def prompt_logprobs(model, tok, ids: list[int], k: int, extra: int) -> dict:
    """One choice's `text` tail and `logprobs` object (module docstring) for prompt `ids`; with
    `extra` = 1 the greedy next token is appended."""
    x = torch.tensor([ids], device=model.output.weight.device)
    with _lock:
        logits = model(x).float()[0]  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    seq = list(ids)
    if extra:
        seq.append(int(logp[-1].argmax()))
    texts = [tok.decode([t]) for t in seq]
    token_lp: list[float | None] = [None]
    top: list[dict | None] = [None]
    for t in range(1, len(seq)):
        row = logp[t - 1]
        token_lp.append(float(row[seq[t]]))
        if k:
            vals, idx = row.topk(k)
            alts: dict[str, float] = {}
            for v, j in zip(vals.tolist(), idx.tolist()):  # two ids may read the same ("\ufffd"): keep the likelier
                alts.setdefault(tok.decode([j]), v)
            top.append(alts)
        else:
            top.append({})
    offsets, at = [], 0
    for s in texts:
        offsets.append(at)
        at += len(s)
    return {"tokens": texts, "token_logprobs": token_lp, "top_logprobs": top, "text_offset": offsets,
            "generated": texts[-1] if extra else ""}


def echo_response(body: dict, model, tok, model_id: str, rid: str) -> dict:
    """The whole answer to an echo request (run in a worker thread)."""
    k, extra = echo_options(body)
    prompts = token_prompts(body.get("prompt"), tok, model.config.vocab_size, model.config.max_seq_len, many=True)
    choices, n_prompt = [], 0
    for i, (ids, _) in enumerate(prompts):
        if extra and len(ids) >= model.config.max_seq_len:
            raise BadRequest(f"prompt[{i}] fills the model's context of {model.config.max_seq_len} tokens: no room for "
                             f"max_tokens 1; send max_tokens 0.", "max_tokens", "context_length_exceeded")
        lp = prompt_logprobs(model, tok, ids, k, extra)
        del lp["generated"]
        choices.append({"index": i, "text": "".join(lp["tokens"]), "logprobs": lp, "finish_reason": "length"})
        n_prompt += len(ids)
    usage = {"prompt_tokens": n_prompt, "completion_tokens": extra * len(prompts),
             "total_tokens": n_prompt + extra * len(prompts)}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_id,
            "choices": choices, "usage": usage}


__all__ = ["MAX_LOGPROBS", "MAX_PROMPTS", "echo_options", "echo_response", "prompt_logprobs", "token_prompts"]
