"""KV-cache generation and sampling.

Prompts are left-padded into one batch with an explicit key mask (P5) and per-row
positions (0 at each prompt's first real token); the prompt is run once (prefill),
then one token per step (T = 1 decode, P7) against the cache. Sampling: temperature,
top-k, top-p (nucleus; Holtzman et al. 2020), repetition penalty (CTRL; Keskar et al.
2019), or greedy. A sequence stops at any of `stop_ids` (from the contract: <|eos|>,
and <|im_end|> in chat) or after `max_new_tokens`.

Decode steps go through `Transformer.decode_step` (`lmforge.model.decode`: fused weights, the
same path `lmforge serve` batches requests on), under the `Runtime` the command decided. The decode loop stays on tensors: new ids go into a preallocated (B, max_new_tokens)
buffer, the repetition penalty keeps a (B, V) "seen" mask updated in place, and the host
synchronises per step only for the finite-logits check, the all-rows-stopped check and the count
of stopped rows (which leave the batch, `COMPACT_STOPPED`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from lmforge.config import SamplingConfig
from lmforge.errors import LmforgeError
from lmforge.model import Transformer
from lmforge.model.decode import DecodeWeights, compiled_decode_step
from lmforge.runtime import Runtime, compiler_available, compute_dtype, decode_runtime


_SAID: set[str] = set()


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        print(f"note: {line}", file=sys.stderr)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty: logits of seen tokens are divided by `penalty` when positive, multiplied
    when negative. logits: (B, V) float; seen: (B, V) bool."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def seen_mask(history: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, S) ids (negative = none) -> (B, V) bool: which ids occur in each row."""
    B = history.shape[0]
    idx = torch.where(history >= 0, history, torch.full_like(history, vocab))
    seen = torch.zeros(B, vocab + 1, dtype=torch.bool, device=history.device)
    seen.scatter_(1, idx, True)
    return seen[:, :vocab]


def filter_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order transformers uses): (B, V) float ->
    (B, V) float32 with filtered-out tokens at -inf. Not for greedy decoding."""
    logits = logits.float()
    # shift so the best logit is 0 before dividing, in float64: a tiny temperature (even one that
    # is 0 in float32) then sends the others to -inf, greedy in the limit, never inf - inf = NaN
    logits = logits - logits.amax(-1, keepdim=True)
    if cfg.temperature != 1.0:  # (x / 1 is x: skipped, the same numbers)
        logits = (logits.double() / cfg.temperature).float()
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > cfg.top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One id per row from the categorical distributions `probs` (B, V) float (each row's sum > 0;
    rows need not be normalised): (B,) int64. Inverse transform sampling: one uniform u per row
    (float64), the first id whose cumulative probability (float64) exceeds u x the row's total; an id of
    probability 0 is never drawn. One random number a row where `torch.multinomial` draws V
    exponentials a row (the Gumbel / exponential race): on a 2-core CPU those draws were 42% of an
    RL rollout's time (bench/RESULTS.md, 2026-11-27); the distribution is the same."""
    cdf = probs.double().cumsum(-1)  # (B, V)
    total = cdf[:, -1:].contiguous()  # (B, 1)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device, generator=generator)
    ids = torch.searchsorted(cdf, u * total, right=True)  # the first id with cdf > u x total
    last = torch.searchsorted(cdf, total)  # the last id of probability > 0 (u x total rounded up to total)
    return torch.minimum(ids, last).squeeze(-1)


def _penalised(logits: torch.Tensor, cfg: SamplingConfig, history: torch.Tensor | None,
               seen: torch.Tensor | None) -> torch.Tensor:
    """(B, V) float32 logits with the repetition penalty applied (when on and a history is given)."""
    logits = logits.float()
    if cfg.repetition_penalty != 1.0:
        if seen is None and history is not None:
            seen = seen_mask(history, logits.shape[-1])
        if seen is not None:
            logits = apply_repetition_penalty(logits, seen, cfg.repetition_penalty)
    return logits


def _check_finite(logits: torch.Tensor) -> None:
    if not bool(torch.isfinite(logits).all()):
        raise LmforgeError("the model produced non-finite logits (NaN or infinity): its weights are too large or "
                           "damaged for sampling. Use another checkpoint, or --greedy to see what it predicts.")


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, history: torch.Tensor | None = None,
                generator: torch.Generator | None = None, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Choose the next ids.

    Args:
        logits: (B, V) float, the last position's logits.
        cfg: the sampling settings.
        history: (B, S) int64 ids the repetition penalty looks at (negative ids are ignored);
            or give `seen` (B, V) bool directly.
        generator: a torch.Generator for reproducible sampling (`draw`: one uniform a row).
    Returns:
        (B,) int64 ids.
    Raises:
        LmforgeError: non-finite logits when sampling.
    """
    logits = _penalised(logits, cfg, history, seen)
    if cfg.greedy or cfg.temperature == 0:
        return logits.argmax(dim=-1)
    _check_finite(logits)
    return draw(filter_logits(logits, cfg).softmax(-1), generator)


def sample_with_logprobs(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None,
                         seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_next` (the same ids for the same generator) and each id's log-probability (nats)
    under the distribution it was drawn from (the penalty, temperature and filters applied):
    ((B,) int64, (B,) float32). What reinforcement learning's loss differentiates."""
    logits = _penalised(logits, cfg, None, seen)
    greedy = cfg.greedy or cfg.temperature == 0
    if not greedy:
        _check_finite(logits)
    filtered = filter_logits(logits, cfg)
    nxt = logits.argmax(dim=-1) if greedy else draw(filtered.softmax(-1), generator)
    return nxt, torch.log_softmax(filtered, -1).gather(1, nxt[:, None]).squeeze(1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, extra: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad prompts into one batch.

    Returns:
        tokens: (B, L) int64, `pad_id` in the padding;
        positions: (B, L) int64, 0 at each prompt's first real token (0 in the padding too);
        key_mask: (B, L + extra) bool, True at real slots (the `extra` generated slots included).
    """
    B, L = len(prompts), max(len(p) for p in prompts)
    tokens = torch.full((B, L), pad_id, dtype=torch.long)
    positions = torch.zeros((B, L), dtype=torch.long)
    key_mask = torch.ones((B, L + extra), dtype=torch.bool)
    for i, p in enumerate(prompts):
        pad = L - len(p)
        tokens[i, pad:] = torch.as_tensor(list(p), dtype=torch.long)
        positions[i, pad:] = torch.arange(len(p))
        key_mask[i, :pad] = False
    return tokens.to(device), positions.to(device), key_mask.to(device)


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_seq_len: int, max_new_tokens: int,
                  truncate: bool) -> list[list[int]]:
    """Validate (and with `truncate`, left-trim) prompts so prompt + max_new_tokens fits max_seq_len.

    Raises:
        LmforgeError: no prompts, an empty prompt, an id outside [0, vocab_size), a prompt too
        long (without `truncate`), or max_new_tokens >= max_seq_len.
    """
    if not prompts:
        raise LmforgeError("generate: no prompts given; pass at least one list of token ids.")
    budget = max_seq_len - max_new_tokens
    if budget < 1:
        raise LmforgeError(
            f"max_new_tokens = {max_new_tokens} leaves no room for a prompt in the model's max_seq_len = "
            f"{max_seq_len}; lower max_new_tokens below {max_seq_len}."
        )
    rows = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise LmforgeError(f"prompt {i} is empty: give at least one token (a completion prompt starts with the BOS, where the model has one).")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise LmforgeError(
                f"prompt {i} holds token id {bad[0]}, outside the model's vocab [0, {vocab_size}) (P6). "
                f"Encode prompts with the tokenizer this model was trained with."
            )
        if len(p) > budget:
            if not truncate:
                raise LmforgeError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens = {max_new_tokens} it exceeds the "
                    f"model's max_seq_len = {max_seq_len} (room for {budget} prompt tokens). Shorten it, lower "
                    f"max_new_tokens, or pass --truncate to keep its last {budget} tokens."
                )
            p = p[-budget:]
        rows.append(p)
    return rows


#: Largest output matrix (bytes) multiplied in the decode layout's (dim, V) copy (the steps' own)
HEAD_COPY_LIMIT = DecodeWeights.HEAD_COPY_LIMIT


def output_projection(model: Transformer):
    """A function (B, dim) -> (B, vocab_size) logits equal to `model.logits`.

    On CPU, with an output matrix of at most HEAD_COPY_LIMIT bytes, it multiplies by a
    contiguous (dim, vocab_size) copy made once (in the autocast dtype when autocast is on):
    that row-major layout makes the batch-1 matrix-vector product about twice as fast as
    F.linear's transposed access, and that product dominates a small model's decode step.
    Elsewhere it is `model.logits` itself.
    """
    w = model.output.weight[: model.vocab_size]
    dtype = compute_dtype(w.device, w.dtype)
    if w.device.type != "cpu" or w.numel() * dtype.itemsize > HEAD_COPY_LIMIT or model.config.final_softcap \
            or model.config.logit_scale != 1.0:
        return model.logits
    dw = model.decode_weights(dtype)  # made once per parameter version, shared with decode_step
    head = dw.head if dw.head_t else w.to(dtype).t().contiguous()  # (dim, V)
    return lambda h: h @ head


#: Off: every row's prompt is prefilled, repeated or not (the benchmarks flip it to compare:
#: `python bench/bench_rl.py --speed`).
SHARE_PREFILL = True
#: Rows that have stopped leave the decode batch (their cache rows dropped, `KVCache.gather_rows`)
#: once at least this share of the rows still decoded has stopped. Only where a row's logits do
#: not depend on the batch size (the eager decode step on oneDNN's prepacked matmuls: CPU fp32,
#: `decode_step(batch_invariant=True)`), so the ids and log-probabilities are the same bit for bit;
#: the sampler still draws for every row. 0: never (the benchmarks flip it to compare).
COMPACT_STOPPED = 0.25


def _first_rows(rows: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(the index of each distinct prompt's first row, for every row the position of its prompt's
    first row in that list): [[1, 2], [1, 2], [3]] -> ([0, 2], [0, 0, 1])."""
    seen: dict[tuple[int, ...], int] = {}
    first, source = [], []
    for i, row in enumerate(rows):
        key = tuple(row)
        if key not in seen:
            seen[key] = len(first)
            first.append(i)
        source.append(seen[key])
    return first, source


def _batch_invariant(cache) -> bool:
    """Does the eager decode step on `cache` give each row the same logits at any batch size
    (oneDNN's prepacked matmuls, `DecodeWeights.packed`; built by the first step)?"""
    return cache.weights is not None and cache.weights.packed is not None


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    stop_ids: Sequence[int],
    cfg: SamplingConfig,
    pad_id: int,
    truncate: bool = False,
    generator: torch.Generator | None = None,
    runtime: Runtime | None = None,
    return_logprobs: bool = False,
) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:
    """Continue each prompt; return the new ids of each (the stop id included when reached).

    Args:
        model: the Transformer (put in eval mode).
        prompts: B lists of token ids, any lengths (left-padded together with `pad_id`).
        stop_ids: ids that end a sequence (the contract's eos_id, and im_end_id in chat);
            empty: always generate max_new_tokens.
        cfg: sampling settings (validated).
        pad_id: the contract's pad id (fills padding; never attended to).
        truncate: keep the last tokens of a prompt too long for max_seq_len instead of failing.
        generator: for reproducible sampling.
        runtime: the precision to decode in (its `autocast()` is entered, whatever the caller's
            context), decided by the command (`runtime.decode_runtime`: fp32 on a CPU, bf16
            autocast on CUDA). None: `decode_runtime` for the model's device.
        return_logprobs: also return, for each new id, its log-probability (nats, float32) under
            the distribution it was sampled from (temperature, top-k and top-p applied; the
            repetition penalty too) — what reinforcement learning's loss must differentiate.
    A prompt that appears more than once (a group of RL completions) is prefilled once and its
    cache rows copied to each of its rows (`KVCache.gather_rows`).

    Returns:
        B lists of new ids, each at most cfg.max_new_tokens long (with `return_logprobs`: and B
        lists of their log-probabilities).
    Raises:
        LmforgeError: see `check_prompts` and `SamplingConfig.validate`.
    """
    runtime = runtime or decode_runtime(model.output.weight.device)
    runtime.check_model(model)  # no float16 compute for (offset + w) norms
    logprobs: list[torch.Tensor] | None = [] if return_logprobs else None
    with runtime.autocast(), torch.inference_mode():
        ids = _generate(model, prompts, stop_ids, cfg, pad_id, truncate, generator, logprobs)
    if logprobs is None:
        return ids
    table = torch.stack(logprobs, 1).float().cpu() if logprobs else torch.zeros(len(ids), 0)
    return ids, [table[i, : len(row)].tolist() for i, row in enumerate(ids)]


def _generate(model, prompts, stop_ids, cfg: SamplingConfig, pad_id: int, truncate: bool,
              generator: torch.Generator | None, logprobs: list | None = None) -> list[list[int]]:
    """`generate`'s body, run under its runtime's autocast and inference mode."""
    cfg.validate()
    model.eval()
    device = model.output.weight.device
    rows = check_prompts(prompts, model.vocab_size, model.config.max_seq_len, cfg.max_new_tokens, truncate)
    B, n_new = len(rows), cfg.max_new_tokens
    tokens, positions, key_mask = left_pad(rows, pad_id, n_new, device)
    L = tokens.shape[1]
    project = output_projection(model)
    cache, logits = _prefill(model, rows, tokens, positions, key_mask, n_new, project, device)
    next_pos = positions[:, -1] + 1  # (B,)

    seen = None
    if cfg.repetition_penalty != 1.0:
        seen = seen_mask(torch.where(key_mask[:, :L], tokens, -1), model.vocab_size)
    step = model.decode_step
    compiled = cfg.compile and compiler_available(device, _say_once, "generate.compile")
    if compiled:
        step = compiled_decode_step(model)
    live = None  # after the first compaction: (n,) the rows still in the cache, in order
    stops = torch.as_tensor(list(stop_ids), dtype=torch.long, device=device)
    out = torch.full((B, n_new), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    steps = 0
    for t in range(n_new):
        if logprobs is None:
            nxt = sample_next(logits, cfg, None, generator, seen)  # (B,)
        else:  # and its log-probability under the distribution sampled from (the penalty and the filters applied)
            nxt, logp = sample_with_logprobs(logits, cfg, generator, seen)
            logprobs.append(logp)
        if stops.numel():
            nxt = torch.where(done, pad_id, nxt)
        out[:, t] = nxt
        steps = t + 1
        if stops.numel():
            done |= torch.isin(nxt, stops)
            if bool(done.all()):
                break
        if t == n_new - 1:
            break
        if seen is not None:
            seen.scatter_(1, nxt[:, None], True)
        if stops.numel() and COMPACT_STOPPED and not compiled and _batch_invariant(cache):
            rows_now = live if live is not None else torch.arange(B, device=device)
            stopped_now = done[rows_now]
            if int(stopped_now.sum()) >= max(1, COMPACT_STOPPED * len(rows_now)):
                keep = (~stopped_now).nonzero().squeeze(1)
                cache, live = cache.gather_rows(keep), rows_now[keep]
        if live is None:
            logits = step(nxt, next_pos, cache)  # (B, V): a T = 1 decode step
        else:  # only the rows still going, in place; a stopped row keeps its last logits (its draws are thrown away)
            logits[live] = model.decode_step(nxt[live], next_pos[live], cache, batch_invariant=True)
        next_pos = next_pos + 1

    return _cut_at_stops(out[:, :steps].cpu(), stops, steps)


def _prefill(model, rows, tokens, positions, key_mask, n_new: int, project, device):
    """The prompts (`left_pad`'s (B, L) tensors) run into a new cache of L + n_new positions:
    (cache, (B, V) logits of each row's last position)."""
    B, L = len(rows), tokens.shape[1]
    padded = not bool(key_mask.all())
    # A prompt given more than once (RL's group of completions of one prompt) is prefilled once:
    # its cache rows and last logits are copied to every row that repeats it, which then samples
    # on its own (the same sampler draws as a prefill of every row: the rows' values, not the work)
    first, source = _first_rows(rows) if SHARE_PREFILL else (range(B), range(B))
    if len(first) < B:
        pick = torch.tensor(first, device=device)
        cache = model.new_cache(len(first), L + n_new, key_mask[pick] if padded else None)
        logits = project(model.hidden(tokens[pick], positions[pick], cache=cache)[:, -1])  # (unique, V)
        cache = cache.gather_rows(torch.tensor(source, device=device), key_mask if padded else None)
        logits = logits[torch.tensor(source, device=device)]  # (B, V)
    else:
        cache = model.new_cache(B, L + n_new, key_mask if padded else None)
        logits = project(model.hidden(tokens, positions, cache=cache)[:, -1])  # (B, V)
    return cache, logits


def _cut_at_stops(out: torch.Tensor, stops: torch.Tensor, steps: int) -> list[list[int]]:
    """(B, steps) new ids (CPU) -> each row's ids up to and including its first stop id."""
    B = out.shape[0]
    if stops.numel():
        hit = torch.isin(out, stops.cpu())
        first = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full((B,), steps))
    else:
        first = torch.full((B,), steps)
    return [row[:n].tolist() for row, n in zip(out, first.tolist())]


__all__ = ["SamplingConfig", "generate", "sample_next", "sample_with_logprobs", "draw", "filter_logits",
           "apply_repetition_penalty", "seen_mask", "left_pad", "check_prompts", "output_projection"]
