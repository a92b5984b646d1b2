"""KV-cache generation and sampling.

Prompts are left-padded into one batch with an explicit key mask (P5); the prompt is
run once (prefill), then one token per step (T = 1 decode, P7). Sampling: temperature,
top-k, top-p (nucleus; Holtzman et al. 2020), repetition penalty (CTRL; Keskar et al.
2019), or greedy. A sequence stops at any of `stop_ids` (from the contract: <|eos|>,
and <|im_end|> in chat) or after `max_new_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmforge.errors import LmforgeError
from lmforge.model import Transformer


@dataclass
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    repetition_penalty: float = 1.0
    greedy: bool = False


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, history: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: (B, V) float -> next ids (B,) int64. `history` (B, S) ids for the penalty
    (negative ids are ignored)."""
    logits = logits.float()
    if cfg.repetition_penalty != 1.0 and history is not None:
        hist = history.clamp(min=0)
        seen = torch.gather(logits, 1, hist)
        seen = torch.where(seen > 0, seen / cfg.repetition_penalty, seen * cfg.repetition_penalty)
        valid = history >= 0
        logits = logits.scatter(1, torch.where(valid, hist, torch.zeros_like(hist)),
                                torch.where(valid, seen, torch.gather(logits, 1, torch.zeros_like(hist))))
    if cfg.greedy or cfg.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > cfg.top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    stop_ids: Sequence[int],
    cfg: SamplingConfig,
    pad_id: int,
    truncate: bool = False,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Continue each prompt; return the new ids of each (stop id included when reached).

    Raises:
        LmforgeError: an empty prompt, or a prompt + max_new_tokens longer than the model's
        max_seq_len (unless `truncate`, which keeps the prompt's last tokens).
    """
    model.eval()
    device = model.output.weight.device
    max_len = model.config.max_seq_len
    budget = max_len - cfg.max_new_tokens
    if budget < 1:
        raise LmforgeError(
            f"max_new_tokens = {cfg.max_new_tokens} leaves no room for a prompt in max_seq_len = {max_len}; "
            f"lower max_new_tokens."
        )
    rows = []
    for i, p in enumerate(prompts):
        p = list(p)
        if not p:
            raise LmforgeError(f"prompt {i} is empty: give at least one token (lmforge prompts start with <|bos|>).")
        if len(p) > budget:
            if not truncate:
                raise LmforgeError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens = {cfg.max_new_tokens} it exceeds "
                    f"max_seq_len = {max_len}. Shorten it, lower max_new_tokens, or pass --truncate."
                )
            p = p[-budget:]
        rows.append(p)
    B = len(rows)
    L = max(len(p) for p in rows)
    tokens = torch.full((B, L), pad_id, dtype=torch.long)
    key_mask = torch.zeros((B, L + cfg.max_new_tokens), dtype=torch.bool)
    key_mask[:, L:] = True  # generated slots are real
    positions = torch.zeros((B, L), dtype=torch.long)
    for i, p in enumerate(rows):
        pad = L - len(p)
        tokens[i, pad:] = torch.tensor(p)
        key_mask[i, pad:] = True
        positions[i, pad:] = torch.arange(len(p))
    tokens, key_mask, positions = tokens.to(device), key_mask.to(device), positions.to(device)
    padded = bool((~key_mask[:, :L]).any())
    cache = model.new_cache(B, L + cfg.max_new_tokens, key_mask if padded else None)
    logits = model(tokens, positions, cache=cache)[:, -1]  # (B, V)
    next_pos = positions[:, -1] + 1
    history = torch.where(key_mask[:, :L], tokens, torch.full_like(tokens, -1))
    stops = torch.tensor(list(stop_ids), device=device)
    out = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for _ in range(cfg.max_new_tokens):
        nxt = sample_next(logits, cfg, history, generator)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        for i in range(B):
            if not done[i]:
                out[i].append(int(nxt[i]))
        done |= torch.isin(nxt, stops)
        if bool(done.all()):
            break
        history = torch.cat([history, torch.where(done, -1, nxt)[:, None]], dim=1)
        logits = model(nxt[:, None], next_pos[:, None], cache=cache)[:, -1]
        next_pos = next_pos + 1
    return out
