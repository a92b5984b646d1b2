"""Building and running the server: limits checked, the socket bound, the Host check, CORS,
and an HTTP protocol that cuts clients too slow to send or to read.

Why these defences (a page in the user's browser must not drive or read a local server):
  - Host check: a DNS-rebinding page reaches 127.0.0.1 under its own name; every request
    whose Host header is not one of the served names (loopback names by default) with the
    served port gets a 421 with an OpenAI error body. Bound to a wildcard address (0.0.0.0,
    ::) the server starts only with `--allowed-hosts` (names, or '*' to accept any Host).
  - POST needs `Content-Type: application/json` (415 otherwise, see api.py): a cross-site
    form or `fetch` without a CORS preflight cannot send it.
  - No CORS headers unless `--cors-origin` names origins (Starlette's CORSMiddleware).
  - `--io-timeout`: a request's headers and body must arrive within it (a 408, then the
    connection is closed), and a response write that the client does not read within it
    cuts the connection (the engine then frees the request's row).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys

from lmforge.errors import LmforgeError, require_package
from lmforge.runtime import Runtime, decode_runtime

#: Host names a loopback server answers to by default.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
#: Default request body limit (bytes): `--max-body-bytes`.
MAX_BODY_BYTES = 4 * 1024 * 1024
#: Default seconds a client may take to send a request or to read a response write.
IO_TIMEOUT_S = 30.0
#: The transport's write buffer above which the protocol waits for the client (then the
#: write timeout runs): small, so a client that does not read is noticed after little output.
WRITE_HIGH_WATER = 16 * 1024


class ServeError(LmforgeError):
    """Bad `lmforge serve` input (a port, a limit, a host list) or a missing server package."""


def require_server_packages() -> None:
    """Raises ServeError naming the missing package (starlette or uvicorn) and the extra that
    installs it (`lmforge.errors.require_package`)."""
    for module in ("starlette", "uvicorn"):
        require_package(module, "serve", "lmforge serve", ServeError)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host == ""


def host_names(host: str, allowed_hosts: list[str] | None) -> list[str]:
    """The Host header names the server answers to when bound to `host`.

    Loopback: LOOPBACK_HOSTS plus `allowed_hosts`. Another address: that address, plus
    `allowed_hosts`. A wildcard address: `allowed_hosts` only, which must be given ('*' = any).

    Raises:
        ServeError: a wildcard address without --allowed-hosts; an empty name.
    """
    extra = [h.strip().lower() for h in allowed_hosts or []]
    if any(not h for h in extra):
        raise ServeError(f"--allowed-hosts = {','.join(allowed_hosts)!r}: expected comma-separated host names "
                         f"(e.g. 'myhost.lan,192.168.1.5'), or '*' to accept any Host header.")
    if is_wildcard(host):
        if not extra:
            raise ServeError(f"--host {host} listens on every interface: give --allowed-hosts with the names "
                             f"clients use to reach this machine (e.g. --allowed-hosts myhost.lan,192.168.1.5), "
                             f"or --allowed-hosts '*' to accept any Host header (a web page could then reach "
                             f"the API through DNS rebinding).")
        return extra
    own = [f"[{host}]" if ":" in host else host.lower()]
    base = list(LOOPBACK_HOSTS) if is_loopback(host) else own
    return base + [h for h in extra if h not in base]


def build_server(model, tok, model_id: str, max_batch: int = 16, max_queue: int = 64,
                 max_tokens: int | None = None, timeout_s: float = 120.0, runtime: Runtime | None = None,
                 allowed_hosts: list[str] | None = None, cors_origins: list[str] | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES):
    """A started Engine wrapped in a `Server` (its `.app` is the ASGI application).

    Args:
        runtime: where and in what precision the engine decodes (default `decode_runtime()`).
        allowed_hosts: Host header names served (port = the served port); default the loopback
            names; '*' accepts any. See `host_names` for what `lmforge serve` passes.
        cors_origins: origins given CORS headers (default none).
        max_body_bytes: request bodies above it get a 413.

    Raises:
        ServeError: a limit out of range.
    """
    from lmforge.serve.api import Server
    from lmforge.serve.engine import Engine

    checks = [("--max-batch", max_batch, max_batch >= 1, ">= 1"), ("--max-queue", max_queue, max_queue >= 1, ">= 1"),
              ("--max-tokens", max_tokens, max_tokens is None or max_tokens >= 1, ">= 1"),
              ("--timeout", timeout_s, timeout_s > 0, "> 0 (seconds)"),
              ("--max-body-bytes", max_body_bytes, max_body_bytes >= 1024, ">= 1024 (bytes)")]
    for name, value, ok, want in checks:
        if not ok:
            raise ServeError(f"{name} = {value}: expected a value {want}.")
    runtime = runtime if runtime is not None else decode_runtime()
    engine = Engine(model, tok, max_batch, max_queue, runtime=runtime).start()
    return Server(engine, model_id, max_tokens, timeout_s, allowed_hosts=allowed_hosts or list(LOOPBACK_HOSTS),
                  cors_origins=cors_origins or [], max_body_bytes=max_body_bytes)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one).

    Raises:
        ServeError: the port is out of range or taken, or the host cannot be bound.
    """
    if not 0 <= port <= 65535:
        raise ServeError(f"--port = {port}: expected 0..65535 (0 picks a free port).")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): choose another --port, or "
                         f"--host 127.0.0.1.") from None
    return sock


def guarded_protocol(io_timeout_s: float):
    """uvicorn's h11 protocol with two timers (an h11 subclass: uvicorn itself bounds only the
    idle time between keep-alive requests; the timers are `_ProtocolGuards`'):

      - request timer, armed when the connection opens and at the first byte of each later
        request: the request's headers and body must be in within `io_timeout_s`, else a 408
        (OpenAI error body) and the connection is closed (slowloris: headers or body trickled;
        a connection that sent nothing is closed silently);
      - write timer, armed while the transport's buffer is above its high-water mark: a client
        that reads nothing for `io_timeout_s` is cut (the streaming handler sees the disconnect
        and cancels its request, freeing the engine's row).
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(_ProtocolGuards, H11Protocol):
        _guard_h11 = h11
        _guard_s = io_timeout_s
        _timeout_response = _raw_error_response(
            "408 Request Timeout", f"the request was not received within the server's I/O timeout of "
            f"{io_timeout_s:g} s (--io-timeout); send it at once.", "request_timeout")
        _invalid_response = _raw_error_response(
            "400 Bad Request", "the request is not valid HTTP/1.1 (request line or headers malformed, or "
            "headers over 16 KiB).", "invalid_http")

    return GuardedH11Protocol


def _raw_error_response(status: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response with the OpenAI error body, closing the connection
    (written straight to the transport: h11 cannot answer a request it has not parsed)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n"
            b"\r\n%s" % (status.encode(), len(body), body))


class _ProtocolGuards:
    """The request and write timers of `guarded_protocol`'s protocol, mixed in before uvicorn's
    H11Protocol. The subclass there sets `_guard_h11` (the h11 module), `_guard_s` (the I/O
    timeout, seconds) and the raw 408 / 400 responses (`_timeout_response`, `_invalid_response`)."""

    _request_timer = None
    _write_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self._arm_request()

    def connection_lost(self, exc) -> None:
        self._disarm("_request_timer")
        self._disarm("_write_timer")
        super().connection_lost(exc)

    def _disarm(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _arm_request(self) -> None:
        self._disarm("_request_timer")
        self._request_timer = self.loop.call_later(self._guard_s, self._request_timed_out)

    def _request_timed_out(self) -> None:
        self._request_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
            self.transport.abort()
            return
        if self.conn.their_state is self._guard_h11.IDLE and not self.conn.trailing_data[0]:
            self.transport.close()  # a connection that never said anything: nobody to answer
            return
        self.transport.write(self._timeout_response)
        self.transport.close()

    def send_400_response(self, msg: str) -> None:  # uvicorn's is plain text
        self.transport.write(self._invalid_response)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._request_timer is None and self.conn.their_state is self._guard_h11.IDLE:
            self._arm_request()  # the first bytes of a keep-alive connection's next request
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        h11 = self._guard_h11
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
            self._disarm("_request_timer")

    def on_response_complete(self) -> None:
        super().on_response_complete()  # idle keep-alive connections: uvicorn's own timer
        if not self.transport.is_closing() and self.conn.their_state is self._guard_h11.SEND_BODY:
            self._arm_request()  # answered early (413, 415): the rest of the body must come in time

    def pause_writing(self) -> None:
        super().pause_writing()
        self._disarm("_write_timer")
        self._write_timer = self.loop.call_later(self._guard_s, self._write_timed_out)

    def resume_writing(self) -> None:
        self._disarm("_write_timer")
        super().resume_writing()

    def _write_timed_out(self) -> None:
        self._write_timer = None
        self.transport.abort()


def uvicorn_config(app, io_timeout_s: float = IO_TIMEOUT_S):
    """The uvicorn config every server runs with (the guarded h11 protocol, no lifespan)."""
    import uvicorn

    if not io_timeout_s > 0:
        raise ServeError(f"--io-timeout = {io_timeout_s}: expected a value > 0 (seconds).")
    return uvicorn.Config(app, http=guarded_protocol(io_timeout_s), log_level="warning", lifespan="off",
                          timeout_keep_alive=min(5, io_timeout_s))


def run_server(model, tok, model_id: str, sock: socket.socket, max_batch: int = 16, max_queue: int = 64,
               max_tokens: int | None = None, timeout_s: float = 120.0, runtime: Runtime | None = None,
               allowed_hosts: list[str] | None = None, cors_origins: list[str] | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, io_timeout_s: float = IO_TIMEOUT_S) -> None:
    """Serve a loaded model on the bound socket `sock` until interrupted (`lmforge serve`;
    the stage in `lmforge.stages.serve` loads the checkpoint and binds first).

    Raises:
        ServeError: see `build_server`, `host_names` and `uvicorn_config`.
    """
    require_server_packages()
    import uvicorn

    host = sock.getsockname()[0]
    names = host_names(host, allowed_hosts)
    server = build_server(model, tok, model_id, max_batch, max_queue, max_tokens, timeout_s, runtime, names,
                          cors_origins, max_body_bytes)
    try:
        config = uvicorn_config(server.app, io_timeout_s)
        bound = sock.getsockname()[1]
        if not is_loopback(host):
            print(f"serve: warning: listening on {host}, reachable from other machines; the API has no "
                  f"authentication (use --host 127.0.0.1 to keep it local).", file=sys.stderr)
        print(f"serve: {model_id} ({model.num_parameters():,} parameters, context {server.context}, "
              f"{server.engine.runtime.label}) on http://{host}:{bound}/ (chat page), http://{host}:{bound}/v1 "
              f"(OpenAI API); Host names served: {', '.join(names)}; Ctrl-C stops", file=sys.stderr, flush=True)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        server.engine.close()
        sock.close()


__all__ = ["IO_TIMEOUT_S", "LOOPBACK_HOSTS", "MAX_BODY_BYTES", "ServeError", "bind", "build_server",
           "guarded_protocol", "host_names", "is_loopback", "require_server_packages", "run_server",
           "uvicorn_config"]
