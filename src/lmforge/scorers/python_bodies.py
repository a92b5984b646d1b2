"""Generated Python function bodies, scored: whether a body the model wrote for a held-out
standard-library prompt parses under its signature (as that one function: text after its body
does not count) and ends its turn (the speedrun's SFT figure; a reward a reinforcement-learning
objective can use)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from lmforge.config import SamplingConfig
from lmforge.data.conversations import cap_examples
from lmforge.generate import generate
from lmforge.runtime import Runtime
from lmforge.scorers.static import parse_body
from lmforge.tokenizer import Tokenizer


def body_parse_rate(model, tok: Tokenizer, items: Sequence[dict], max_new_tokens: int = 64,
                    batch_size: int = 8, runtime: Runtime | None = None,
                    sampling: SamplingConfig | None = None) -> dict:
    """Greedy bodies for held-out stdlib prompts; the fraction that parse with `ast.parse`
    when placed under their signature, as that function and nothing after it
    (`scorers.static.parse_body`). A body counts only if the model also ended its turn
    (<|im_end|> or <|eos|>) within `max_new_tokens`: a reply cut off by the budget is not a
    body, even when the cut happens to leave valid Python.

    `items`: records of sft_val.jsonl with `messages` (user prompt first), `signature`;
    `runtime`: the decoding runtime (see `generate`); `sampling`: the decoding policy (default:
    greedy, no repetition penalty), its max_new_tokens replaced by `max_new_tokens`.
    Returns {"fraction", "parsed", "stopped", "n", "im_end" (ended with <|im_end|>),
    "parsed_and_im_end", "max_new_tokens", "examples": [{name, body, stopped, parses, im_end}]}.
    """
    sampling = replace(sampling or SamplingConfig(greedy=True), max_new_tokens=max_new_tokens)
    results = []
    for i in range(0, len(items), batch_size):
        chunk = items[i: i + batch_size]
        prompts = [tok.render_chat(r["messages"][:1], add_generation_prompt=True).ids for r in chunk]
        outs = generate(model, prompts, [tok.im_end_id, tok.eos_id], sampling, tok.pad_id, truncate=True,
                        runtime=runtime)
        for r, ids in zip(chunk, outs):
            stopped = bool(ids) and ids[-1] in (tok.im_end_id, tok.eos_id)
            body = tok.decode(ids[:-1] if stopped else ids)
            ok = stopped and parse_body(r["signature"], body)[0] is not None
            results.append({"name": r["name"], "body": body, "stopped": stopped, "parses": ok,
                            "im_end": bool(ids) and ids[-1] == tok.im_end_id})
    parsed = sum(r["parses"] for r in results)
    return {"fraction": parsed / max(1, len(results)), "parsed": parsed,
            "stopped": sum(r["stopped"] for r in results), "n": len(results),
            "im_end": sum(r["im_end"] for r in results),
            "parsed_and_im_end": sum(r["parses"] and r["im_end"] for r in results),
            "max_new_tokens": max_new_tokens, "examples": results}


def held_out_prompts(val_file: Path, tok: Tokenizer, n: int = 20, max_body_tokens: int = 63) -> list[dict]:
    """Up to `n` stdlib records of sft_val.jsonl whose reference body fits in
    `max_body_tokens` tokens (so a correct reply can finish), in a stable order."""
    items = [json.loads(x) for x in val_file.read_text(encoding="utf-8").splitlines() if x.strip()]
    items = [r for r in items if "signature" in r and len(tok.encode(r["body"])) <= max_body_tokens]
    return cap_examples(items, n, lambda r: r["name"])


__all__ = ["body_parse_rate", "held_out_prompts"]
