"""Supervised fine-tuning (`lmforge sft`) and chat (`lmforge chat`).

SFT is data, not a second trainer: `sft_stage` loads the model from `sft.init`, checks its
contract against the tokenizer, renders conversations into rows (lmforge.data.sft) and
runs the same `Trainer.fit` as pretraining, with the same loss (P3). The [sft] section
supplies the step count, batch shape, learning rate and warm-up; every other [train] key
(schedule, weight decay, clipping, precision, seed, checkpointing) applies as it is.

The SFT run folder holds what a pretraining run folder holds (metrics.jsonl, config.toml
with the [train] values actually used, step_NNNNNN/ checkpoints, contract and tokenizer
files) plus `sft_data.json` (counts: conversations, truncated, dropped) and
`sft_val.jsonl` (the held-out conversations validated on).
"""

from __future__ import annotations

import ast
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from lmforge.config import Config
from lmforge.contract import CONTRACT_FILE
from lmforge.data.sft import (
    Conversation,
    cap_examples,
    place_body,
    read_conversations,
    render_samples,
    sft_batches,
    sft_stream,
    split_conversations,
    stdlib_examples,
    StdlibStats,
)
from lmforge.errors import ConfigError, DataError
from lmforge.generate import SamplingConfig, generate
from lmforge.model.attention import resolve_backend
from lmforge.stages import log, run_training, startup_report
from lmforge.tokenizer import TOKENIZER_FILE, Tokenizer
from lmforge.train.checkpoint import load_model, resolve_checkpoint
from lmforge.train.distributed import init_distributed, shutdown
from lmforge.train.trainer import autocast, check_run_dir, resolve_precision, seed_everything

SFT_DATA_FILE = "sft_data.json"
SFT_VAL_FILE = "sft_val.jsonl"


# -- configuration -------------------------------------------------------------------------
def sft_config(cfg: Config, init_cfg: Config) -> Config:
    """The config an SFT run trains and saves: [model] from the initial checkpoint, and
    [train] steps / micro_batch_size / grad_accum_steps / lr / warmup_steps from [sft].

    Raises:
        ConfigError: e.g. data.seq_len above the checkpoint's model.max_seq_len.
    """
    s = cfg.sft
    train = replace(cfg.train, steps=s.steps, micro_batch_size=s.micro_batch_size,
                    grad_accum_steps=s.grad_accum_steps, lr=s.lr, warmup_steps=s.warmup_steps)
    return replace(cfg, model=init_cfg.model, train=train).validate()


def sft_tokenizer(cfg: Config, init: Path) -> Tokenizer:
    """The tokenizer in tokenizer.dir when that folder holds one, else the checkpoint's own copy."""
    tok_dir = Path(cfg.tokenizer.dir)
    return Tokenizer.load(tok_dir if (tok_dir / TOKENIZER_FILE).is_file() else init)


# -- data -----------------------------------------------------------------------------------
def load_conversations(cfg: Config) -> tuple[dict[str, list[Conversation]], dict[str, list], dict]:
    """SFT conversations by split, the held-out stdlib functions (empty for files), and counts.

    `sft.data` = "stdlib": the standard-library function set, split by module with the
    pretraining rule; otherwise a JSONL / Parquet file split by content hash. Training
    conversations are capped at sft.max_examples, validation ones at sft.val_examples
    (both by a stable hash).

    Raises:
        DataError: a bad file (naming file and line), or no training conversation.
    """
    s, d = cfg.sft, cfg.data
    info: dict = {"source": s.data}
    functions: dict[str, list] = {"train": [], "val": []}
    if s.data == "stdlib":
        stats = StdlibStats()
        functions = stdlib_examples(d.val_fraction, s.max_chars, s.max_examples, d.include_tests, stats)
        functions["val"] = cap_examples(functions["val"], s.val_examples, lambda e: f"{e.module}:{e.qualname}")
        convs = {split: [e.conversation() for e in exs] for split, exs in functions.items()}
        info.update(modules_parsed=stats.modules, functions_found=stats.functions,
                    left_out_too_long=stats.too_long, left_out_per_module_cap=stats.per_module_cap,
                    left_out_val_duplicates=stats.val_duplicates)
    else:
        convs = split_conversations(read_conversations(s.data), d.val_fraction)
        convs["train"] = cap_examples(convs["train"], s.max_examples, lambda c: c.key)
        convs["val"] = cap_examples(convs["val"], s.val_examples, lambda c: c.key)
    if not convs["train"]:
        raise DataError(f"sft.data = {s.data!r}: no training conversation (all {len(convs['val'])} fell in the "
                        f"validation split, data.val_fraction = {d.val_fraction}). Add conversations or lower "
                        f"data.val_fraction.")
    return convs, functions, info


def _write_val(path: Path, convs: Sequence[Conversation], functions: Sequence) -> None:
    by_name = {f"{f.module}:{f.qualname}": f for f in functions}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for c in convs:
            rec = {"name": c.name, "messages": list(c.messages)}
            fn = by_name.get(c.name)
            if fn is not None:
                rec.update(signature=fn.signature, body=fn.body)
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    tmp.replace(path)


# -- the stage --------------------------------------------------------------------------------
def sft_stage(cfg: Config, out: str | Path, resume: bool = False, dry_run: bool = False,
              progress: bool = True) -> dict:
    """Fine-tune the checkpoint `sft.init` on `sft.data`; returns the last step's metrics
    (with `val_loss`, the mean nats per supervised token on the held-out conversations).

    Raises:
        ConfigError: sft.init not set, or a config that does not fit the checkpoint.
        CheckpointError / ContractError: sft.init is not a checkpoint, or was trained with
        another tokenizer than tokenizer.dir.
        DataError: bad SFT data (naming file and line), or nothing left to train on.
    """
    out = Path(out)
    if not cfg.sft.init:
        raise ConfigError("sft.init is empty: set the checkpoint to fine-tune, e.g. --set sft.init=runs/pre "
                          "(a pretraining run folder or one of its step_NNNNNN folders).")
    init = resolve_checkpoint(cfg.sft.init)
    tok = sft_tokenizer(cfg, init)
    model, init_cfg, _, _ = load_model(init, "cpu", tok.contract, tok.folder / CONTRACT_FILE)
    cfg = sft_config(replace(cfg, tokenizer=replace(cfg.tokenizer, dir=str(tok.folder))), init_cfg)
    info = init_distributed(cfg)
    try:
        if not dry_run:
            check_run_dir(out, resume)
        seed_everything(cfg.train.seed)
        model.set_attention(resolve_backend(cfg.model.attention, info.device, training=True))
        model.train()
        d, t, s = cfg.data, cfg.train, cfg.sft
        t0 = time.perf_counter()
        convs, functions, data_info = load_conversations(cfg)
        samples = {split: render_samples(c, tok, d.seq_len) for split, c in convs.items()}
        data_info["seconds"] = round(time.perf_counter() - t0, 2)
        stream = sft_stream(samples["train"], d.seq_len, t.micro_batch_size, tok.pad_id, t.seed, s.packing,
                            rank=info.rank, world_size=info.world_size)
        val = samples["val"]

        def val_batches():
            return sft_batches(val, d.seq_len, t.micro_batch_size, tok.pad_id, s.packing)

        counts = {split: smp.counts() for split, smp in samples.items()}
        stream.plan(0)
        data_info.update(splits=counts, seq_len=d.seq_len, packing=s.packing, init=str(init),
                         padding_fraction=round(stream.last_padding_fraction, 4))
        dtype = resolve_precision(t.precision, info.device)
        if info.is_main:
            report = {split: {"documents": smp.counts()["kept"], "tokens": smp.tokens,
                              "max_id": max((int(x.max()) for x in smp.ids), default=-1)}
                      for split, smp in samples.items()}
            log(f"sft: init {init}; data {s.data!r}, {'packed with document masking' if s.packing else 'right-padded'}")
            log(startup_report(model, tok, report, cfg, info.world_size, info.device, dtype))
            for split, c in counts.items():
                log(f"sft data {split}: {c['conversations']} conversations, {c['truncated']} truncated to "
                    f"seq_len {d.seq_len} (tail cut), {c['dropped_all_cut']} dropped (every supervised token "
                    f"was cut), {c['supervised']:,} supervised targets")
            log(f"sft rows: padding {data_info['padding_fraction']:.1%} of the training rows; data read and "
                f"rendered in {data_info['seconds']:.1f}s")
        if not dry_run and info.is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / SFT_DATA_FILE).write_text(json.dumps(data_info, indent=2) + "\n", encoding="utf-8")
            _write_val(out / SFT_VAL_FILE, convs["val"], functions.get("val", []))
        return run_training(cfg, out, tok.folder, model, stream, val_batches if val.ids else None, info,
                            resume=resume, dry_run=dry_run, progress=progress)
    finally:
        shutdown(info)


# -- chat -----------------------------------------------------------------------------------------
def chat_prompt(tok: Tokenizer, messages: Sequence[dict], budget: int) -> list[int]:
    """The history rendered with the template plus the assistant header, within `budget`
    tokens: while it is too long, the oldest exchange after a system message is dropped
    (the caller's generate(truncate=True) cuts what still does not fit)."""
    messages = list(messages)
    first = 1 if messages and messages[0]["role"] == "system" else 0
    ids = tok.render_chat(messages, add_generation_prompt=True).ids
    while len(ids) > budget and len(messages) - first > 1:
        del messages[first]  # the oldest turn, and what answered it: the history restarts on a user turn
        while len(messages) - first > 1 and messages[first]["role"] != "user":
            del messages[first]
        ids = tok.render_chat(messages, add_generation_prompt=True).ids
    return ids


def chat_reply(model, tok: Tokenizer, messages: Sequence[dict], sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> str:
    """The assistant's next reply to `messages` (text; generation stops at <|im_end|> or <|eos|>)."""
    prompt = chat_prompt(tok, messages, model.config.max_seq_len - sampling.max_new_tokens)
    dtype = resolve_precision("auto", torch.device("cpu"))
    with autocast(torch.device("cpu"), dtype):
        ids = generate(model, [prompt], [tok.im_end_id, tok.eos_id], sampling, tok.pad_id, truncate=True,
                       generator=generator)[0]
    if ids and ids[-1] in (tok.im_end_id, tok.eos_id):
        ids = ids[:-1]
    return tok.decode(ids)


def stdin_reader(prompt: str = "> ") -> Callable[[], str | None]:
    """Reads one line from stdin per call (None at end of input); shows `prompt` on a terminal."""
    interactive = sys.stdin.isatty()

    def read() -> str | None:
        if interactive:
            try:
                return input(prompt)
            except EOFError:
                return None
        line = sys.stdin.readline()
        return line if line else None

    return read


def chat_loop(model, tok: Tokenizer, sampling: SamplingConfig, read_line: Callable[[], str | None],
              write: Callable[[str], None], system: str | None = None, seed: int | None = None) -> list[dict]:
    """An interactive chat: each line read is a user turn; the reply is written. `/exit` or
    end of input quits, `/reset` clears the history. Returns the final history."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    while True:
        line = read_line()
        if line is None:
            break
        text = line.rstrip("\r\n")
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            history = list(start)
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        reply = chat_reply(model, tok, history, sampling, gen)
        history.append({"role": "assistant", "content": reply})
        write(reply)
    return history


# -- evaluation for the speedrun ----------------------------------------------------------------
def body_parse_rate(model, tok: Tokenizer, items: Sequence[dict], max_new_tokens: int = 64,
                    batch_size: int = 8) -> dict:
    """Greedy bodies for held-out stdlib prompts; the fraction that parse with `ast.parse`
    when placed under their signature. A body counts only if the model also ended its turn
    (<|im_end|> or <|eos|>) within `max_new_tokens`: a reply cut off by the budget is not a
    body, even when the cut happens to leave valid Python.

    `items`: records of sft_val.jsonl with `messages` (user prompt first), `signature`.
    Returns {"fraction", "parsed", "stopped", "n", "im_end" (ended with <|im_end|>),
    "parsed_and_im_end", "max_new_tokens", "examples": [{name, body, stopped, parses, im_end}]}.
    """
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, greedy=True)
    results = []
    dtype = resolve_precision("auto", torch.device("cpu"))
    for i in range(0, len(items), batch_size):
        chunk = items[i: i + batch_size]
        prompts = [tok.render_chat(r["messages"][:1], add_generation_prompt=True).ids for r in chunk]
        with autocast(torch.device("cpu"), dtype):
            outs = generate(model, prompts, [tok.im_end_id, tok.eos_id], sampling, tok.pad_id, truncate=True)
        for r, ids in zip(chunk, outs):
            stopped = bool(ids) and ids[-1] in (tok.im_end_id, tok.eos_id)
            body = tok.decode(ids[:-1] if stopped else ids)
            try:
                ast.parse(place_body(r["signature"], body))
                ok = stopped
            except (SyntaxError, ValueError):
                ok = False
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


__all__ = ["sft_stage", "sft_config", "load_conversations", "chat_loop", "chat_reply", "chat_prompt",
           "stdin_reader", "body_parse_rate", "held_out_prompts", "SFT_DATA_FILE", "SFT_VAL_FILE"]
