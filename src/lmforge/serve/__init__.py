"""`lmforge serve`: an OpenAI-compatible server with continuous batching and a chat page.

    app.py      building and running the server: limits, binding, the Host check, CORS,
                the slow-client timeouts
    api.py      the HTTP routes (Starlette): /v1/chat/completions, /v1/completions,
                /v1/models, /health, and the chat page (static/index.html) at /
    request.py  a request before any work: the strict body parser, the fields by name, the
                messages and the sampling fields
    engine.py   the batched decoding engine (one thread owns the model and its KV cache)
"""

from __future__ import annotations

from lmforge.serve.app import ServeError, bind, build_server, require_server_packages, run_server

__all__ = ["run_server", "build_server", "require_server_packages", "ServeError", "bind"]
