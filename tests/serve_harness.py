"""A server running in a background thread for tests: `Running(server).url`, then `stop()`."""

from __future__ import annotations

import threading
import time

from lmforge.serve.app import IO_TIMEOUT_S, bind, uvicorn_config


class Running:
    """`server` (a `lmforge.serve.api.Server`) served by uvicorn with the guarded protocol of
    `lmforge serve`, on a free loopback port."""

    def __init__(self, server, host: str = "127.0.0.1", port: int = 0, io_timeout_s: float = IO_TIMEOUT_S,
                 sndbuf: int | None = None):
        import socket

        import uvicorn

        self.server = server
        self.sock = bind(host, port)
        if sndbuf is not None:  # accepted sockets inherit it: a small one makes a slow reader show soon
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.uv = uvicorn.Server(uvicorn_config(server.app, io_timeout_s))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        for _ in range(200):  # bounded: up to 10 s for uvicorn to start
            if self.uv.started:
                break
            time.sleep(0.05)

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=10)
        self.server.engine.close()
        self.sock.close()
