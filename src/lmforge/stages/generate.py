"""`lmforge generate` and `lmforge chat`: text from a checkpoint.

Both load through `lmforge.loading.load_checkpoint` and decode through `lmforge.generate.generate`
(KV cache, one sampling config) under the one decoding policy, `lmforge.runtime.decode_runtime`,
decided once per command and passed down; stopping at the contract's ids:
<|eos|> for a document, <|im_end|> (or <|eos|>) for a chat turn.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from lmforge.config import Config, SamplingConfig
from lmforge.generate import generate
from lmforge.loading import load_checkpoint
from lmforge.runtime import Runtime, decode_runtime
from lmforge.tokenizer import Tokenizer


def generate_text(model, tok: Tokenizer, prompt: str, sampling: SamplingConfig, seed: int | None = None,
                  truncate: bool = False, runtime: Runtime | None = None) -> str:
    """Complete `prompt` (a document start: the contract's BOS is prepended where the model has
    one, `Tokenizer.encode_prompt`); stops at the EOS. Decodes under `runtime` (see `generate`)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed) if seed is not None else None
    prompt_ids = tok.encode_prompt(prompt)
    if truncate:  # its last tokens, behind its BOS (generate's own cut would drop the BOS)
        prompt_ids = tok.fit_prompt(prompt_ids, model.config.max_seq_len - sampling.max_new_tokens)
    ids = generate(model, [prompt_ids], [tok.eos_id], sampling, tok.pad_id,
                   truncate=truncate, generator=gen, runtime=runtime)[0]
    if ids and ids[-1] == tok.eos_id:
        ids = ids[:-1]
    return prompt + tok.decode(ids)


def generate_stage(cfg: Config, checkpoint: str | Path, prompt: str, sampling: SamplingConfig,
                   tokenizer: str | Path | None = None, seed: int | None = None, truncate: bool = False) -> str:
    """`lmforge generate`: load the checkpoint (and check `tokenizer` against it), complete `prompt`
    under the decoding runtime."""
    rt = decode_runtime()
    model, tok, _, _ = load_checkpoint(checkpoint, tokenizer, rt.device)
    return generate_text(model, tok, prompt, sampling.validate(), seed=seed, truncate=truncate, runtime=rt)


# -- chat ---------------------------------------------------------------------------------------
def chat_prompt(tok: Tokenizer, messages: Sequence[dict], budget: int) -> list[int]:
    """The history rendered with the template plus the assistant header, within `budget`
    tokens: while it is too long, the oldest exchange after a system message is dropped
    (then its last tokens, behind its BOS: `Tokenizer.fit_prompt`)."""
    messages = list(messages)
    first = 1 if messages and messages[0]["role"] == "system" else 0
    ids = tok.render_chat(messages, add_generation_prompt=True).ids
    while len(ids) > budget and len(messages) - first > 1:
        del messages[first]  # the oldest turn, and what answered it: the history restarts on a user turn
        while len(messages) - first > 1 and messages[first]["role"] != "user":
            del messages[first]
        ids = tok.render_chat(messages, add_generation_prompt=True).ids
    return tok.fit_prompt(ids, budget)


def chat_reply(model, tok: Tokenizer, messages: Sequence[dict], sampling: SamplingConfig,
               generator: torch.Generator | None = None, runtime: Runtime | None = None) -> str:
    """The assistant's next reply to `messages` (text; generation stops at <|im_end|> or <|eos|>)."""
    prompt = chat_prompt(tok, messages, model.config.max_seq_len - sampling.max_new_tokens)
    ids = generate(model, [prompt], [tok.im_end_id, tok.eos_id], sampling, tok.pad_id, truncate=True,
                   generator=generator, runtime=runtime)[0]
    if ids and ids[-1] in (tok.im_end_id, tok.eos_id):
        ids = ids[:-1]
    return tok.decode(ids)


def stdin_reader(prompt: str = "> ") -> Callable[[], str | None]:
    """Reads one line from stdin per call (None at end of input); shows `prompt` on a terminal."""
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8: surrogates, which chat_loop skips
        sys.stdin.reconfigure(errors="surrogateescape")

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
              write: Callable[[str], None], system: str | None = None, seed: int | None = None,
              runtime: Runtime | None = None) -> list[dict]:
    """An interactive chat: each line read is a user turn; the reply is written. `/exit` or
    end of input quits, `/reset` clears the history. Returns the final history."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed) if seed is not None else None
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    while True:
        line = read_line()
        if line is None:
            break
        text = line.rstrip("\r\n")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # stdin bytes that are not UTF-8 arrive as surrogates
            print("chat: that line is not UTF-8 text; it was ignored", file=sys.stderr, flush=True)
            continue
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            history = list(start)
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        reply = chat_reply(model, tok, history, sampling, gen, runtime)
        history.append({"role": "assistant", "content": reply})
        write(reply)
    return history


def chat_stage(checkpoint: str | Path, sampling: SamplingConfig, tokenizer: str | Path | None = None,
               system: str | None = None, seed: int | None = None) -> list[dict]:
    """`lmforge chat`: an interactive chat on stdin/stdout with a checkpoint, under the decoding runtime."""
    rt = decode_runtime()
    model, tok, _, _ = load_checkpoint(checkpoint, tokenizer, rt.device)
    return chat_loop(model, tok, sampling.validate(), stdin_reader(), lambda reply: print(reply, flush=True),
                     system=system, seed=seed, runtime=rt)


__all__ = ["generate_text", "generate_stage", "chat_prompt", "chat_reply", "chat_loop", "chat_stage",
           "stdin_reader"]
