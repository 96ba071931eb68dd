"""What happens around every request of `mtbert serve`, before and after the routes (mtbert/deploy/api.py).

In order:
1. **a request id**: the client's `X-Request-ID` if it is a plain token, else a new one; every response
   and every log line about the request carries it;
2. **the bearer token** (`--api-key`), asked of /predict and /metrics: a missing or wrong one is a 401;
3. **admission**: past `--max-concurrent-requests` /predict requests inside the server, a 429 with
   `Retry-After` at once, before the body is read, and the connection is closed;
4. **a deadline**: a /predict request not answered within `--request-timeout` is answered 503 and
   withdrawn from the micro-batcher's queue (so it is never computed); the end of a drain's grace period
   does the same to every request still in flight;
5. **counting**: requests in flight (a drain waits for them), `Connection: close` while draining, each
   request's status and latency for /metrics, and one access-log line (`--access-log`), all before the last
   part of its answer is sent, so that its client's next request finds it counted;
6. **a client that hangs up** is one log line and status 499 in /metrics (nginx's "client closed
   request"): nothing is sent, and it is not a 500.

It is a plain ASGI middleware, not Starlette's BaseHTTPMiddleware, which would buffer and wrap the
response and could not withdraw a request mid-flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import re
import time
import uuid

from mtbert.deploy.lifecycle import Lifecycle, log
from mtbert.deploy.metrics import ServerMetrics
from mtbert.deploy.serve_config import Admission, Operations

# the metrics' endpoint label; others: "other"
PATHS = ("/predict", "/tasks", "/health", "/ready", "/metrics", "/openapi.json")
GUARDED = ("/predict", "/metrics")  # the paths that ask for the bearer token
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a client's id is echoed as is only if it is this plain
CLIENT_GONE = 499


class ClientGone(Exception):
    """The client hung up before its request was answered."""


@dataclasses.dataclass(eq=False)
class Exchange:
    """One request as the middleware follows it."""
    request_id: str
    endpoint: str
    started: float = dataclasses.field(default_factory=time.monotonic)
    status: int = 500  # until a response starts: 500 means the app raised before it answered
    responded: bool = False
    counted: bool = False  # in /metrics: out of the in-flight gauge, into the requests by status
    task: asyncio.Task | None = None  # the app's handling of it
    aborted: str | None = None  # why the middleware cancelled it: "timeout" or "shutdown"

    def abort(self, reason: str) -> None:
        if self.task is not None and not self.task.done() and self.aborted is None:
            self.aborted = reason
            self.task.cancel()


ABORTED = {  # why a request was withdrawn -> its status and one-line message
    "timeout": (503, "not answered within the request timeout of {timeout:g} s (--request-timeout): the server "
                     "is busy; send it again later"),
    "shutdown": (503, "the server is shutting down and its grace period ended before this request was served; "
                      "send it again (to another server)"),
}


class ServingMiddleware:
    """The steps of the module's docstring, around every HTTP request."""

    def __init__(self, app, lifecycle: Lifecycle, metrics: ServerMetrics, admission: Admission,
                 operations: Operations):
        self.app, self.lifecycle, self.metrics = app, lifecycle, metrics
        self.admission, self.operations = admission, operations
        self.admitted = 0  # /predict requests inside the app
        self.in_flight: set[Exchange] = set()
        lifecycle.on_grace_end.append(self.abort_all)

    def abort_all(self) -> None:
        """The end of a drain's grace period: every request still in flight gets its 503 now."""
        for exchange in list(self.in_flight):
            exchange.abort("shutdown")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = Exchange(request_id(scope), scope["path"] if scope["path"] in PATHS else "other")
        scope.setdefault("state", {})["request_id"] = exchange.request_id
        self.lifecycle.in_flight += 1
        self.metrics.in_flight.inc()
        self.lifecycle.last_activity = exchange.started
        try:
            refusal = self.refusal(scope, exchange)
            if refusal:
                await self.send_error(scope, send, exchange, *refusal)
            else:
                await self.handle(scope, receive, send, exchange)
        finally:
            self.lifecycle.in_flight -= 1
            self.lifecycle.last_activity = time.monotonic()
            if self.lifecycle.draining:
                self.lifecycle.served += 1
            self.count(scope, exchange)  # if its answer did not end (the client hung up, the app raised)

    def refusal(self, scope, exchange: Exchange) -> tuple[int, str, dict] | None:
        """A 401 or 429 to answer before the request is read, or None to let it in."""
        key = self.operations.api_key
        if key and exchange.endpoint in GUARDED and not hmac.compare_digest(bearer_token(scope), key.encode()):
            return 401, "missing or wrong bearer token: send `Authorization: Bearer <key>` (--api-key)", {
                "www-authenticate": "Bearer"}
        if exchange.endpoint == "/predict" and self.admitted >= self.admission.max_concurrent_requests:
            self.metrics.shed.labels("overloaded").inc()
            return 429, (f"overloaded: {self.admitted} requests are in the server, its bound "
                         "(--max-concurrent-requests); send it again after Retry-After"), self.retry_headers()
        return None

    def retry_headers(self) -> dict:
        return {"retry-after": str(self.admission.retry_after), "connection": "close"}

    async def handle(self, scope, receive, send, exchange: Exchange) -> None:
        """Run the app on the request, within its deadline; an aborted request gets its 503 here."""
        async def respond(message) -> None:
            if message["type"] == "http.response.start":
                exchange.status, exchange.responded = message["status"], True
                headers = [*message.get("headers", []), (b"x-request-id", exchange.request_id.encode())]
                if self.lifecycle.draining:
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                self.count(scope, exchange)
            await send(message)

        predict = exchange.endpoint == "/predict"
        self.admitted += predict
        exchange.task = asyncio.ensure_future(self.app(scope, receive, respond))
        self.in_flight.add(exchange)
        deadline = asyncio.get_running_loop().call_later(self.admission.request_timeout, exchange.abort,
                                                         "timeout") if predict else None
        try:
            await exchange.task
        except asyncio.CancelledError:
            if exchange.aborted is None:  # this task itself was cancelled (uvicorn's shutdown): not ours to answer
                raise
            self.metrics.shed.labels(exchange.aborted).inc()
            if not exchange.responded:
                status, message = ABORTED[exchange.aborted]
                await self.send_error(scope, send, exchange, status,
                                      message.format(timeout=self.admission.request_timeout), self.retry_headers())
        except ClientGone as gone:
            exchange.status = CLIENT_GONE
            self.metrics.shed.labels("client_gone").inc()
            log(f"request {exchange.request_id}: the client hung up {gone}; nothing was sent")
        finally:
            self.admitted -= predict
            self.in_flight.discard(exchange)
            if deadline is not None:
                deadline.cancel()

    async def send_error(self, scope, send, exchange: Exchange, status: int, message: str, headers: dict) -> None:
        body = json.dumps({"error": message}).encode()
        exchange.status = status
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"x-request-id", exchange.request_id.encode()),
               *((name.encode(), value.encode()) for name, value in headers.items())]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        self.count(scope, exchange)
        await send({"type": "http.response.body", "body": body})

    def count(self, scope, exchange: Exchange) -> None:
        """A request's figures, once, just before the last part of its answer is sent: a client that has its
        answer finds it counted by its next request, even one that another worker answers (`--workers N`)."""
        if exchange.counted:
            return
        exchange.counted = True
        self.metrics.in_flight.dec()
        seconds = time.monotonic() - exchange.started
        self.metrics.requests.labels(exchange.endpoint, str(exchange.status)).inc()
        self.metrics.latency.labels(exchange.endpoint).observe(seconds)
        if self.operations.access_log != "none":
            log_access(self.operations.access_log, scope, exchange, seconds)


def request_id(scope) -> str:
    """The client's X-Request-ID if it is a plain token (so that it is safe in a log line), else a new id."""
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if REQUEST_ID.fullmatch(text):
                return text
    return uuid.uuid4().hex


def bearer_token(scope) -> bytes:
    for name, value in scope["headers"]:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].strip()
    return b""


def log_access(style: str, scope, exchange: Exchange, seconds: float) -> None:
    """One line per request: as text, or as a JSON object (for a log collector)."""
    state = scope.get("state", {})
    client = scope.get("client") or ("-", 0)
    line = {"request_id": exchange.request_id, "client": f"{client[0]}:{client[1]}", "method": scope["method"],
            "path": scope["path"], "status": exchange.status, "seconds": round(seconds, 6),
            "queue_seconds": state.get("queue_seconds"), "compute_seconds": state.get("compute_seconds"),
            "texts": state.get("texts")}
    if style == "json":
        log(json.dumps({"time": time.time(), **line}), prefix=False)
    else:
        timing = "" if line["queue_seconds"] is None else \
            f" (queued {line['queue_seconds']:.4f} s, computed {line['compute_seconds']:.4f} s)"
        log(f'{line["client"]} "{line["method"]} {line["path"]}" {line["status"]} {seconds:.4f} s{timing} '
            f'id={exchange.request_id}')
