"""`lmforge serve`: load a checkpoint and serve it (lmforge.serve: the OpenAI-compatible API,
the continuous-batching engine, the chat page)."""

from __future__ import annotations

from pathlib import Path

from lmforge.loading import load_checkpoint
from lmforge.runtime import decode_runtime
from lmforge.serve import bind, require_server_packages, run_server
from lmforge.serve.app import IO_TIMEOUT_S, MAX_BODY_BYTES, host_names


def serve_stage(checkpoint: str | Path, host: str = "127.0.0.1", port: int = 8000,
                tokenizer: str | Path | None = None, max_batch: int = 16, max_queue: int = 64,
                max_tokens: int | None = None, timeout_s: float = 120.0, allowed_hosts: list[str] | None = None,
                cors_origins: list[str] | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                io_timeout_s: float = IO_TIMEOUT_S) -> None:
    """Serve `checkpoint` on host:port until interrupted, decoding under `decode_runtime()`
    (decided here, once: the model is loaded onto its device and the engine decodes in it).

    Raises:
        ServeError: a bad port, limit or host list (a wildcard --host without --allowed-hosts),
        the port taken, or the server packages missing;
        CheckpointError / ContractError: see `lmforge.loading.load_checkpoint`.
    """
    require_server_packages()
    host_names(host, allowed_hosts)  # refuse a wildcard address without --allowed-hosts before any work
    sock = bind(host, port)  # fail on a bad port before loading anything
    try:
        runtime = decode_runtime()
        model, tok, _, _ = load_checkpoint(checkpoint, tokenizer, device=runtime.device)
        run_server(model, tok, Path(checkpoint).resolve().name, sock, max_batch, max_queue, max_tokens, timeout_s,
                   runtime, allowed_hosts, cors_origins, max_body_bytes, io_timeout_s)
    finally:
        sock.close()
