"""A request of the OpenAI-compatible API, before any work (lmforge.serve.api runs the routes):
the body parsed strictly, its fields checked by name, the messages and the sampling fields read.

Limits before work: the Host header is checked first (421, see app.py), a POST must be
`Content-Type: application/json` (415), its body at most `max_body_bytes` (413, read no
further), then the body is parsed off the event loop (strict UTF-8, no NaN/Infinity, no
duplicate keys, integers of at most MAX_INT_DIGITS digits, nesting at most MAX_DEPTH, no
lone surrogates anywhere), and the prompt is tokenized off the event loop. Messages are
checked by the SFT path's validator (`data.conversations.validate_messages`), sampling
limits by `SamplingConfig.validate` (lmforge.config). Fields this server does not
implement (`tools`, `logprobs`, `n` > 1, ...) and unknown fields are refused by name.
"""

from __future__ import annotations

import json
import math
from typing import Any

from lmforge.config import SamplingConfig
from lmforge.data.conversations import validate_messages
from lmforge.errors import ConfigError, LmforgeError

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
#: Fields /v1/completions implements for scoring a prompt (lmforge.serve.echo), neutral in chat.
COMPLETION_SCORING = ("echo", "logprobs")
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
def short(v: Any, limit: int = 80) -> str:
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
        raise BadRequest(f"the request body is {type_name(body)}: expected a JSON object.", None, "invalid_json")
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
def type_name(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} = {short(v)} is {type_name(v)}: expected an integer.", name, "invalid_type")
    if lo is not None and v < lo or hi is not None and v > hi:
        want = f"<= {hi}" if lo is None else f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"{name} = {short(v)}: expected an integer {want}.", name, "invalid_value")
    return v


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"{name} = {short(v)} is {type_name(v)}: expected a finite number.", name, "invalid_type")
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
        if v is None or name not in known or (not chat and name in COMPLETION_SCORING):
            continue
        if not any(type(v) is type(d) and v == d for d in neutral):
            ok = f"leave it out{' or set it to ' + ' / '.join(map(json.dumps, neutral)) if neutral else ''}"
            raise BadRequest(f"{name} = {short(v)} is not supported by this server ({ok}).", name,
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


def parse_common(body: dict, server: Any, prompt_tokens: int, prompt_param: str) -> dict:
    """The sampling fields shared by both endpoints: types here, limits by
    `SamplingConfig.validate`, the context and the server's --max-tokens here (`server`: the
    `lmforge.serve.api.Server`, its `context` and `max_tokens`)."""
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
        raise BadRequest(f"stop = {short(body.get('stop'))}: expected a non-empty string or an array of up to 4 "
                         f"non-empty strings.", "stop", "invalid_value")
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(f"stream = {short(stream)} is {type_name(stream)}: expected a boolean.", "stream",
                         "invalid_type")
    opts = body.get("stream_options")
    opts = {} if opts is None else opts
    if not isinstance(opts, dict) or any(k != "include_usage" for k in opts):
        raise BadRequest(f"stream_options = {short(opts)}: expected an object such as {{\"include_usage\": true}}.",
                         "stream_options", "invalid_type")
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest(f"stream_options.include_usage = {short(include_usage)} is {type_name(include_usage)}: "
                         f"expected a boolean.", "stream_options.include_usage", "invalid_type")
    for key in ("model", "user"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise BadRequest(f"{key} = {short(body[key])} is {type_name(body[key])}: expected a string.", key,
                             "invalid_type")
    return {
        "max_tokens": max_tokens, "stop": stop, "stream": stream, "include_usage": include_usage,
        "temperature": temperature, "top_p": top_p, "seed": _int(body, "seed", *SEED_RANGE),
    }
