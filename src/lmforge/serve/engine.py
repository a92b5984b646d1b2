"""The batched decoding engine behind `lmforge serve`: continuous batching on one KV cache.

One thread owns the model. Requests wait in a bounded queue; at every step the engine
admits waiting requests into free cache rows (each prompt is prefilled alone, through a
view of its row), then runs one `Transformer.decode_step` for all running rows together
with per-row cache slots (slot = position: rows at different lengths share the pass), and
a row leaves as soon as it stops (end-of-turn / end-of-text id, a stop string, its token
limit, its deadline, or its client going away). Running rows are kept in rows 0..n-1: a
leaving row's place is taken by the last running row (its cache row is copied), so a step
works on a contiguous block of the cache.

Batch invariance: a request's greedy reply does not depend on what else is running. Every
op of the decode step treats rows independently, prefill is per request, the attention span
(filled slots rounded up to SPAN_STEP) does not change a row's numbers, and the matmuls are
oneDNN's with prepacked weights (`decode_step(batch_invariant=True)`), whose result for a row
does not depend on the number of rows. Where those are unavailable (no oneDNN, not float32)
MKL's matmul is used, which changes its kernel below 4 rows: a step then computes at least
MIN_ROWS rows (idle rows decode a pad token into their own, unused slot 0). On CUDA no such
guarantee is made.

Precision: the engine decodes under the `Runtime` it is given (the stage passes
`lmforge.runtime.decode_runtime()`, the policy `generate` follows: fp32 on a CPU, bf16
autocast on CUDA); its KV cache and decode weights are made under that runtime's autocast.

Why a loop of its own rather than `generate`: `generate` runs one fixed batch from start to
end; here requests come and go between steps. Both use the same model decode path
(`Transformer.decode_step`), `generate` with one shared slot, this engine with per-row slots.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lmforge.errors import LmforgeError
from lmforge.generate import SamplingConfig, sample_next
from lmforge.model import Transformer
from lmforge.runtime import Runtime, compute_dtype, decode_runtime
from lmforge.tokenizer import Tokenizer

#: A decode step computes at least this many rows (CPU matmuls are batch-invariant from 4 rows).
MIN_ROWS = 4
#: A decode step attends over the filled cache slots rounded up to a multiple of this.
SPAN_STEP = 64


class QueueFull(LmforgeError):
    """The engine's waiting queue is full (the server answers 429)."""


@dataclass
class Request:
    """One generation. `emit(kind, *payload)` is called from the engine thread:
    ("delta", text) for each new piece of text, then exactly one of
    ("done", finish_reason, prompt_tokens, completion_tokens) or ("error", message, type)."""

    prompt: list[int]
    max_tokens: int
    emit: Callable[..., None]
    temperature: float = 1.0
    top_p: float = 1.0
    stop: Sequence[str] = ()
    seed: int | None = None
    timeout_s: float = 120.0
    # engine state
    ids: list[int] = field(default_factory=list)
    cancelled: bool = False
    deadline: float = 0.0
    pos: int = 0
    """The position (and cache slot) of the last chosen token, fed at the next step."""
    sent: int = 0
    """Characters of the reply text already emitted."""
    text: str = ""
    """The reply's text decoded from ids[:settled]."""
    settled: int = 0
    generator: torch.Generator | None = None
    sampling: SamplingConfig | None = None
    submitted: float = 0.0

    def cancel(self) -> None:
        """Ask the engine to drop this request (its client went away); thread-safe."""
        self.cancelled = True


class Engine:
    """Continuous batching over one model and one KV cache (`max_batch` rows of max_seq_len).

    Args:
        model: the Transformer (eval mode; fp32 or whatever dtype it is in).
        tok: its tokenizer (stop ids and incremental text come from it).
        max_batch: rows decoded together at most.
        max_queue: requests waiting for a row at most; `submit` raises QueueFull beyond.
        stop_ids: ids that end a reply (default: the contract's im_end and eos).
        runtime: the precision every prefill and step runs in (None: `decode_runtime` for the
            model's device, as `generate`).
    """

    def __init__(self, model: Transformer, tok: Tokenizer, max_batch: int = 16, max_queue: int = 64,
                 stop_ids: Sequence[int] | None = None, runtime: Runtime | None = None):
        self.model, self.tok = model.eval(), tok
        self.runtime = runtime if runtime is not None else decode_runtime(model.output.weight.device)
        self.runtime.check_model(model)  # no float16 compute for (offset + w) norms
        self.max_batch, self.max_queue = max_batch, max_queue
        self.stop_ids = frozenset(stop_ids if stop_ids is not None else (tok.im_end_id, tok.eos_id))
        self.context = model.config.max_seq_len
        self.cache_rows = max(max_batch, MIN_ROWS)
        with self.runtime.autocast():  # the cache and the packed weights follow the runtime's dtype
            self.cache = model.new_cache(self.cache_rows, self.context)
            w = model.output.weight
            self.cache.weights = model.decode_weights(compute_dtype(w.device, w.dtype))
        self.min_rows = 1 if self.cache.weights.packed is not None else MIN_ROWS
        self.device = model.output.weight.device
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.lock = threading.Condition()
        self.steps = 0
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- the caller's side (any thread) --------------------------------------------------------
    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="lmforge-engine", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        with self.lock:
            self._stop = True
            self.lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def submit(self, req: Request) -> Request:
        """Queue `req` (validated by the caller: prompt + max_tokens fit the context).

        Raises:
            QueueFull: `max_queue` requests already wait.
        """
        if len(req.prompt) + req.max_tokens > self.context or not req.prompt or req.max_tokens < 1:
            raise LmforgeError(f"request of {len(req.prompt)} prompt tokens + max_tokens {req.max_tokens} does not "
                               f"fit the model's context of {self.context} tokens.")
        req.submitted = time.monotonic()
        req.deadline = req.submitted + req.timeout_s
        if req.temperature > 0:
            req.sampling = SamplingConfig(temperature=req.temperature, top_k=0, top_p=req.top_p)
            seed = req.seed if req.seed is not None else random.getrandbits(63)
            req.generator = torch.Generator(device=self.device).manual_seed(seed)
        with self.lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the server's queue is full ({self.max_queue} requests waiting); retry later.")
            self.waiting.append(req)
            self.lock.notify_all()
        return req

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), "max_batch": self.max_batch,
                "max_queue": self.max_queue, "steps": self.steps}

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        with self.runtime.autocast():  # autocast is per thread: entered here, around every model call
            self._serve()
        for req in [*self.running, *self.waiting]:
            req.emit("error", "the server is shutting down", "server_error")

    def _serve(self) -> None:
        while True:
            with self.lock:
                while not self._stop and not self.waiting and not self.running:
                    self.lock.wait(timeout=1.0)
                if self._stop:
                    break
                admit = []
                while self.waiting and len(self.running) + len(admit) < self.max_batch:
                    admit.append(self.waiting.popleft())
            with torch.inference_mode():
                for req in admit:
                    try:
                        self._admit(req)
                    except Exception as exc:  # this request only: the running ones go on
                        if req in self.running:
                            self._release(req)
                        req.emit("error", f"the engine failed on this prompt: {type(exc).__name__}: {exc}",
                                 "server_error")
            try:
                with torch.inference_mode():
                    self._expire()
                    if self.running:
                        self._step()
            except Exception as exc:  # never let one bad step kill the server: fail what ran
                for req in self.running:
                    req.emit("error", f"the engine failed on this step: {type(exc).__name__}: {exc}", "server_error")
                self.running.clear()

    def _admit(self, req: Request) -> None:
        if req.cancelled:
            return
        row = len(self.running)
        ids = torch.tensor([req.prompt], dtype=torch.long, device=self.device)  # (1, L)
        h = self.model.hidden(ids, cache=self.cache.rows(row, row + 1))  # prefill alone, into its row
        logits = self.model.logits(h[:, -1])  # (1, V)
        req.pos = len(req.prompt)
        self.running.append(req)
        self._take(req, self._choose([req], logits)[0])

    def _step(self) -> None:
        n = len(self.running)
        m = min(max(n, self.min_rows), self.cache_rows)
        pad = self.tok.pad_id
        tokens = torch.tensor([r.ids[-1] for r in self.running] + [pad] * (m - n), device=self.device)
        pos = torch.tensor([r.pos for r in self.running] + [0] * (m - n), device=self.device)
        # attend over the filled slots only, rounded up to SPAN_STEP (a row's numbers do not depend
        # on the span: masked slots add exact zeros; tests/test_decode_step.py checks it)
        span = min(self.context, -(-(max(r.pos for r in self.running) + 1) // SPAN_STEP) * SPAN_STEP)
        logits = self.model.decode_step(tokens, pos, self.cache.rows(0, m, span), slots=pos,
                                        batch_invariant=True)[:n]  # (n, V)
        self.steps += 1
        for req in self.running:
            req.pos += 1
        for req, t in zip(list(self.running), self._choose(self.running, logits)):
            self._take(req, t)

    def _choose(self, reqs: Sequence[Request], logits: torch.Tensor) -> list[int]:
        """Next id per row: argmax for temperature 0, else a draw from the request's own generator."""
        out = logits.argmax(-1).tolist()
        for i, r in enumerate(reqs):
            if r.sampling is not None:
                out[i] = int(sample_next(logits[i:i + 1], r.sampling, generator=r.generator)[0])
        return out

    def _take(self, req: Request, t: int) -> None:
        """Record the chosen id, emit new text, and finish the request when it stops."""
        req.ids.append(t)
        if t in self.stop_ids:
            return self._finish(req, "stop", text=self._text(req, final=True))
        text = self._text(req)
        if req.stop:
            hits = [i for i in (text.find(s, max(0, req.sent - len(s))) for s in req.stop) if i >= 0]
            if hits:
                return self._finish(req, "stop", text=text[:min(hits)])
        if len(req.ids) >= req.max_tokens:
            return self._finish(req, "length", text=self._text(req, final=True))
        safe = len(text)
        for s in req.stop:  # hold back what could be the start of a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[safe - k:safe] == s[:k]:
                    safe -= k
                    break
        if safe > req.sent:
            req.emit("delta", text[req.sent:safe])
            req.sent = safe

    def _text(self, req: Request, final: bool = False) -> str:
        """The reply's text so far, decoding only the ids not yet settled into text: byte-level
        pieces concatenate, except a UTF-8 character split over tokens (it shows as U+FFFD until
        its last byte arrives; held back unless `final`). Stop ids are not text."""
        ids = [i for i in req.ids[req.settled:] if i not in self.stop_ids]
        tail = self.tok.decode(ids)
        if tail.endswith("\ufffd") and not final:
            return req.text + tail.rstrip("\ufffd")
        req.text += tail
        req.settled = len(req.ids)
        return req.text

    def _finish(self, req: Request, reason: str, text: str) -> None:
        if len(text) > req.sent:
            req.emit("delta", text[req.sent:])
            req.sent = len(text)
        self._release(req)
        req.emit("done", reason, len(req.prompt), len(req.ids))

    def _expire(self) -> None:
        now = time.monotonic()
        for req in list(self.running):
            if req.cancelled:
                self._release(req)
            elif now > req.deadline:
                self._release(req)
                req.emit("error", f"the request ran past the server's timeout of {req.timeout_s:g} s "
                                  f"(--timeout); ask for fewer max_tokens or retry when the server is less busy.",
                         "timeout")
        with self.lock:
            for req in [r for r in self.waiting if r.cancelled or now > r.deadline]:
                self.waiting.remove(req)
                if not req.cancelled:
                    req.emit("error", f"the request waited past the server's timeout of {req.timeout_s:g} s.",
                             "timeout")

    def _release(self, req: Request) -> None:
        """Free req's row: the last running row moves into it (cache row copied)."""
        row = self.running.index(req)
        last = len(self.running) - 1
        if row != last:
            for k, v in zip(self.cache.k, self.cache.v):
                k[row].copy_(k[last])
                v[row].copy_(v[last])
            self.running[row] = self.running[last]
        self.running.pop()


_ids = itertools.count()


def request_id(prefix: str) -> str:
    return f"{prefix}-{int(time.time() * 1000):x}{next(_ids):04x}"
