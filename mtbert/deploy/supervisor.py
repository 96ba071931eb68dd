"""`mtbert serve --workers N`: one parent process that binds the port once and keeps N spawned workers on it.

- "all N worker(s) serving" is logged once every worker serves; until then a signal can stop a worker that
  is still loading its model (it has no request to drain).
- A worker that dies after it started is replaced.
- A worker that dies before it started (its model failed to load, the port's socket failed, ...) counts as a
  start failure. After START_FAILURES of them in a row the server stops, in one line, instead of starting
  workers for ever.
- SIGTERM or SIGINT: the parent closes its copy of the socket, sends SIGTERM to every worker and waits for
  their drains (mtbert/deploy/lifecycle.py). A second signal to the parent ends the workers' grace period
  (SIGUSR1). A worker ignores a repeated SIGTERM, so a signal to the whole process group, which reaches
  each worker twice, is one drain.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import uvicorn

from mtbert.deploy.lifecycle import DRAIN_BOUND, log
from mtbert.deploy.metrics import worker_exited
from mtbert.runtime import UserError

START_FAILURES = 3  # workers in a row that die before they start, before the server gives up


class WorkersFailedToStart(UserError, RuntimeError):
    """Every try to start a worker failed: the server cannot serve."""


def supervise(worker, workers: int, *, host: str, port: int, grace: float) -> None:
    """Run `worker(sock, started)` in `workers` spawned processes sharing one bound socket; `started` is an
    event the worker sets once it serves (see the module's docstring)."""
    supervisor = Supervisor(worker, uvicorn.Config(app=None, host=host, port=port).bind_socket(), grace)
    previous = {sig: signal.signal(sig, supervisor.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for _ in range(workers):
            supervisor.start()
        error = supervisor.watch()
        supervisor.stop_workers()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if error is not None:
        raise error


class Supervisor:
    def __init__(self, worker, sock, grace: float):
        self.worker, self.sock, self.grace = worker, sock, grace
        self.context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.Process] = []
        self.started: list = []  # each process's event, set once it serves
        self.signals: list[int] = []
        self.stop = threading.Event()

    def on_signal(self, sig, frame) -> None:
        self.signals.append(sig)
        if len(self.signals) == 2:  # the first starts the drain (stop_workers); the second ends its grace period
            for process in self.processes:
                if process.is_alive():
                    os.kill(process.pid, signal.SIGUSR1)
        self.stop.set()

    def start(self, index: int | None = None) -> None:
        """A new worker, in slot `index` (replacing the one there) or in a new slot."""
        started = self.context.Event()
        process = self.context.Process(target=self.worker, args=(self.sock, started), daemon=False)
        process.start()
        if index is None:
            self.processes.append(process)
            self.started.append(started)
        else:
            self.processes[index], self.started[index] = process, started

    def watch(self) -> WorkersFailedToStart | None:
        """Replace the workers that end, until a signal or START_FAILURES failed starts in a row."""
        failures, serving = 0, False
        while not self.stop.wait(0.1):
            serving = self.announce_serving(serving)
            for index, process in enumerate(self.processes):
                if process.is_alive() or self.stop.is_set():
                    continue
                worker_exited(process.pid)
                failures = 0 if self.started[index].is_set() else failures + 1
                if failures >= START_FAILURES:
                    return WorkersFailedToStart(f"{failures} workers in a row stopped before they could serve (the "
                                                f"last with exit status {process.exitcode}; its error is above); "
                                                "stopping the server")
                log(f"worker {process.pid} ended (exit status {process.exitcode}); starting another")
                self.start(index)
        return None

    def announce_serving(self, announced: bool) -> bool:
        """Log once each time every worker serves (at start, and after a replacement): whether all serve."""
        serving = all(started.is_set() for started in self.started)
        if serving and not announced:
            log(f"all {len(self.processes)} worker(s) serving")
        return serving

    def stop_workers(self) -> None:
        log(f"stopping: {len(self.processes)} worker(s) drain, for at most {self.grace:g} s")
        self.sock.close()  # the workers' copies close as they drain; then new connections are refused
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
        for process in self.processes:
            process.join(self.grace + DRAIN_BOUND + 5)
            if process.is_alive():  # a drain is bounded: this worker is stuck
                log(f"worker {process.pid} did not stop within its grace period; killing it")
                process.kill()
                process.join()
            worker_exited(process.pid)
        log("every worker has stopped")
