"""The server's micro-batcher: concurrent /predict requests share engine calls.

A batch starts with the first waiting request, waits `wait_ms` for more, and takes every request then
waiting, up to `max_batch` texts. Its texts go to the engine per task, in calls of at most `max_batch`
texts and `max_batch_chars` characters, in a worker thread, so the event loop keeps accepting requests
meanwhile. The character budget keeps every call short (a call of 64 texts of 2,000 characters took
about 3 s on 2 cores), so that the engine soon turns to the next request. A text counts at most
CHARS_COUNTED characters: the models read at most `tokenize.max_length` tokens (128 by default, about
4 characters each), so a longer text costs about what one of that length costs.

What keeps it standing under load and bad clients:
- **a bounded queue**: a request is refused at once (`Overloaded`, a 429), not queued behind work it
  would time out waiting for, when it would put more than `max_queued_texts` texts in the queue, or when
  the engine, at the speed it has shown (characters a second), would need more than ADMIT_SHARE of the
  request timeout to clear the queue and it (never while the queue is empty: a lone request is tried);
- **withdrawal**: a request whose client has gone, or whose deadline has passed, is taken out of the
  queue (its texts stop counting) and is never computed; one that is being computed is dropped at the
  next call;
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
from mtbert.deploy.serve_config import Admission, Batching

CHARS_COUNTED = 512  # the characters a text counts at most (see the module's docstring)
ADMIT_SHARE = 0.5  # of the request timeout: the longest wait, as estimated, that a request is admitted to
SPEED_MEMORY = 0.8  # the weight of the past in the engine's measured speed (an exponential moving average)


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
    chars: int = 0  # its texts' characters (set from rows)
    queue_seconds: float = 0.0  # from queued to its first engine call's start
    compute_seconds: float = 0.0  # its engine call(s)
    queued: bool = True  # until its batch takes it, or it is withdrawn

    def __post_init__(self) -> None:
        self.chars = sum(map(row_chars, self.rows))


class MicroBatcher:
    """Runs the engine on batches of the requests waiting together (see the module's docstring)."""

    def __init__(self, predictor, batching: Batching, admission: Admission, metrics: ServerMetrics):
        self.predictor, self.batching, self.admission, self.metrics = predictor, batching, admission, metrics
        self.waiting: collections.deque[Pending] = collections.deque()
        self.queued_texts = self.queued_chars = 0
        self.chars_per_second: float | None = None  # the engine's speed, once it has run a call
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
        pending = Pending(task, rows, request_id, asyncio.get_running_loop().create_future())
        self.refuse_if_full(pending)
        self.requests += 1
        self.waiting.append(pending)
        self.queued_texts += len(rows)
        self.queued_chars += pending.chars
        self.metrics.queue_depth.inc()
        self.arrived.set()
        return pending

    def refuse_if_full(self, pending: Pending) -> None:
        bound = self.admission.max_queued_texts
        if self.queued_texts + len(pending.rows) > bound:
            raise Overloaded(f"{self.queued_texts} texts are waiting for the engine; this request's "
                             f"{len(pending.rows)} would pass the bound of {bound} (--max-queued-texts)")
        if self.chars_per_second and self.queued_texts:
            wait = (self.queued_chars + pending.chars) / self.chars_per_second
            if wait > ADMIT_SHARE * self.admission.request_timeout:
                raise Overloaded(f"at its present speed the engine would need about {wait:.0f} s to reach this "
                                 f"request and compute it, more than half the request timeout of "
                                 f"{self.admission.request_timeout:g} s (--request-timeout)")

    def withdraw(self, pending: Pending) -> None:
        """Its client has gone or its deadline passed: if still queued, it leaves the queue uncomputed."""
        if not pending.future.done():
            pending.future.cancel()
        if pending.queued:  # the batching loop drops it from `waiting` when it meets it
            self.leave_queue(pending)

    def leave_queue(self, pending: Pending) -> None:
        pending.queued = False
        self.queued_texts -= len(pending.rows)
        self.queued_chars -= pending.chars
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
            self.leave_queue(pending)
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
        """The group's rows (one task) in engine calls within the batch's budgets; each request's future gets
        its results once all its rows are computed. Before each call the rows of requests that are done
        (gone, timed out) are dropped."""
        work = [(pending, row) for pending in group for row in pending.rows]
        results: dict[Pending, list[dict]] = {pending: [] for pending in group}
        while work := [(pending, row) for pending, row in work if not pending.future.done()]:
            call, work = self.cut(work)
            computed, seconds = await self.call(group[0].task, [row for _, row in call])
            for (pending, _), result in zip(call, computed, strict=True):
                results[pending].append(result)
            for pending in dict.fromkeys(pending for pending, _ in call):
                pending.compute_seconds += seconds
                if len(results[pending]) == len(pending.rows) and not pending.future.done():
                    pending.future.set_result(results[pending])

    def cut(self, work: list) -> tuple[list, list]:
        """The first (request, row) pairs that fit one call (`max_batch` texts, `max_batch_chars` characters,
        at least one row), and the rest."""
        size, chars = 0, 0
        for _, row in work:
            chars += row_chars(row)
            if size and (size == self.batching.max_batch or chars > self.batching.max_batch_chars):
                break
            size += 1
        return work[:size], work[size:]

    async def call(self, task: str, rows: list[tuple[str, ...]]) -> tuple[list[dict], float]:
        """One engine call, in the worker thread, and its seconds (for /metrics and the engine's speed)."""
        self.call_started = started = time.monotonic()
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.predictor.predict, task, rows)
        finally:
            self.call_started = None
        seconds = time.monotonic() - started
        self.metrics.compute_seconds.observe(seconds)
        self.metrics.batch_texts.observe(len(rows))
        self.engine_calls += 1
        speed = sum(map(row_chars, rows)) / max(seconds, 1e-6)
        self.chars_per_second = speed if self.chars_per_second is None else \
            SPEED_MEMORY * self.chars_per_second + (1 - SPEED_MEMORY) * speed
        return results, seconds

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


def row_chars(row: tuple[str, ...]) -> int:
    """The characters a row counts for the budgets: each text's, at most CHARS_COUNTED."""
    return sum(min(len(text), CHARS_COUNTED) for text in row)
