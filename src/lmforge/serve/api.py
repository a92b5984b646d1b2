"""The OpenAI-compatible HTTP API of `lmforge serve` (Starlette, run by uvicorn).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
and the chat page at / (one static file, package data). Streaming answers are server-sent
events in OpenAI's chunk format, ending with `data: [DONE]`.

Chat messages are rendered with the checkpoint's chat template
(`Tokenizer.render_chat(..., add_generation_prompt=True)`); completions prompts are a
document start (<|bos|> + text), as `lmforge generate`. Replies stop at the contract's
end-of-turn and end-of-text ids. `usage` counts tokens with the model's own tokenizer:
prompt tokens as fed, completion tokens as generated (the stop id included).

Every bad request gets a 400 with an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` naming the field; a full queue a 429;
a request past its deadline a 504 (or an error event when streaming). Nothing a client
sends stops the server.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from importlib import resources
from typing import Any

from lmforge.serve.engine import Engine, QueueFull, Request, request_id

ROLES = ("system", "user", "assistant")


class BadRequest(Exception):
    """A request the API refuses: rendered as an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# -- validation ---------------------------------------------------------------------------------
def _type_name(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} = {json.dumps(v)} is {_type_name(v)}: expected an integer.", name, "invalid_type")
    if lo is not None and v < lo or hi is not None and v > hi:
        want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"{name} = {v}: expected an integer {want}.", name, "invalid_value")
    return v


def _num(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"{name} = {json.dumps(v)} is {_type_name(v)}: expected a number.", name, "invalid_type")
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise BadRequest(f"{name} = {v}: expected a number in {'(' if lo_open else '['}{lo:g}, {hi:g}].", name,
                         "invalid_value")
    return float(v)


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # [{"type": "text", "text": ...}, ...]: text parts only
        parts = []
        for j, part in enumerate(c):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRequest(f"messages[{i}].content[{j}]: only text parts ({{\"type\": \"text\", \"text\": "
                                 f"...}}) are supported.", f"messages[{i}].content", "invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"messages[{i}].content is {_type_name(c)}: expected a string.", f"messages[{i}].content",
                     "invalid_type")


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise BadRequest("messages is missing: expected an array of {\"role\", \"content\"} objects.", "messages",
                         "missing_required_parameter")
    if not isinstance(msgs, list):
        raise BadRequest(f"messages is {_type_name(msgs)}: expected an array of {{\"role\", \"content\"}} objects.",
                         "messages", "invalid_type")
    if not msgs:
        raise BadRequest("messages is empty: give at least one message.", "messages", "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] is {_type_name(m)}: expected an object with role and content.",
                             f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role = {json.dumps(role)}: expected one of {', '.join(ROLES)}.",
                             f"messages[{i}].role", "invalid_value")
        out.append({"role": role, "content": _content(m, i)})
    return out


def parse_common(body: dict, server: "Server", prompt_tokens: int, prompt_param: str) -> dict:
    """The sampling fields shared by both endpoints, checked against the model's context."""
    n = _int(body, "n", default=1)
    if n != 1:
        raise BadRequest(f"n = {n}: this server returns one choice per request; set n to 1.", "n", "invalid_value")
    for name in ("frequency_penalty", "presence_penalty"):
        if _num(body, name, -2.0, 2.0, 0.0) != 0.0:
            raise BadRequest(f"{name} is not supported by this server: leave it at 0.", name, "unsupported_parameter")
    room = server.context - prompt_tokens
    if room < 1:
        raise BadRequest(f"the prompt is {prompt_tokens} tokens: the model's context is {server.context} tokens, "
                         f"with room for at least one new token. Shorten the {prompt_param}.", prompt_param,
                         "context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, 1, server.max_tokens)
    if max_tokens is None:
        max_tokens = min(server.max_tokens, room)
    elif max_tokens > room:
        raise BadRequest(f"{name} = {max_tokens} with a prompt of {prompt_tokens} tokens exceeds the model's context "
                         f"of {server.context} tokens: ask for at most {room}, or shorten the {prompt_param}.", name,
                         "context_length_exceeded")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop = {json.dumps(body.get('stop'))}: expected a non-empty string or an array of up to 4 "
                         f"non-empty strings.", "stop", "invalid_value")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream = {json.dumps(stream)} is {_type_name(stream)}: expected a boolean.", "stream",
                         "invalid_type")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest("stream_options: expected an object such as {\"include_usage\": true}.", "stream_options",
                         "invalid_type")
    return {
        "max_tokens": max_tokens, "stop": stop, "stream": stream,
        "include_usage": bool(opts.get("include_usage", False)),
        "temperature": _num(body, "temperature", 0.0, 2.0, 1.0),
        "top_p": _num(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
        "seed": _int(body, "seed"),
    }


# -- the server ---------------------------------------------------------------------------------
class Server:
    """The API around an Engine: `app` is the Starlette application."""

    def __init__(self, engine: Engine, model_id: str, max_tokens: int | None = None, timeout_s: float = 120.0):
        self.engine, self.tok, self.model_id = engine, engine.tok, model_id
        self.context = engine.context
        self.max_tokens = min(max_tokens or self.context - 1, self.context - 1)
        self.timeout_s = timeout_s
        self.created = int(time.time())
        self.app = self._build()

    def _build(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        routes = [
            Route("/", self.index, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]
        return Starlette(routes=routes, exception_handlers={404: self._not_found, 405: self._not_allowed})

    # -- plain routes
    async def index(self, request):
        from starlette.responses import HTMLResponse

        page = resources.files("lmforge.serve").joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(page)

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok", "model": self.model_id, **self.engine.stats()})

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "lmforge",
             "context_length": self.context}]})

    async def _not_found(self, request, exc):
        return self._error(BadRequest(f"no route {request.url.path}: see /v1/models, /v1/chat/completions, "
                                      f"/v1/completions, /health.", None, "not_found", 404))

    async def _not_allowed(self, request, exc):
        return self._error(BadRequest(f"{request.method} is not allowed on {request.url.path}.", None,
                                      "method_not_allowed", 405))

    def _error(self, e: BadRequest):
        from starlette.responses import JSONResponse

        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    # -- generation routes
    async def chat(self, request):
        return await self._generate(request, chat=True)

    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def _body(self, request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the request body is not valid JSON ({exc}); send a JSON object.", None,
                             "invalid_json") from None
        if not isinstance(body, dict):
            raise BadRequest(f"the request body is {_type_name(body)}: expected a JSON object.", None, "invalid_json")
        return body

    def _prompt(self, body: dict, chat: bool) -> list[int]:
        if chat:
            return self.tok.render_chat(parse_messages(body), add_generation_prompt=True).ids
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest(f"prompt is {_type_name(prompt)}: expected a string (one prompt per request).", "prompt",
                             "invalid_type" if prompt is not None else "missing_required_parameter")
        return self.tok.encode_prompt(prompt)

    async def _generate(self, request, chat: bool):
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            body = await self._body(request)
            prompt = self._prompt(body, chat)
            opts = parse_common(body, self, len(prompt), "messages" if chat else "prompt")
        except BadRequest as e:
            return self._error(e)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req = Request(prompt, opts["max_tokens"], lambda *e: loop.call_soon_threadsafe(events.put_nowait, e),
                      temperature=opts["temperature"], top_p=opts["top_p"], stop=opts["stop"], seed=opts["seed"],
                      timeout_s=self.timeout_s)
        try:
            self.engine.submit(req)
        except QueueFull as exc:
            return self._error(BadRequest(str(exc), None, "queue_full", 429, "rate_limit_error"))
        rid = request_id("chatcmpl" if chat else "cmpl")
        if opts["stream"]:
            return StreamingResponse(self._stream(req, events, rid, chat, opts["include_usage"]),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, ev = [], None
        try:
            while True:
                ev = await events.get()
                if ev[0] == "delta":
                    text.append(ev[1])
                else:
                    break
        finally:
            req.cancel()  # a no-op once finished; frees the row if this handler was cancelled
        if ev[0] == "error":
            status = 504 if ev[2] == "timeout" else 500
            return self._error(BadRequest(ev[1], None, ev[2], status, ev[2] if ev[2] == "timeout" else "server_error"))
        _, reason, n_prompt, n_completion = ev
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}
        reply = "".join(text)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": reply}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": reply, "logprobs": None, "finish_reason": reason}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model_id, "choices": [choice],
                             "usage": usage})

    async def _stream(self, req: Request, events: asyncio.Queue, rid: str, chat: bool, include_usage: bool):
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: dict | str, reason: str | None = None, usage: dict | None = None, choices=True) -> str:
            if chat:
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                c = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
            body = {"id": rid, "object": obj, "created": created, "model": self.model_id,
                    "choices": [c] if choices else []}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            while True:
                ev = await events.get()
                if ev[0] == "delta":
                    yield chunk({"content": ev[1]} if chat else ev[1])
                    continue
                if ev[0] == "error":
                    yield f"data: {json.dumps(error_body(ev[1], ev[2], None, ev[2]))}\n\n"
                else:
                    _, reason, n_prompt, n_completion = ev
                    yield chunk({} if chat else "", reason)
                    if include_usage:
                        yield chunk({}, None, {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                                               "total_tokens": n_prompt + n_completion}, choices=False)
                yield "data: [DONE]\n\n"
                return
        finally:
            req.cancel()  # the client went away mid-stream (or we are done): free the row
