"""The OpenAI-compatible HTTP API of `lmforge serve` (Starlette, run by uvicorn).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
and the chat page at / (one static file, package data). Streaming answers are server-sent
events in OpenAI's chunk format, ending with `data: [DONE]`.

Chat messages are rendered with the checkpoint's chat template
(`Tokenizer.render_chat(..., add_generation_prompt=True)`); completions prompts are a
document start (<|bos|> + text), as `lmforge generate`. Replies stop at the contract's
end-of-turn and end-of-text ids. `usage` counts tokens with the model's own tokenizer:
prompt tokens as fed, completion tokens as generated (the stop id included).

Limits before work: the Host header is checked first (421, see app.py), a POST must be
`Content-Type: application/json` (415), its body at most `max_body_bytes` (413, read no
further), then the body is parsed off the event loop (strict UTF-8, no NaN/Infinity, no
duplicate keys, integers of at most MAX_INT_DIGITS digits, nesting at most MAX_DEPTH, no
lone surrogates anywhere), and the prompt is tokenized off the event loop. Messages are
checked by the SFT path's validator (`data.conversations.validate_messages`), sampling
limits by `SamplingConfig.validate` (lmforge.config). Fields this server does not
implement (`tools`, `logprobs`, `n` > 1, ...) and unknown fields are refused by name.

Every bad request gets a 4xx with an OpenAI-style body `{"error": {"message", "type",
"param", "code"}}` naming the field; a full queue a 429; a request past its deadline a 504
(or an error event when streaming); anything unexpected a JSON 500 (a bug). Nothing a
client sends stops the server.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from importlib import resources
from typing import Any

from lmforge.config import SamplingConfig
from lmforge.data.conversations import validate_messages
from lmforge.data.records import check_text
from lmforge.errors import ConfigError, LmforgeError
from lmforge.serve.engine import Engine, QueueFull, Request, request_id

#: The deepest nesting of arrays/objects a request body may have.
MAX_DEPTH = 32
#: The most digits an integer literal in a request body may have (2**64 has 20).
MAX_INT_DIGITS = 40
#: The range of `seed` (a signed 64-bit integer, as OpenAI's API documents it).
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)

#: Fields both endpoints implement.
COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "stop", "stream", "stream_options", "seed", "user")
#: Fields of OpenAI's API this server does not implement: accepted only at these values
#: (null is always accepted), refused by name otherwise.
NEUTRAL = {
    "n": (1,), "logprobs": (False, 0), "top_logprobs": (0,), "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",),
    "parallel_tool_calls": (), "functions": ([],), "function_call": ("none",),
    "response_format": ({"type": "text"},), "modalities": (["text"],), "audio": (), "prediction": (),
    "reasoning_effort": (), "service_tier": ("auto", "default"), "store": (False,), "metadata": (),
    "web_search_options": (), "best_of": (1,), "echo": (False,), "suffix": ("",),
}
CHAT_FIELDS = frozenset((*COMMON_FIELDS, "messages", "max_completion_tokens", *NEUTRAL))
COMPLETION_FIELDS = frozenset((*COMMON_FIELDS, "prompt", *NEUTRAL))
MESSAGE_KEYS = ("role", "content")


class BadRequest(Exception):
    """A request the API refuses: rendered as an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: BadRequest, headers: dict | None = None):
    """The OpenAI error body as a JSON response (ASCII-escaped: safe whatever text it quotes)."""
    from starlette.responses import Response

    return Response(json.dumps(error_body(e.message, e.type, e.param, e.code)), e.status, headers,
                    media_type="application/json")


# -- the body -----------------------------------------------------------------------------------
def _short(v: Any, limit: int = 80) -> str:
    text = json.dumps(v)
    return text if len(text) <= limit else text[:limit] + "..."


class _Literal:
    """A JSON literal the API refuses (NaN, Infinity, an integer of too many digits), kept in
    the parsed tree so the walk that follows can name the field holding it."""

    def __init__(self, text: str, why: str):
        self.text, self.why = text, why


class _Object(dict):
    """A parsed JSON object; `repeated`: a key given twice in it (named by the walk)."""

    repeated: str | None = None


def _constant(name: str) -> _Literal:
    return _Literal(name, "a literal JSON does not allow: send a finite number")


def _int_literal(text: str):
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _Literal(f"{text[:12]}... ({digits} digits)", f"an integer longer than {MAX_INT_DIGITS} digits")
    return int(text)


def _object(pairs: list) -> _Object:
    out = _Object()
    for k, v in pairs:
        if k in out and out.repeated is None:
            out.repeated = k
        out[k] = v
    return out


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object (run off the event loop: it is linear in the body).

    Raises:
        BadRequest: empty; not UTF-8; not JSON; nested deeper than the parser's stack; not an
        object; and, naming the field: a NaN/Infinity literal, an integer longer than
        MAX_INT_DIGITS, a non-finite number (1e999), a repeated key, nesting deeper than
        MAX_DEPTH, a string (key or value) holding a lone surrogate.
    """
    if not raw.strip():
        raise BadRequest("the request body is empty: send a JSON object.", None, "invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not UTF-8 (byte {raw[exc.start]:#04x} at offset {exc.start}): "
                         f"send UTF-8 JSON.", None, "invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_constant, parse_int=_int_literal, object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc}); send a JSON object.", None,
                         "invalid_json") from None
    except RecursionError:
        raise BadRequest(f"the request body is nested too deeply to parse: expected at most {MAX_DEPTH} levels.",
                         None, "invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body is {_type_name(body)}: expected a JSON object.", None, "invalid_json")
    _check_tree(body)
    return body


def _check_tree(body: dict) -> None:
    """Refuse, naming the field, what `parse_body` kept for here (see its docstring); walked
    without recursion."""
    todo: list[tuple[Any, str, int]] = [(body, "", 1)]
    while todo:
        v, path, depth = todo.pop()
        field = path or None
        where = path or "the request body"
        if isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
                top = path.split(".")[0].split("[")[0]
                raise BadRequest(f"{top} holds arrays/objects nested {depth} levels deep: expected at most "
                                 f"{MAX_DEPTH}.", top, "invalid_value")
            if isinstance(v, _Object) and v.repeated is not None:
                key = json.dumps(v.repeated)
                raise BadRequest(f"{where} gives the key {key} twice: give each key once.",
                                 f"{path}.{v.repeated}" if path else v.repeated, "invalid_value")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    _check_text(k, f"a key of {where}", field)
                    sub = f"{path}.{k}" if path else k
                else:
                    sub = f"{path}[{k}]"
                todo.append((x, sub, depth + 1))
        elif isinstance(v, str):
            _check_text(v, where, field)
        elif isinstance(v, _Literal):
            raise BadRequest(f"{where} = {v.text}: {v.why}.", field, "invalid_value")
        elif isinstance(v, float) and not math.isfinite(v):
            raise BadRequest(f"{where} is a number too large for a double ({v}): send a finite number.", field,
                             "invalid_value")


def _check_text(s: str, where: str, field: str | None) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = where.encode("ascii", "backslashreplace").decode()
        field = field.encode("ascii", "backslashreplace").decode() if field else None
        raise BadRequest(f"{where} holds a lone surrogate ({s[exc.start]!a} at character {exc.start}), which is "
                         f"not text: send valid Unicode.", field, "invalid_value") from None


# -- the fields ---------------------------------------------------------------------------------
def _type_name(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} = {_short(v)} is {_type_name(v)}: expected an integer.", name, "invalid_type")
    if lo is not None and v < lo or hi is not None and v > hi:
        want = f"<= {hi}" if lo is None else f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"{name} = {_short(v)}: expected an integer {want}.", name, "invalid_value")
    return v


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"{name} = {_short(v)} is {_type_name(v)}: expected a finite number.", name, "invalid_type")
    return float(v)


def check_fields(body: dict, chat: bool) -> None:
    """Refuse, by name, unknown fields and implemented-elsewhere fields at a non-neutral value."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise BadRequest(f"unrecognized request argument{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(json.dumps, unknown))}: this server implements "
                         f"{', '.join(sorted(k for k in known if k not in NEUTRAL))}.", unknown[0],
                         "unsupported_parameter")
    for name, neutral in NEUTRAL.items():
        v = body.get(name)
        if v is None or name not in known:
            continue
        if not any(type(v) is type(d) and v == d for d in neutral):
            ok = f"leave it out{' or set it to ' + ' / '.join(map(json.dumps, neutral)) if neutral else ''}"
            raise BadRequest(f"{name} = {_short(v)} is not supported by this server ({ok}).", name,
                             "unsupported_parameter")


def parse_messages(body: dict) -> list[dict]:
    """The chat messages, checked by the SFT path's validator (`validate_messages`: roles,
    text content) after content given as text parts is joined and keys other than role and
    content are refused.

    Raises:
        BadRequest: naming `messages` (the validator's message names the message) or
        `messages[i].<key>`.
    """
    msgs = body.get("messages")
    if isinstance(msgs, list):
        flat = []
        for i, m in enumerate(msgs):
            if isinstance(m, dict):
                extra = sorted(k for k in m if k not in MESSAGE_KEYS)
                if extra:
                    raise BadRequest(f"messages[{i}] has {', '.join(map(json.dumps, extra))}: this server reads "
                                     f"only {' and '.join(MESSAGE_KEYS)}; leave the rest out.",
                                     f"messages[{i}].{extra[0]}", "unsupported_parameter")
                m = {**m, "content": _content(m.get("content"), f"messages[{i}]")}
            flat.append(m)
        msgs = flat
    try:
        return list(validate_messages(msgs, "messages", require_reply=False))
    except LmforgeError as exc:
        raise BadRequest(str(exc), "messages", "missing_required_parameter" if msgs is None else
                         "invalid_value") from None


def _content(c: Any, where: str) -> Any:
    if isinstance(c, list):  # [{"type": "text", "text": ...}, ...]: text parts only
        parts = []
        for j, part in enumerate(c):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRequest(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": "
                                 f"...}}) are supported.", f"{where}.content", "invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    return c


def parse_common(body: dict, server: "Server", prompt_tokens: int, prompt_param: str) -> dict:
    """The sampling fields shared by both endpoints: types here, limits by
    `SamplingConfig.validate`, the context and the server's --max-tokens here."""
    room = server.context - prompt_tokens
    if room < 1:
        raise BadRequest(f"the prompt is {prompt_tokens} tokens: the model's context is {server.context} tokens, "
                         f"with room for at least one new token. Shorten the {prompt_param}.", prompt_param,
                         "context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, hi=server.max_tokens)
    temperature, top_p = _num(body, "temperature", 1.0), _num(body, "top_p", 1.0)
    try:
        SamplingConfig(max_new_tokens=max_tokens if max_tokens is not None else 1, temperature=temperature, top_k=0,
                       top_p=top_p, greedy=temperature == 0).validate("", {"max_new_tokens": name})
    except ConfigError as exc:
        raise BadRequest(str(exc), exc.field, "invalid_value") from None
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
        raise BadRequest(f"stop = {_short(body.get('stop'))}: expected a non-empty string or an array of up to 4 "
                         f"non-empty strings.", "stop", "invalid_value")
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(f"stream = {_short(stream)} is {_type_name(stream)}: expected a boolean.", "stream",
                         "invalid_type")
    opts = body.get("stream_options")
    opts = {} if opts is None else opts
    if not isinstance(opts, dict) or any(k != "include_usage" for k in opts):
        raise BadRequest(f"stream_options = {_short(opts)}: expected an object such as {{\"include_usage\": true}}.",
                         "stream_options", "invalid_type")
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest(f"stream_options.include_usage = {_short(include_usage)} is {_type_name(include_usage)}: "
                         f"expected a boolean.", "stream_options.include_usage", "invalid_type")
    for key in ("model", "user"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise BadRequest(f"{key} = {_short(body[key])} is {_type_name(body[key])}: expected a string.", key,
                             "invalid_type")
    return {
        "max_tokens": max_tokens, "stop": stop, "stream": stream, "include_usage": include_usage,
        "temperature": temperature, "top_p": top_p, "seed": _int(body, "seed", *SEED_RANGE),
    }


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
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest(f"prompt is {_type_name(prompt)}: expected a string (one prompt per request).", "prompt",
                             "invalid_type" if prompt is not None else "missing_required_parameter")
        try:
            return body, self.tok.encode_prompt(check_text(prompt, "prompt", "the text"))
        except LmforgeError as exc:
            raise BadRequest(f"prompt: {exc}", "prompt", "invalid_value") from None

    async def _generate(self, request, chat: bool):
        from starlette.requests import ClientDisconnect
        from starlette.responses import JSONResponse, Response, StreamingResponse

        try:
            body, prompt = await asyncio.to_thread(self._parse, await self._read(request), chat)
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
