"""The server's Prometheus metrics (GET /metrics), with prometheus-client.

With several workers (`mtbert serve --workers N`) each worker is its own process, so the figures live in
prometheus-client's multiprocess mode: the parent points PROMETHEUS_MULTIPROC_DIR at a fresh folder before
the workers start, every worker writes its counters there, and whichever worker answers /metrics adds up
all of them (counters and histograms summed, the queue depth summed over live workers). With one worker the
figures are that process's own.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

MULTIPROCESS_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServerMetrics:
    """What an operator watches: requests by endpoint and status, their latency split into time queued and
    time computed, the texts per engine call, the requests inside the server and those waiting for the
    engine, the requests shed (and why), and the engine's errors."""

    def __init__(self) -> None:
        # One registry per app, so that several apps in one process (the tests) do not collide.
        self.registry = CollectorRegistry()
        self.requests = Counter("mtbert_requests", "HTTP requests answered, by endpoint and status",
                                ("endpoint", "status"), registry=self.registry)
        self.latency = Histogram("mtbert_request_seconds", "Time from a request's arrival to its response",
                                 ("endpoint",), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_texts = Histogram("mtbert_engine_batch_texts", "Texts per engine call (the micro-batch size)",
                                     buckets=BATCH_BUCKETS, registry=self.registry)
        self.queue_seconds = Histogram("mtbert_queue_seconds", "Time a /predict request waited for its engine call",
                                       buckets=LATENCY_BUCKETS, registry=self.registry)
        self.compute_seconds = Histogram("mtbert_compute_seconds", "Time of one engine call",
                                         buckets=LATENCY_BUCKETS, registry=self.registry)
        self.shed = Counter("mtbert_shed_requests", "Requests not computed, by reason: overloaded (429), "
                            "timeout or shutdown (503), client_gone", ("reason",), registry=self.registry)
        self.queue_depth = Gauge("mtbert_queue_depth", "Requests waiting for the engine",
                                 registry=self.registry, multiprocess_mode="livesum")
        self.in_flight = Gauge("mtbert_requests_in_flight", "Requests inside the server: being read, waiting, "
                               "computed or answered (a scrape of /metrics counts itself)",
                               registry=self.registry, multiprocess_mode="livesum")
        self.engine_errors = Counter("mtbert_engine_errors", "Requests the engine failed on (each retried alone first)",
                                     registry=self.registry)

    def exposition(self) -> tuple[bytes, str]:
        """The text format of every worker's figures (see the module's docstring), and its content type."""
        if os.environ.get(MULTIPROCESS_VARIABLE):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def worker_exited(pid: int) -> None:
    """Drop a finished worker's live gauges (its counters still count)."""
    if os.environ.get(MULTIPROCESS_VARIABLE):
        multiprocess.mark_process_dead(pid)
