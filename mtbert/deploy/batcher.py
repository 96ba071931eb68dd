"""The server's micro-batcher: concurrent /predict requests share engine calls.

A batch starts with the first waiting request, waits `wait_ms` for more, and takes every request then
waiting, up to `max_batch` texts; one engine call per task of the batch, in a worker thread, so the event
loop keeps accepting requests meanwhile.

What keeps it standing under load and bad clients:
- **a bounded queue**: a request that would put more than `max_queued_texts` texts in the queue is refused
  at once (`Overloaded`, a 429), not queued behind work it would time out waiting for;
- **withdrawal**: a request whose client has gone, or whose deadline has passed, is taken out of the
  queue (its texts stop counting) and is never computed;
- **isolation**: when an engine call fails, its requests are run again one at a time, so only the
  request at fault fails (`EngineFailed`, a 500 naming no internals; the log says why in one line);
- **health**: `stalled()` says when the engine has not finished a call for longer than a bound, for
  /health.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

from mtbert.deploy.lifecycle import log
from mtbert.deploy.metrics import ServerMetrics
from mtbert.deploy.serve_config import Batching


class Overloaded(Exception):
    """The queue has no room for a request's texts."""


class EngineFailed(Exception):
    """The engine failed on this request alone (its batch was retried one request at a time)."""


@dataclasses.dataclass(eq=False)
class Pending:
    """One request's rows, waiting for the engine, then for its results (or error) in `future`."""
    task: str
    rows: list[tuple[str, ...]]
    request_id: str
    future: asyncio.Future
    queued_at: float = dataclasses.field(default_factory=time.monotonic)
    queue_seconds: float = 0.0  # from queued to its engine call's start
    compute_seconds: float = 0.0  # its engine call(s)
    queued: bool = True  # until its batch takes it, or it is withdrawn


class MicroBatcher:
    """Runs the engine on batches of the requests waiting together (see the module's docstring)."""

    def __init__(self, predictor, batching: Batching, max_queued_texts: int, metrics: ServerMetrics):
        self.predictor, self.batching, self.metrics = predictor, batching, metrics
        self.max_queued_texts = max_queued_texts
        self.waiting: collections.deque[Pending] = collections.deque()
        self.queued_texts = 0
        self.arrived: asyncio.Event | None = None
        self.loop_task: asyncio.Task | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtbert-engine")
        self.requests = self.engine_calls = 0
        self.call_started: float | None = None  # time.monotonic() of the engine call running now

    def start(self) -> None:
        self.arrived = asyncio.Event()
        self.loop_task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self.loop_task is not None:
            self.loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.loop_task
        self.executor.shutdown(wait=False, cancel_futures=True)

    def submit(self, task: str, rows: list[tuple[str, ...]], request_id: str) -> Pending:
        """Queue one request's rows, or refuse them (Overloaded) when the queue has no room."""
        if self.queued_texts + len(rows) > self.max_queued_texts:
            raise Overloaded(f"{self.queued_texts} texts are waiting for the engine; this request's {len(rows)} "
                             f"would pass the bound of {self.max_queued_texts} (--max-queued-texts)")
        pending = Pending(task, rows, request_id, asyncio.get_running_loop().create_future())
        self.requests += 1
        self.waiting.append(pending)
        self.queued_texts += len(rows)
        self.metrics.queue_depth.inc()
        self.arrived.set()
        return pending

    def withdraw(self, pending: Pending) -> None:
        """Its client has gone or its deadline passed: if still queued, it leaves the queue uncomputed."""
        if not pending.future.done():
            pending.future.cancel()
        if pending.queued:  # the batching loop drops it from `waiting` when it meets it
            pending.queued = False
            self.queued_texts -= len(pending.rows)
            self.metrics.queue_depth.dec()

    async def run(self) -> None:
        while True:
            while not self.waiting:
                self.arrived.clear()
                await self.arrived.wait()
            if self.batching.wait_ms:
                await asyncio.sleep(self.batching.wait_ms / 1000)
            batch = self.take_batch()
            if batch:
                await self.run_batch(batch)

    def take_batch(self) -> list[Pending]:
        """The waiting requests, oldest first, until the batch holds `max_batch` texts; withdrawn ones are
        dropped on the way."""
        batch, texts = [], 0
        while self.waiting and texts < self.batching.max_batch:
            pending = self.waiting.popleft()
            if not pending.queued:  # withdrawn
                continue
            pending.queued = False
            self.queued_texts -= len(pending.rows)
            self.metrics.queue_depth.dec()
            pending.queue_seconds = time.monotonic() - pending.queued_at
            self.metrics.queue_seconds.observe(pending.queue_seconds)
            batch.append(pending)
            texts += len(pending.rows)
        return batch

    async def run_batch(self, batch: list[Pending]) -> None:
        """One engine call per task of the batch; each request gets its own rows' results. A failed call is
        run again one request at a time, so that only the request at fault fails."""
        for task in dict.fromkeys(pending.task for pending in batch):
            group = [pending for pending in batch if pending.task == task]
            try:
                await self.answer(group)
            except Exception as error:
                if len(group) == 1:
                    self.fail(group[0], error)
                    continue
                for pending in group:
                    try:
                        await self.answer([pending])
                    except Exception as single_error:
                        self.fail(pending, single_error)

    async def answer(self, group: list[Pending]) -> None:
        """One engine call on the group's rows; each request's future gets its share of the results."""
        live = [pending for pending in group if not pending.future.done()]  # a client may have left meanwhile
        if not live:
            return
        rows = [row for pending in live for row in pending.rows]
        self.call_started = started = time.monotonic()
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.predictor.predict, live[0].task, rows)
        finally:
            self.call_started = None
            seconds = time.monotonic() - started
            self.metrics.compute_seconds.observe(seconds)
            for pending in live:
                pending.compute_seconds += seconds
        self.engine_calls += 1
        self.metrics.batch_texts.observe(len(rows))
        start = 0
        for pending in live:
            if not pending.future.done():
                pending.future.set_result(results[start:start + len(pending.rows)])
            start += len(pending.rows)

    def fail(self, pending: Pending, error: Exception) -> None:
        self.metrics.engine_errors.inc()
        log(f"request {pending.request_id}: the engine failed on its {len(pending.rows)} text(s) of task "
            f"{pending.task}: {type(error).__name__}: {' '.join(str(error).split())[:300]}")
        if not pending.future.done():
            pending.future.set_exception(EngineFailed())

    def stalled(self, bound: float) -> float | None:
        """How long the engine call running now has run, if longer than `bound` seconds; else None."""
        started = self.call_started
        if started is not None and time.monotonic() - started > bound:
            return time.monotonic() - started
        return None

    def stopped(self) -> bool:
        """Whether the batching loop has ended (it only ends on a bug, or at shutdown)."""
        return self.loop_task is not None and self.loop_task.done()
