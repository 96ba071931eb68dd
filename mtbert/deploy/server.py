"""`mtbert serve`: the model behind an HTTP JSON API (FastAPI on uvicorn).

    POST /predict  {"task": "sst", "texts": ["A gorgeous, witty film."]}   (pairs: [["a", "b"], ...])
                -> {"task": "sst", "results": [{"prob_0": ..., "prob_4": ..., "label": 4}]}
    GET  /tasks    each task's kind, text columns and result columns
    GET  /health   {"status": "ok", ...} with the requests and engine calls this worker has served (liveness)
    GET  /ready    200 {"status": "ready"} once the model is loaded, 503 while starting or draining (readiness)
    GET  /metrics  Prometheus metrics (mtbert/deploy/metrics.py)

The results are `mtbert predict`'s (the same engine: mtbert/deploy/predictors.py). Concurrent requests are
batched: a batch starts with the first waiting request, waits `wait_ms` for more, and takes every request
then waiting, up to `max_batch` texts; one engine call per task of the batch, in a worker thread, so the
event loop keeps accepting requests meanwhile. Every refusal is a status and `{"error": "<one line>"}`:
400 a body that is not JSON; 404 an unknown task or path; 405 a wrong method; 413 a body over
`max_body_bytes` (refused before it is read whole), over `max_texts` texts or a text over `max_chars`
characters, each naming the limit; 422 a body of the wrong shape, an empty text or a pair with a side
missing; 500 anything else, which is logged and leaves the server answering; 503 a request the grace
period of a shutdown ended before it was served. Several worker processes (`--workers`) each load the
model and share the port. SIGTERM or SIGINT drains every worker before it exits: mtbert/deploy/lifecycle.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtbert.deploy.lifecycle import Lifecycle, log, run_worker, supervise
from mtbert.deploy.metrics import MULTIPROCESS_VARIABLE, ServerMetrics
from mtbert.deploy.predictors import load_predictor
from mtbert.inputs import InputError, check_texts

CONFIG_VARIABLE = "MTBERT_SERVE_CONFIG"  # how the worker processes get the configuration
ENDPOINTS = "POST /predict, GET /tasks, GET /health, GET /ready, GET /metrics"
PATHS = ("/predict", "/tasks", "/health", "/ready", "/metrics")  # the metrics' endpoint label; others: "other"


@dataclasses.dataclass(frozen=True)
class Limits:
    max_texts: int = 256  # texts (or pairs) per request
    max_chars: int = 2000  # characters per text
    max_body_bytes: int = 1 << 20  # bytes of a request's body


@dataclasses.dataclass(frozen=True)
class Batching:
    max_batch: int = 64  # texts per engine call
    wait_ms: float = 2.0  # how long a batch waits for more requests after its first


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model: str | None
    ensemble: str | None
    models_dir: str
    engine: str
    threads: int
    limits: Limits
    batching: Batching

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        raw = json.loads(text)
        return cls(**{**raw, "limits": Limits(**raw["limits"]), "batching": Batching(**raw["batching"])})

    def predictor(self, batch_size: int):
        return load_predictor(model=self.model and Path(self.model), ensemble=self.ensemble and Path(self.ensemble),
                              models_dir=Path(self.models_dir), engine=self.engine, batch_size=batch_size,
                              threads=self.threads)


class ApiError(Exception):
    """A refused request: its HTTP status and the one-line message of its JSON body."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, " ".join(message.split())


@dataclasses.dataclass
class Pending:
    task: str
    rows: list[tuple[str, ...]]
    future: asyncio.Future


class MicroBatcher:
    """Runs the engine on batches of the requests waiting together (see the module's docstring)."""

    def __init__(self, predictor, batching: Batching, metrics: ServerMetrics):
        self.predictor, self.batching, self.metrics = predictor, batching, metrics
        self.queue: asyncio.Queue[Pending] | None = None
        self.loop_task: asyncio.Task | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtbert-engine")
        self.requests = self.engine_calls = 0
        self.running: list[Pending] = []  # the batch in the engine

    def start(self) -> None:
        self.queue = asyncio.Queue()
        self.loop_task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self.loop_task is not None:
            self.loop_task.cancel()
            with suppress(asyncio.CancelledError):
                await self.loop_task
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, task: str, rows: list[tuple[str, ...]]) -> list[dict]:
        """The results of one request's rows, once the batch it joined has run."""
        future = asyncio.get_running_loop().create_future()
        self.requests += 1
        self.metrics.queue_depth.inc()
        await self.queue.put(Pending(task, rows, future))
        return await future

    async def run(self) -> None:
        while True:
            self.running = [await self.queue.get()]  # the batch being formed, then in the engine
            self.metrics.queue_depth.dec()
            if self.batching.wait_ms:
                await asyncio.sleep(self.batching.wait_ms / 1000)
            texts = sum(len(pending.rows) for pending in self.running)
            while texts < self.batching.max_batch and not self.queue.empty():
                self.running.append(self.queue.get_nowait())
                self.metrics.queue_depth.dec()
                texts += len(self.running[-1].rows)
            await self.run_batch(self.running)
            self.running = []

    def fail_waiting(self, error: Exception) -> None:
        """Every request not answered yet (queued, being batched or in the engine) gets `error`: the end of a
        drain's grace period."""
        while self.queue is not None and not self.queue.empty():
            self.running.append(self.queue.get_nowait())
            self.metrics.queue_depth.dec()
        for pending in self.running:
            if not pending.future.done():
                pending.future.set_exception(error)

    async def run_batch(self, batch: list[Pending]) -> None:
        """One engine call per task of the batch; each request gets its own rows' results."""
        for task in dict.fromkeys(pending.task for pending in batch):
            group = [pending for pending in batch if pending.task == task]
            rows = [row for pending in group for row in pending.rows]
            try:
                results = await asyncio.get_running_loop().run_in_executor(
                    self.executor, self.predictor.predict, task, rows)
            except Exception as error:  # the requests get a 500 each; the server goes on
                self.metrics.engine_errors.inc()
                for pending in group:
                    if not pending.future.done():
                        pending.future.set_exception(error)
                continue
            self.engine_calls += 1
            self.metrics.batch_texts.observe(len(rows))
            start = 0
            for pending in group:
                if not pending.future.done():  # a client that left has its future cancelled
                    pending.future.set_result(results[start:start + len(pending.rows)])
                start += len(pending.rows)


class ServingMiddleware:
    """Around every request: counts it in flight (a drain waits for it), times it and counts its status for
    /metrics, and while the worker drains tells the client to close the connection."""

    def __init__(self, app, lifecycle: Lifecycle, metrics: ServerMetrics):
        self.app, self.lifecycle, self.metrics = app, lifecycle, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in PATHS else "other"
        started, status = time.monotonic(), 500  # 500: the app raised before it answered

        async def respond(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if self.lifecycle.draining:
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        self.lifecycle.in_flight += 1
        self.lifecycle.last_activity = started
        try:
            await self.app(scope, receive, respond)
        finally:
            self.lifecycle.in_flight -= 1
            self.lifecycle.last_activity = time.monotonic()
            if self.lifecycle.draining:
                self.lifecycle.served += 1
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.monotonic() - started)


def create_app(predictor, limits: Limits = Limits(), batching: Batching = Batching()) -> FastAPI:
    """The API over `predictor` (any of mtbert's predictors: `tasks`, `predict(task, texts)`); its
    `state.lifecycle` says whether it is ready or draining (mtbert/deploy/lifecycle.py)."""
    metrics, lifecycle = ServerMetrics(), Lifecycle()
    batcher = MicroBatcher(predictor, batching, metrics)
    lifecycle.on_grace_end.append(lambda: batcher.fail_waiting(ApiError(
        503, "the server is shutting down and its grace period ended before this request was served; send it "
             "again (to another server)")))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if hasattr(predictor, "warm"):
            predictor.warm()  # every graph loaded before the first request
        batcher.start()
        lifecycle.ready = True
        yield
        lifecycle.ready = False
        await batcher.stop()

    app = FastAPI(title="mtbert", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.lifecycle = lifecycle
    app.add_middleware(ServingMiddleware, lifecycle=lifecycle, metrics=metrics)
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "tasks": list(predictor.tasks), "requests": batcher.requests,
                "engine_calls": batcher.engine_calls, "draining": lifecycle.draining}

    @app.get("/ready")
    async def ready() -> dict:
        if lifecycle.draining:
            raise ApiError(503, "draining: the server is shutting down and takes no new work")
        if not lifecycle.ready:
            raise ApiError(503, "starting: the model is not loaded yet")
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics_text() -> Response:
        content, media_type = metrics.exposition()
        return Response(content, media_type=media_type)

    @app.get("/tasks")
    async def tasks() -> dict:
        return {"tasks": {name: describe_task(task) for name, task in predictor.tasks.items()}}

    @app.post("/predict")
    async def predict(request: Request) -> dict:
        body = await read_body(request, limits.max_body_bytes)
        task, texts = parse_request(body, predictor.tasks, limits)
        try:
            rows = check_texts(predictor.tasks[task], texts, where="texts")
        except InputError as error:
            raise ApiError(422, str(error)) from None
        return {"task": task, "results": await batcher.submit(task, rows)}

    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error as a status and {"error": "<one line>"}."""

    @app.exception_handler(ApiError)
    async def refused(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse({"error": error.message}, status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = f"{str(error.detail).lower()}: {request.method} {request.url.path}; the API has {ENDPOINTS}"
        return JSONResponse({"error": message}, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception) -> JSONResponse:
        # Starlette re-raises it after this response is sent, so uvicorn logs the traceback; the server goes on
        message = " ".join(f"internal error: {type(error).__name__}: {error}".split())
        return JSONResponse({"error": message}, status_code=500)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to be over `limit` bytes: by its Content-Length
    before reading, else while reading."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {int(declared)} bytes is over the limit of {limit} bytes "
                            "(--max-body-bytes)")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes (--max-body-bytes)")
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
    return task, texts


def short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def describe_task(task) -> dict:
    """What a client needs to call a task: its kind, text columns and result columns (either engine's task)."""
    kind = task.kind if isinstance(task.kind, str) else task.kind.name
    columns = list(task.columns) if hasattr(task, "columns") else task.kind.value_columns()
    return {"kind": kind, "text": list(task.text_columns), "results": [*columns, "label"]}


def serve_from_environment(sock, *, host: str, port: int, grace: float) -> None:
    """One worker process of `--workers N`, configured by the parent through CONFIG_VARIABLE."""
    config = ServeConfig.from_json(os.environ[CONFIG_VARIABLE])
    app = create_app(config.predictor(config.batching.max_batch), config.limits, config.batching)
    run_worker(app, host=host, port=port, grace=grace, sockets=[sock], ignore_sigint=True)


def run_server(config: ServeConfig, *, host: str, port: int, workers: int, grace: float = 30.0) -> None:
    """Serve until SIGTERM or SIGINT, then drain (mtbert/deploy/lifecycle.py): in this process, or in `workers`
    processes that share the port."""
    predictor = config.predictor(config.batching.max_batch)  # a bad folder fails here, in one line
    log(f"http://{host}:{port} ({ENDPOINTS}); tasks {', '.join(predictor.tasks)}; {workers} worker(s), "
        f"{config.threads} thread(s) each; a shutdown drains for at most {grace:g} s")
    if workers == 1:
        run_worker(create_app(predictor, config.limits, config.batching), host=host, port=port, grace=grace)
        return
    del predictor  # each worker loads its own
    os.environ[CONFIG_VARIABLE] = config.to_json()
    with tempfile.TemporaryDirectory(prefix="mtbert-metrics-") as metrics_dir:
        os.environ[MULTIPROCESS_VARIABLE] = metrics_dir  # the workers' figures, added up by /metrics
        supervise(functools.partial(serve_from_environment, host=host, port=port, grace=grace), workers,
                  host=host, port=port, grace=grace)
