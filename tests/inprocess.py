"""`mtbert serve`'s app served over HTTP by uvicorn in a thread of the test's own process: a real server and
a real client, without a process to spawn, so that a test can hold the engine at a gate, break a handler
with monkeypatch, or count what the server's code does (`make mutation` sees every call)."""

from __future__ import annotations

import threading
import time

from bench.common import free_port


class InProcess(threading.Thread):
    """`create_app`'s API served by uvicorn in a daemon thread; `with InProcess(app) as url:`."""

    def __init__(self, app):
        import uvicorn

        super().__init__(daemon=True)
        self.port = free_port()
        # a test that failed with requests in flight is not held up by them at the server's shutdown
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    timeout_graceful_shutdown=2))

    def run(self) -> None:
        self.server.run()

    def __enter__(self) -> str:  # the server's URL
        self.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.is_alive(), "the in-process server did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def call_soon(self, callback) -> None:
        """`callback()` on the server's event loop, as the server's own code runs (asyncio is not thread-safe)."""
        self.server.servers[0].get_loop().call_soon_threadsafe(callback)

    def __exit__(self, *_) -> None:
        self.server.should_exit = True
        self.join(timeout=30)
