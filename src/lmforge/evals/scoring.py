"""Log-likelihoods of continuations under a model, at lm-evaluation-harness's token boundaries.

A request is (context, continuation). As the harness does (`lm_eval/api/model.py`,
`TemplateLM._encode_pair`), whitespace at the end of the context moves to the start of the
continuation (" Paris" is one token in a byte-level BPE, "Paris" after " " is not); then the
context and continuation are encoded *together*, and the continuation's tokens are those of the
joint encoding from the first token that holds a character of the continuation on (so the sum is
over what the model would really see, lm-eval #942). The input starts with the tokenizer's
document start (its BOS), or EOS for a model without one (the harness's prefix token), and is
cut from the left to the model's `max_seq_len`.

Returns per request the summed log-probability of the continuation's tokens (nats), their count,
and whether every one of them is the greedy argmax. fp32, no autocast: the same checkpoint gives
the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmforge.errors import DataError

#: Logit elements a batch may hold at once (B x T x vocab, fp32: 1 GiB).
MAX_LOGITS = 1 << 28


@dataclass(frozen=True)
class LogLikelihood:
    """`logprob`: the continuation's summed log-probability (nats); `tokens`: its token count;
    `greedy`: every continuation token was the argmax."""

    logprob: float
    tokens: int
    greedy: bool

    @property
    def mean_loss(self) -> float:
        """Nats per continuation token."""
        return -self.logprob / self.tokens


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], int]:
    """(input ids, index of the first continuation token) for one request (module docstring).

    Raises:
        DataError: an empty continuation.
    """
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[: len(context) - spaces], context[len(context) - spaces:] + continuation
    if not continuation:
        raise DataError("an empty continuation has no token to score: give each item a non-empty continuation.")
    enc = tok.hf.encode(context + continuation, add_special_tokens=False)
    split = next((i for i, (_, end) in enumerate(enc.offsets) if end > len(context)), len(enc.ids))
    start = list(tok.contract.document_start) or [tok.eos_id]
    return start + list(enc.ids), len(start) + split


def continuation_tokens(tok, context: str, continuation: str) -> int:
    """How many tokens of a request are scored (its continuation's, at the joint encoding)."""
    ids, split = encode_pair(tok, context, continuation)
    return len(ids) - split


def loglikelihoods(model: torch.nn.Module, tok, requests: Sequence[tuple[str, str]], batch_size: int = 16,
                   device: str | torch.device = "cpu") -> list[LogLikelihood]:
    """One `LogLikelihood` per (context, continuation) request, in order (module docstring).

    Raises:
        DataError: an empty continuation, or one longer than the model's max_seq_len.
    """
    return score_tokens(model, [encode_pair(tok, c, x) for c, x in requests], tok.pad_id, batch_size, device)


@torch.no_grad()
def score_tokens(model: torch.nn.Module, sequences: Sequence[tuple[Sequence[int], int]], pad_id: int,
                 batch_size: int = 16, device: str | torch.device = "cpu") -> list[LogLikelihood]:
    """The log-likelihood of each sequence's tokens from index `split` on, given those before
    (`sequences`: (ids, split) pairs, split >= 1), in order; a sequence longer than the model's
    max_seq_len is cut from the left (the scored tokens kept). Batched by length, right-padded
    with `pad_id`, fp32 log-softmax. Also lmforge's lm-evaluation-harness adapter's core
    (`evals.harness`).

    Raises:
        DataError: a sequence with no token to score, or whose scored part is max_seq_len tokens or more.
    """
    max_len = model.config.max_seq_len
    encoded = []
    for i, (ids, split) in enumerate(sequences):
        ids = list(ids)
        if split >= len(ids) or split < 1:
            raise DataError(f"request {i}: no continuation token to score ({len(ids)} tokens, the continuation from "
                            f"{split}): its text merged into the context's last token (lm-evaluation-harness #942: "
                            f"its encoding of a pair can do this; `lmforge eval` scores the joint encoding and cannot).")
        if len(ids) - split >= max_len:
            raise DataError(f"request {i}: its continuation is {len(ids) - split} tokens, more than the model's "
                            f"max_seq_len {max_len} allows with any context. Shorten it.")
        cut = max(0, len(ids) - max_len)
        encoded.append((ids[cut:], split - cut))
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))
    out: list[LogLikelihood | None] = [None] * len(encoded)
    vocab = model.config.vocab_size
    was_training = model.training
    model.eval()
    try:
        pos = 0
        while pos < len(order):
            longest = len(encoded[order[pos]][0])
            n = max(1, min(batch_size, MAX_LOGITS // max(1, longest * vocab)))
            chunk = order[pos: pos + n]
            pos += n
            tokens = torch.full((len(chunk), longest), pad_id, dtype=torch.long)
            for row, i in enumerate(chunk):
                ids = encoded[i][0]
                tokens[row, : len(ids)] = torch.tensor(ids)
            logp = torch.log_softmax(model(tokens.to(device)).float(), dim=-1)
            for row, i in enumerate(chunk):
                ids, split = encoded[i]
                target = tokens[row, split: len(ids)].to(logp.device)
                lp = logp[row, split - 1: len(ids) - 1]  # position t predicts token t + 1
                got = lp.gather(-1, target[:, None])[:, 0]
                greedy = bool((lp.argmax(-1) == target).all())
                out[i] = LogLikelihood(float(got.double().sum()), int(target.numel()), greedy)
    finally:
        model.train(was_training)
    return out  # type: ignore[return-value]


__all__ = ["LogLikelihood", "MAX_LOGITS", "continuation_tokens", "encode_pair", "loglikelihoods", "score_tokens"]
