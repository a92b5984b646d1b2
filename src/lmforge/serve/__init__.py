"""`lmforge serve`: an OpenAI-compatible server with continuous batching and a chat page.

    engine.py   the batched decoding engine (one thread owns the model and its KV cache)
    api.py      the HTTP routes (Starlette): /v1/chat/completions, /v1/completions,
                /v1/models, /health, and the chat page (static/index.html) at /
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading

from lmforge.errors import LmforgeError


class ServeError(LmforgeError):
    """Bad `lmforge serve` input (a port, a limit) or a missing server package."""


def require_server_packages() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ServeError(f"lmforge serve needs starlette and uvicorn ({exc.name} is not installed): "
                         f"pip install 'lmforge[serve]'.") from None


def build_server(model, tok, model_id: str, max_batch: int = 16, max_queue: int = 64,
                 max_tokens: int | None = None, timeout_s: float = 120.0):
    """A started Engine wrapped in a `Server` (its `.app` is the ASGI application)."""
    from lmforge.serve.api import Server
    from lmforge.serve.engine import Engine

    checks = [("--max-batch", max_batch, max_batch >= 1, ">= 1"), ("--max-queue", max_queue, max_queue >= 1, ">= 1"),
              ("--max-tokens", max_tokens, max_tokens is None or max_tokens >= 1, ">= 1"),
              ("--timeout", timeout_s, timeout_s > 0, "> 0 (seconds)")]
    for name, value, ok, want in checks:
        if not ok:
            raise ServeError(f"{name} = {value}: expected a value {want}.")
    return Server(Engine(model, tok, max_batch, max_queue).start(), model_id, max_tokens, timeout_s)


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


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class Running:
    """A server running in a background thread (tests, benchmarks): `url`, then `stop()`."""

    def __init__(self, server, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = server
        self.sock = bind(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        import time

        for _ in range(200):  # bounded: up to 10 s for uvicorn to start
            if self.uv.started:
                break
            time.sleep(0.05)

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=10)
        self.server.engine.close()
        self.sock.close()


def run_server(model, tok, model_id: str, sock: socket.socket, max_batch: int = 16, max_queue: int = 64,
               max_tokens: int | None = None, timeout_s: float = 120.0) -> None:
    """Serve a loaded model on the bound socket `sock` until interrupted (`lmforge serve`;
    the stage in `lmforge.stages.serve` loads the checkpoint and binds first)."""
    require_server_packages()
    import uvicorn

    host = sock.getsockname()[0]
    server = build_server(model, tok, model_id, max_batch, max_queue, max_tokens, timeout_s)
    bound = sock.getsockname()[1]
    if not is_loopback(host):
        print(f"serve: warning: listening on {host}, reachable from other machines; the API has no "
              f"authentication (use --host 127.0.0.1 to keep it local).", file=sys.stderr)
    print(f"serve: {model_id} ({model.num_parameters():,} parameters, context {server.context}) on "
          f"http://{host}:{bound}/ (chat page), http://{host}:{bound}/v1 (OpenAI API); Ctrl-C stops",
          file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn.Config(server.app, log_level="warning", lifespan="off")).run(sockets=[sock])
    finally:
        server.engine.close()
        sock.close()


__all__ = ["run_server", "build_server", "require_server_packages", "Running", "ServeError", "bind"]
