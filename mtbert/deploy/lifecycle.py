"""How `mtbert serve` starts and stops: readiness, a drain on SIGTERM or SIGINT, and its worker processes.

On SIGTERM or SIGINT a worker drains, then exits 0:
1. `/ready` answers 503 and the worker stops accepting connections, after taking those the kernel has
   already completed (`stop_accepting`);
2. every request it has accepted is finished, those waiting in the micro-batcher included; a request that
   arrives meanwhile on a connection the worker already had is served too, and every response now says
   `Connection: close`, so clients move to another server instead of finding a closed socket;
3. once no request is in flight and every connection has closed or been idle for IDLE_LINGER, it closes
   the idle ones (the log counts them) and exits. A client that sends on one of them just then finds it
   closed, the race that HTTP/1.1 leaves to the client's retry (RFC 9112, 9.3.1). A request still
   unfinished when the grace period (`--grace`) ends gets a 503 and a one-line JSON error instead.
A second signal during the drain ends the grace period at once; under the supervisor (`--workers N`) a
worker ignores a repeated SIGTERM, since a signal sent to the process group (as docker, systemd and
dumb-init send it) reaches the worker itself and again through the supervisor, and waits for SIGUSR1,
which the supervisor sends on a second signal of its own. Whatever the clients do (a body never finished,
a connection held open), the drain ends within the grace period and DRAIN_BOUND: at its end every request
still in flight is answered 503 (mtbert/deploy/middleware.py), and whatever is still open is closed.

uvicorn's own shutdown does not do this: it closes idle keep-alive connections the moment the signal
arrives (a client that is just sending on one gets "connection reset"), answers nothing to the requests it
cancels at its timeout, and raises the signal again on its way out (exit status 143, not 0). Its worker
supervisor builds uvicorn's server itself, so `--workers N` runs the supervisor below instead: it binds the
port once, starts N spawned workers that share it, replaces a worker that dies, and on a signal closes its
copy of the socket, passes SIGTERM to every worker and waits for their drains (mtbert/deploy/supervisor.py).
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import functools
import os
import signal
import socket
import sys
import threading
import time

import uvicorn

from mtbert.deploy.protocol import TimedH11Protocol


@dataclasses.dataclass
class Lifecycle:
    """One worker's state, shared by its app (readiness, in-flight requests) and its server (the drain)."""
    ready: bool = False  # the model is loaded and the micro-batcher runs
    draining: bool = False
    in_flight: int = 0  # requests inside the app
    served: int = 0  # requests answered since the drain began
    last_activity: float = 0.0  # time.monotonic() of the last request's start or end
    on_grace_end: list = dataclasses.field(default_factory=list)  # callbacks: answer what is still in flight
    on_ready: list = dataclasses.field(default_factory=list)  # callbacks: the app has started

    def begin_drain(self) -> None:
        self.draining, self.served = True, 0


IDLE_LINGER = 0.5  # seconds without a request before a drained worker closes its idle connections
DRAIN_BOUND = 1.0  # seconds past the grace period after which a drain ends, whatever is still open


def log(message: str, prefix: bool = True) -> None:
    """One line on stderr, in one write (the workers share stderr)."""
    sys.stderr.write(f"mtbert serve [{os.getpid()}]: {message}\n" if prefix else f"{message}\n")
    sys.stderr.flush()


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain of the module's docstring before uvicorn's own shutdown."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, grace: float, supervised: bool = False):
        super().__init__(config)
        self.lifecycle, self.grace = lifecycle, grace
        self.supervised = supervised  # a worker under the supervisor (see the module's docstring)
        self.drain_started: float | None = None
        self.accepting = True  # until the drain's first tick
        self.grace_over = False
        self.first_signal = threading.Lock()  # taken by the signal that starts the drain

    def handle_exit(self, sig: int, frame) -> None:
        if self.supervised and sig == signal.SIGINT:
            return  # the terminal's Ctrl-C is the supervisor's
        # The first signal is told from the next by one test-and-set in C: CPython runs a signal's handler
        # between two bytecodes, so a second signal can run it again inside the first, before a flag set in
        # Python would be (the process group's SIGTERM and the supervisor's copy of it, microseconds apart).
        if not self.first_signal.acquire(blocking=False):
            if not self.supervised:  # a second signal: no more waiting
                self.end_grace()
            return  # under the supervisor a repeated SIGTERM is the same shutdown
        self.lifecycle.begin_drain()  # not uvicorn's: it would re-raise the signal on exit
        self.drain_started = time.monotonic()
        log(f"{signal.Signals(sig).name}: draining {self.lifecycle.in_flight} request(s) in flight, "
            f"for at most {self.grace:g} s (--grace); /ready now answers 503")

    def end_grace(self, *_) -> None:
        self.grace_over = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is None:
            return await super().on_tick(counter)
        if self.accepting:
            self.accepting = False
            if await stop_accepting(self.servers):  # connections taken from the queue: their requests next
                self.lifecycle.last_activity = time.monotonic()
                return False
        waited = time.monotonic() - self.drain_started
        if not self.grace_over and waited >= self.grace:
            self.grace_over = True
        if self.grace_over and self.lifecycle.in_flight:
            for answer_now in self.lifecycle.on_grace_end:
                answer_now()
        quiet = time.monotonic() - self.lifecycle.last_activity
        lingering = self.server_state.connections and quiet < IDLE_LINGER and not self.grace_over
        busy = self.lifecycle.in_flight or lingering
        if busy and waited < self.grace + DRAIN_BOUND:
            return False  # a client still on an open connection gets its next request served, with a close
        left = f"; {self.lifecycle.in_flight} request(s) still open are closed" if self.lifecycle.in_flight else ""
        idle = max(len(self.server_state.connections) - self.lifecycle.in_flight, 0)
        log(f"drained: {self.lifecycle.served} request(s) answered in {waited:.2f} s{left}; "
            f"{idle} idle connection(s) closed; exiting")
        return True


async def stop_accepting(servers: list[asyncio.Server]) -> int:
    """Close the listening sockets, first taking every connection the kernel has already completed; how
    many were taken.

    Closing a listening socket resets the connections still waiting in its accept queue: a client that
    connected and sent its request would read a reset, not an answer. So the socket first stops completing
    new connections (`refuse_new_connections`), then the queue is emptied and its connections are served as
    any other (each response saying `Connection: close`), and only then is it closed: no connection can
    complete between the last accept and the close. A client that connects meanwhile is refused when its
    connect is retried. With `--workers N` the socket is shared: the first worker to drain stops it for all.
    """
    loop = asyncio.get_running_loop()
    taken = []
    for server in servers:
        for listener in server.sockets:
            refuse_new_connections(listener)
            for connection in waiting_connections(listener.fileno()):
                # asyncio's own accept path: the server's protocol factory (no TLS: `mtbert serve` has none)
                taken.append(loop.connect_accepted_socket(server._protocol_factory, connection))
        server.close()
    for outcome in await asyncio.gather(*taken, return_exceptions=True):
        if isinstance(outcome, Exception):  # that client is gone already; the others are served
            log(f"a connection taken from the accept queue failed: {outcome!r}")
    return len(taken)


class SocketFilter(ctypes.Structure):  # Linux's `struct sock_filter`: one classic BPF instruction
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SocketFilterProgram(ctypes.Structure):  # Linux's `struct sock_fprog`
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SocketFilter))]


SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>; Python's socket module does not name it
DROP_EVERY_PACKET = (SocketFilter * 1)(SocketFilter(code=0x06, k=0))  # BPF_RET | BPF_K: keep 0 bytes


def refuse_new_connections(listener) -> None:
    """Stop the listening socket from completing new connections, while it stays open (Linux).

    A filter that drops every packet reaching the listener drops the SYNs and the handshakes' last ACKs, so
    no connection joins its accept queue any more. The client's kernel retries its SYN a second later, finds
    the socket closed by then, and reports a refused connection, which a client can safely retry elsewhere.
    The connections already made, accepted or still queued, are sockets of their own: it does not reach them.
    """
    if sys.platform != "linux":
        return  # elsewhere the race of `stop_accepting`'s docstring stays: a close can reset a new connection
    program = SocketFilterProgram(len(DROP_EVERY_PACKET), DROP_EVERY_PACKET)
    try:
        listener.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(program))
    except OSError as error:  # a sandbox that forbids socket filters: the drain goes on, with that race
        log(f"could not stop new connections before closing the listening socket: {error}")


def waiting_connections(listener_fd: int, most: int = 1024) -> list[socket.socket]:
    """The connections waiting in the accept queue of the listening socket `listener_fd`, at most `most`
    (non-blocking; errors as asyncio's own accept loop treats them)."""
    listener = socket.socket(fileno=os.dup(listener_fd))  # a copy: closing it leaves the server's open
    accepted = []
    try:
        listener.setblocking(False)
        for _ in range(most):
            try:
                connection, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionAbortedError:  # the client gave up before its turn
                continue
            except OSError as error:  # e.g. out of file descriptors: keep what was taken
                log(f"could not take a waiting connection: {error}")
                break
            connection.setblocking(False)
            accepted.append(connection)
    finally:
        listener.close()
    return accepted


def run_worker(app, *, host: str, port: int, grace: float, read_timeout: float, sockets=None,
               supervised: bool = False) -> None:
    """Serve `app` (its `state.lifecycle` set) until a signal, then drain and return."""
    # uvicorn's own grace is a backstop past ours: by then every request was answered or refused.
    # asyncio's loop, not uvloop: the drain takes waiting connections through asyncio's Server (stop_accepting).
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=1, loop="asyncio",
                            http=functools.partial(TimedH11Protocol, read_timeout=read_timeout))
    server = DrainingServer(config, app.state.lifecycle, grace, supervised)
    if supervised:
        signal.signal(signal.SIGUSR1, server.end_grace)  # the supervisor's "no more waiting"
    server.run(sockets=sockets)
