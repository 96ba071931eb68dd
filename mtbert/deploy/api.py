"""`mtbert serve`'s HTTP API (FastAPI): the routes, and how a /predict body is read and checked.

    POST /predict  {"task": "sst", "texts": ["A gorgeous, witty film."]}   (pairs: [["a", "b"], ...])
                -> {"task": "sst", "results": [{"prob_0": ..., "prob_4": ..., "label": 4}]}
    GET  /tasks    each task's kind, text columns and result columns
    GET  /health   200 {"status": "ok", ...} while the engine completes its calls; 503 when a call has run
                   past --request-timeout or the batching loop has stopped (liveness)
    GET  /ready    200 {"status": "ready"} once the model is loaded, 503 while starting or draining (readiness)
    GET  /metrics  Prometheus metrics (mtbert/deploy/metrics.py)
    GET  /openapi.json  the OpenAPI document of these routes, every response documented (mtbert/deploy/schema.py)

The results are `mtbert predict`'s (the same engine: mtbert/predictors.py), computed in shared
batches (mtbert/deploy/batcher.py). Every refusal is a status and `{"error": "<one line>"}` naming the
limit or row at fault, never the server's internals. What each status means is written once, in
mtbert/deploy/schema.py's `ERRORS` (the OpenAPI document's responses); docs/serving.md's table gives it to
users with the options' defaults, and a test holds the two to the same statuses.
What surrounds each request (request ids, the token, admission, deadlines, counting, access logs) is
mtbert/deploy/middleware.py.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mtbert.deploy import schema
from mtbert.deploy.batcher import EngineFailed, MicroBatcher, Overloaded
from mtbert.deploy.lifecycle import Lifecycle
from mtbert.deploy.metrics import ServerMetrics
from mtbert.deploy.middleware import GUARDED, ClientGone, ServingMiddleware
from mtbert.deploy.serve_config import Admission, Batching, Limits, Operations
from mtbert.inputs import InputError, check_texts

ENDPOINTS = "POST /predict, GET /tasks, GET /health, GET /ready, GET /metrics, GET /openapi.json"


class ApiError(Exception):
    """A refused request: its HTTP status, the one-line message of its JSON body, and any headers."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, " ".join(message.split()), headers


def create_app(predictor, limits: Limits = Limits(), batching: Batching = Batching(),
               admission: Admission = Admission(), operations: Operations = Operations()) -> FastAPI:
    """The API over `predictor` (any of mtbert's predictors: `tasks`, `predict(task, texts)`); its
    `state.lifecycle` says whether it is ready or draining (mtbert/deploy/lifecycle.py)."""
    metrics, lifecycle = ServerMetrics(), Lifecycle()
    batcher = MicroBatcher(predictor, batching, admission, metrics)
    retry = {"Retry-After": str(admission.retry_after)}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if hasattr(predictor, "warm"):
            predictor.warm()  # every graph loaded before the first request (already done by `mtbert serve`)
        batcher.start()
        lifecycle.ready = True
        for started in lifecycle.on_ready:
            started()
        yield
        lifecycle.ready = False
        await batcher.stop()

    app = FastAPI(title="mtbert", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.lifecycle = lifecycle
    app.add_middleware(ServingMiddleware, lifecycle=lifecycle, metrics=metrics, admission=admission,
                       operations=operations)
    add_error_handlers(app)

    @app.get("/health", response_model=None, responses=schema.HEALTH)
    async def health() -> JSONResponse:
        problem = engine_problem(batcher, admission.request_timeout)
        body = {"status": "unhealthy" if problem else "ok", "tasks": list(predictor.tasks),
                "requests": batcher.requests, "engine_calls": batcher.engine_calls, "draining": lifecycle.draining}
        return JSONResponse({**body, "error": problem} if problem else body, status_code=503 if problem else 200)

    @app.get("/ready", response_model=None, responses=schema.READY)
    async def ready() -> dict:
        if lifecycle.draining:
            raise ApiError(503, "draining: the server is shutting down and takes no new work")
        if not lifecycle.ready:
            raise ApiError(503, "starting: the model is not loaded yet")
        return {"status": "ready"}

    @app.get("/metrics", response_model=None, responses=schema.METRICS)
    async def metrics_text() -> Response:
        content, media_type = metrics.exposition()
        return Response(content, media_type=media_type)

    @app.get("/tasks", response_model=None, responses=schema.TASKS)
    async def tasks() -> dict:
        return {"tasks": {name: describe_task(task) for name, task in predictor.tasks.items()}}

    sentences = {name: len(describe_task(task)["text"]) for name, task in predictor.tasks.items()}

    @app.post("/predict", response_model=None, responses=schema.PREDICT,
              openapi_extra=schema.predict_body(sentences, limits.max_texts, limits.max_chars))
    async def predict(request: Request) -> dict:
        body = await read_body(request, limits)
        task, texts = parse_request(body, predictor.tasks, limits)
        try:
            rows = check_texts(predictor.tasks[task], texts, where="texts")
        except InputError as error:
            raise ApiError(422, str(error)) from None
        try:
            pending = batcher.submit(task, rows, request.state.request_id)
        except Overloaded as error:
            metrics.shed.labels("overloaded").inc()
            raise ApiError(429, f"overloaded: {error}; send it again after Retry-After", retry) from None
        try:
            results = await answer_or_hang_up(pending.future, request)
        finally:
            batcher.withdraw(pending)  # gone, timed out or shut down: never computed; answered: a no-op
        request.state.queue_seconds, request.state.compute_seconds = pending.queue_seconds, pending.compute_seconds
        request.state.texts = len(rows)
        return {"task": task, "results": results}

    if operations.api_key:
        document = app.openapi  # FastAPI's builder, which caches the document it returns
        app.openapi = lambda: schema.with_bearer(document(), GUARDED)
    return app


def engine_problem(batcher: MicroBatcher, bound: float) -> str | None:
    """Why the engine cannot answer requests now, or None."""
    if batcher.stopped():
        return "the batching loop has stopped; restart the server"
    running = batcher.stalled(bound)
    if running is not None:
        return f"an engine call has run for {running:.0f} s, past the request timeout of {bound:g} s"
    return None


async def answer_or_hang_up(future: asyncio.Future, request: Request) -> list[dict]:
    """The request's results, or ClientGone as soon as its client hangs up (its rows are then dropped)."""
    gone = asyncio.ensure_future(hung_up(request))
    try:
        await asyncio.wait({future, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not future.done():
        raise ClientGone("while its request waited for the engine")
    try:
        return future.result()
    except EngineFailed:
        raise ApiError(500, f"internal error: the engine failed on this request; the server's log has the "
                            f"details under its id {request.state.request_id}") from None


async def hung_up(request: Request) -> None:
    """Returns when the client hangs up (the server sees `http.disconnect` once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def add_error_handlers(app: FastAPI) -> None:
    """Every error as a status and {"error": "<one line>"}."""

    @app.exception_handler(ApiError)
    async def refused(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = f"{str(error.detail).lower()}: {request.method} {request.url.path}; the API has {ENDPOINTS}"
        return JSONResponse({"error": message}, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception) -> JSONResponse:
        # Starlette re-raises it after this response is sent, so uvicorn logs the traceback; the server goes on.
        # The client learns only the request id: an exception's text can hold paths and internals.
        request_id = request.scope.get("state", {}).get("request_id", "-")
        return JSONResponse({"error": f"internal error; the server's log has the details under request id "
                                      f"{request_id}"}, status_code=500)


async def read_body(request: Request, limits: Limits) -> bytes:
    """The body, within `read_timeout` seconds (else 408), refused (413) as soon as it is known to be over
    `max_body_bytes`: by its Content-Length before reading, else while reading."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {int(declared)} bytes is over the limit of {limit} bytes "
                            "(--max-body-bytes)")
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise ApiError(413, f"request body is over the limit of {limit} bytes (--max-body-bytes)")

    try:
        await asyncio.wait_for(read(), limits.read_timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the body was not received within {limits.read_timeout:g} s (--read-timeout); "
                            f"{len(body)} bytes came", {"Connection": "close"}) from None
    except ClientDisconnect:
        raise ClientGone(f"while sending its body ({len(body)} bytes came)") from None
    return bytes(body)


def parse_request(body: bytes, tasks: dict, limits: Limits) -> tuple[str, list]:
    """The task and texts of a /predict body, each limit and shape checked, in that order."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as error:  # ValueError: bad JSON or bad UTF-8
        raise ApiError(400, f"the body is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ApiError(422, 'expected a JSON object {"task": ..., "texts": [...]}')
    unknown = [key for key in data if key not in ("task", "texts")]
    if unknown:
        raise ApiError(422, f"unknown key {unknown[0]!r}; a request has task and texts")
    task = data.get("task")
    if not isinstance(task, str):
        raise ApiError(422, f"task: expected the name of a task ({', '.join(tasks)}), got {short(task)}")
    if task not in tasks:
        raise ApiError(404, f"unknown task {task!r}; this model predicts {', '.join(tasks)}")
    texts = data.get("texts")
    if not isinstance(texts, list) or not texts:
        raise ApiError(422, "texts: expected a non-empty list of texts (a pair task: of [sentence1, sentence2])")
    if len(texts) > limits.max_texts:
        raise ApiError(413, f"texts: {len(texts)} texts, over the limit of {limits.max_texts} per request "
                            "(--max-texts)")
    for index, text in enumerate(texts, start=1):
        sides = [text] if isinstance(text, str) else text
        if not isinstance(sides, list) or not all(isinstance(side, str) for side in sides):
            raise ApiError(422, f"texts row {index}: expected a string (a pair task: a list of two strings), "
                                f"got {short(text)}")
        longest = max(map(len, sides), default=0)
        if longest > limits.max_chars:
            raise ApiError(413, f"texts row {index}: a text of {longest} characters, over the limit of "
                                f"{limits.max_chars} per text (--max-chars)")
    return task, texts  # what each text holds (not empty, valid Unicode) is check_texts' (mtbert/inputs.py)


def short(value) -> str:
    """A client's value, quoted as JSON and cut short, for a one-line message."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def describe_task(task) -> dict:
    """What a client needs to call a task: its kind, text columns and result columns (either engine's task)."""
    kind = task.kind if isinstance(task.kind, str) else task.kind.name
    columns = list(task.columns) if hasattr(task, "columns") else task.kind.value_columns()
    return {"kind": kind, "text": list(task.text_columns), "results": [*columns, "label"]}
