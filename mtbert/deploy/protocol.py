"""uvicorn's HTTP/1.1 protocol (h11) with a time limit on a request's headers.

uvicorn has no such limit: its keep-alive timeout starts only after a response and stops at the first
byte of the next request, so a client that opens a connection and sends nothing, or half a header line
(slowloris), holds that connection, and its memory, for ever. Here a connection must deliver a request's
whole headers within `read_timeout` seconds of opening, or of its previous response; else it is closed.
The body has its own limit in the app (mtbert/deploy/api.py, `read_body`: a 408), where a response can
still be sent.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedH11Protocol(H11Protocol):
    def __init__(self, *args, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.start_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in
            self.stop_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:  # waiting for the next request
            self.start_header_timer()

    def connection_lost(self, exc) -> None:
        self.stop_header_timer()
        super().connection_lost(exc)

    def start_header_timer(self) -> None:
        self.stop_header_timer()
        self.header_timer = self.loop.call_later(self.read_timeout, self.headers_too_slow)

    def stop_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def headers_too_slow(self) -> None:
        self.header_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.transport.close()
