"""`lmforge serve`: load a checkpoint and serve it (lmforge.serve: the OpenAI-compatible API,
the continuous-batching engine, the chat page)."""

from __future__ import annotations

from pathlib import Path

from lmforge.serve import bind, require_server_packages, run_server
from lmforge.stages.common import load_for_inference


def serve_stage(checkpoint: str | Path, host: str = "127.0.0.1", port: int = 8000,
                tokenizer: str | Path | None = None, max_batch: int = 16, max_queue: int = 64,
                max_tokens: int | None = None, timeout_s: float = 120.0) -> None:
    """Serve `checkpoint` on host:port until interrupted.

    Raises:
        ServeError: a bad port or limit, the port taken, or the server packages missing;
        CheckpointError / ContractError: see `load_for_inference`.
    """
    require_server_packages()
    sock = bind(host, port)  # fail on a bad port before loading anything
    try:
        model, tok, _ = load_for_inference(checkpoint, tokenizer)
        run_server(model, tok, Path(checkpoint).resolve().name, sock, max_batch, max_queue, max_tokens, timeout_s)
    finally:
        sock.close()
