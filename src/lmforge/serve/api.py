"""The OpenAI-compatible HTTP API of `lmforge serve` (Starlette, run by uvicorn).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
and the chat page at / (one static file, package data). Streaming answers are server-sent
events in OpenAI's chunk format, ending with `data: [DONE]`.

Chat messages are rendered with the checkpoint's chat template
(`Tokenizer.render_chat(..., add_generation_prompt=True)`); completions prompts are a
document start (<|bos|> + text), as `lmforge generate`, or token ids taken as they are; with
`"echo": true` a completions request scores its prompts instead (lmforge.serve.echo: the
prompt tokens' log-probabilities, what evaluation harnesses send). Replies stop at the contract's
end-of-turn and end-of-text ids. `usage` counts tokens with the model's own tokenizer:
prompt tokens as fed, completion tokens as generated (the stop id included).

Limits before work: the Host header is checked first (421, see app.py); the body and its fields are
read by lmforge.serve.request (its docstring lists the limits: content type, size, strict JSON,
depth, the fields by name).

Every bad request gets a 4xx with an OpenAI-style body `{"error": {"message", "type",
"param", "code"}}` naming the field; a full queue a 429; a request past its deadline a 504
(or an error event when streaming); anything unexpected a JSON 500 (a bug). Nothing a
client sends stops the server.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources

from lmforge.data.records import check_text
from lmforge.errors import LmforgeError
from lmforge.serve.echo import echo_response, token_prompts
from lmforge.serve.engine import Engine, QueueFull, Request, request_id
from lmforge.serve.request import (MAX_DEPTH, MAX_INT_DIGITS, BadRequest, type_name, check_fields,
                                   error_body, error_response, parse_body, parse_common, parse_messages)

# -- the server ---------------------------------------------------------------------------------
class HostCheck:
    """ASGI middleware: answer only requests whose Host header names this server (DNS
    rebinding: a web page's own name resolving to 127.0.0.1). A name in `names` matches with
    the served port (from the connection; a bare name for port 80); a "name:port" entry
    matches as is; "*" matches any. Anything else gets a 421 with an OpenAI error body.
    (Starlette's TrustedHostMiddleware ignores the port, cannot parse "[::1]:port" and answers
    in plain text.)"""

    def __init__(self, app, names: list[str]):
        self.app, self.names = app, frozenset(n.lower() for n in names)

    def allowed(self, scope) -> bool:
        if "*" in self.names:
            return True
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
        name, colon, port = host.rpartition(":")
        if not colon or name.startswith("[") and not name.endswith("]") or host.endswith("]"):
            name, port = host, ""  # no port ("[::1]" has colons of its own)
        served = scope.get("server") or (None, None)
        if name in self.names and (port == str(served[1]) or (port == "" and served[1] == 80)):
            return True
        return bool(port) and host in self.names  # an entry "name:port" given as is

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not self.allowed(scope):
            host = dict(scope["headers"]).get(b"host", b"(none)").decode("latin-1")
            e = BadRequest(f"Host {host!a} is not a name this server answers to ({', '.join(sorted(self.names))}, "
                           f"with its port): start it with --allowed-hosts to add names.", None, "invalid_host", 421)
            return await error_response(e)(scope, receive, send)
        return await self.app(scope, receive, send)


class Server:
    """The API around an Engine: `app` is the Starlette application.

    Args:
        allowed_hosts: Host names served (see HostCheck); cors_origins: origins given CORS
        headers (none: no CORS header is ever sent); max_body_bytes: larger bodies get a 413.
    """

    def __init__(self, engine: Engine, model_id: str, max_tokens: int | None = None, timeout_s: float = 120.0,
                 allowed_hosts: list[str] = ("localhost", "127.0.0.1", "[::1]"), cors_origins: list[str] = (),
                 max_body_bytes: int = 4 * 1024 * 1024):
        self.engine, self.tok, self.model_id = engine, engine.tok, model_id
        self.context = engine.context
        self.max_tokens = min(max_tokens or self.context - 1, self.context - 1)
        self.timeout_s = timeout_s
        self.allowed_hosts, self.cors_origins = list(allowed_hosts), list(cors_origins)
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.app = self._build()

    def _build(self):
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware
        from starlette.routing import Route

        routes = [
            Route("/", self.index, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]
        middleware = [Middleware(HostCheck, names=self.allowed_hosts)]
        if self.cors_origins:
            middleware.append(Middleware(CORSMiddleware, allow_origins=self.cors_origins,
                                         allow_methods=["GET", "POST"], allow_headers=["Content-Type",
                                                                                       "Authorization"]))
        return Starlette(routes=routes, middleware=middleware,
                         exception_handlers={404: self._not_found, 405: self._not_allowed, Exception: self._crash})

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
        return error_response(BadRequest(f"no route {request.url.path!a}: see /v1/models, /v1/chat/completions, "
                                         f"/v1/completions, /health.", None, "not_found", 404))

    async def _not_allowed(self, request, exc):
        return error_response(BadRequest(f"{request.method} is not allowed on {request.url.path!a}.", None,
                                         "method_not_allowed", 405))

    async def _crash(self, request, exc):
        """The catch-all: an exception no check foresaw (a bug) is a JSON 500, never plain text."""
        return error_response(BadRequest(f"the server failed on this request ({type(exc).__name__}); this is a bug "
                                         f"in lmforge serve: please report it with the request.", None,
                                         "server_error", 500, "server_error"))

    # -- generation routes
    async def chat(self, request):
        return await self._generate(request, chat=True)

    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def _read(self, request) -> bytes:
        """The body, refused (413) past max_body_bytes before it is all read."""
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise BadRequest(f"Content-Type {media or '(none)'!a}: expected application/json.", None,
                             "unsupported_media_type", 415)
        too_big = BadRequest(f"the request body is larger than the server's limit of {self.max_body_bytes} bytes "
                             f"(--max-body-bytes): send a shorter prompt.", None, "request_too_large", 413)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def _parse(self, raw: bytes, chat: bool) -> tuple[dict, list[int]]:
        """Body, fields and prompt ids (run in a worker thread: parsing and tokenizing are
        linear in the body, up to max_body_bytes, and must not stall the event loop)."""
        body = parse_body(raw)
        check_fields(body, chat)
        if chat:
            msgs = parse_messages(body)
            try:
                return body, self.tok.render_chat(msgs, add_generation_prompt=True).ids
            except LmforgeError as exc:  # the template refuses, a special token spelled out
                raise BadRequest(f"messages: {exc}", "messages", "invalid_value") from None
        if body.get("logprobs") not in (None, False, 0) and body.get("echo") is not True:
            raise BadRequest("logprobs without \"echo\": true is not implemented (the log-probabilities of generated "
                             "tokens); send \"echo\": true to score a prompt, or leave logprobs out.", "logprobs",
                             "unsupported_parameter")
        if body.get("echo") not in (None, False, True):
            raise BadRequest(f"echo = {type_name(body['echo'])}: expected a boolean.", "echo", "invalid_type")
        if body.get("echo") is True:
            return body, []  # scoring: the prompts are read by lmforge.serve.echo
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            try:
                return body, self.tok.encode_prompt(check_text(prompt, "prompt", "the text"))
            except LmforgeError as exc:
                raise BadRequest(f"prompt: {exc}", "prompt", "invalid_value") from None
        return body, token_prompts(prompt, self.tok, self.engine.model.config.vocab_size, self.context, many=False)[0][0]

    async def _generate(self, request, chat: bool):
        from starlette.requests import ClientDisconnect
        from starlette.responses import JSONResponse, Response, StreamingResponse

        try:
            body, prompt = await asyncio.to_thread(self._parse, await self._read(request), chat)
            if not chat and body.get("echo") is True:
                if body.get("stream"):
                    raise BadRequest("\"echo\": true is answered whole: send \"stream\": false.", "stream",
                                     "unsupported_parameter")
                return JSONResponse(await asyncio.to_thread(echo_response, body, self.engine.model, self.tok,
                                                            self.model_id, request_id("cmpl")))
            opts = parse_common(body, self, len(prompt), "messages" if chat else "prompt")
        except BadRequest as e:
            return error_response(e)
        except ClientDisconnect:
            return Response(status_code=400)  # nobody is listening
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req = Request(prompt, opts["max_tokens"], lambda *e: loop.call_soon_threadsafe(events.put_nowait, e),
                      temperature=opts["temperature"], top_p=opts["top_p"], stop=opts["stop"], seed=opts["seed"],
                      timeout_s=self.timeout_s)
        try:
            self.engine.submit(req)
        except QueueFull as exc:
            return error_response(BadRequest(str(exc), None, "queue_full", 429, "rate_limit_error"))
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
            return error_response(BadRequest(ev[1], None, ev[2], status,
                                             ev[2] if ev[2] == "timeout" else "server_error"))
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


__all__ = ["BadRequest", "HostCheck", "MAX_DEPTH", "MAX_INT_DIGITS", "Server"]
