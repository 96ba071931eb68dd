"""`mtbert serve`'s app served over HTTP by uvicorn in a thread of the test's own process: a real server and
a real client, without a process to spawn, so that a test can hold the engine at a gate, break a handler
with monkeypatch, or count what the server's code does (`make mutation` sees every call)."""

from __future__ import annotations

import asyncio
import threading
import time

from bench.common import free_port


def stoppable_server(config):
    """uvicorn's server, which stops as soon as it is asked (`stop()`, from any thread) rather than at the next
    of its 0.1 s ticks: a suite starts and stops a server per test."""
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config) -> None:
            super().__init__(config)
            self.stop_asked = asyncio.Event()  # bound to the server's loop when first awaited

        async def main_loop(self) -> None:
            ticks, asked = asyncio.ensure_future(super().main_loop()), asyncio.ensure_future(self.stop_asked.wait())
            await asyncio.wait({ticks, asked}, return_when=asyncio.FIRST_COMPLETED)
            ticks.cancel()
            asked.cancel()

        def stop(self) -> None:
            self.should_exit = True
            loop = self.servers[0].get_loop() if getattr(self, "servers", None) else None
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self.stop_asked.set)

    return Server(config)


class InProcess(threading.Thread):
    """`create_app`'s API served by uvicorn in a daemon thread; `with InProcess(app) as url:`."""

    def __init__(self, app):
        import uvicorn

        super().__init__(daemon=True)
        self.port = free_port()
        # a test that failed with requests in flight is not held up by them at the server's shutdown
        self.server = stoppable_server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                      timeout_graceful_shutdown=2))

    def run(self) -> None:
        self.server.run()

    def __enter__(self) -> str:  # the server's URL
        self.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.is_alive(), "the in-process server did not start"
            time.sleep(0.005)
        return f"http://127.0.0.1:{self.port}"

    def call_soon(self, callback) -> None:
        """`callback()` on the server's event loop, as the server's own code runs (asyncio is not thread-safe)."""
        self.server.servers[0].get_loop().call_soon_threadsafe(callback)

    def __exit__(self, *_) -> None:
        self.server.stop()
        self.join(timeout=30)
