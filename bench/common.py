"""What the benchmarks share: a training run set up as the `train` stage sets it up, steps timed as training
runs them, arms alternated block by block, a verdict against a target, the CPU's name, and `mtbert serve`
started, loaded and stopped on a loopback port."""

from __future__ import annotations

import asyncio
import logging
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the training modules import torch: the server's helpers do without
    from mtbert.training.build import FineTuning
    from mtbert.training.progress import Progress

# The HTTP client logs every request at INFO: thousands of lines in a terminal during a load test.
logging.getLogger("httpx").setLevel(logging.WARNING)


# --- training steps ----------------------------------------------------------------------------------------
def timed_steps(run: FineTuning, progress: Progress, steps: list[tuple[str, ...]]) -> list[float]:
    """Seconds of each of these steps: forward, backward and the optimiser update, as training runs them."""
    from mtbert.training.step import step

    seconds = []
    for tasks in steps:
        started = time.perf_counter()
        step(run, progress, tasks, ends_update=True)
        run.finite.check()  # reads the step's losses: on a GPU, waits for the step to finish
        seconds.append(time.perf_counter() - started)
    return seconds


def scratch_run(params, variant: str, tokenized_dir: Path, scratch: Path) -> tuple[FineTuning, Progress]:
    """The `train` stage's run of one variant, set up as the stage does, writing (if at all) only under
    `scratch`."""
    from mtbert.training.finetune import start
    from mtbert.training.loop import Paths

    paths = Paths(tokenized=tokenized_dir, model_out=scratch / "model", metrics_out=scratch / "metrics.json",
                  live_dir=scratch / "live", checkpoints=scratch / "checkpoints")
    return start(params, variant, paths)


def alternate_blocks(arms: dict[str, Callable[[list], list[float]]], batches: list,
                     block: int) -> dict[str, list[float]]:
    """Each arm's seconds per step over the same batches, block by block in turn after one untimed block each,
    so a slow spell of the machine hits every arm alike. An arm times the steps of the batches it is given."""
    for time_steps in arms.values():  # warm-up, untimed
        time_steps(batches[:block])
    times: dict[str, list[float]] = {name: [] for name in arms}
    for first in range(block, len(batches), block):
        for name, time_steps in arms.items():
            times[name] += time_steps(batches[first:first + block])
    return times


# --- reports -----------------------------------------------------------------------------------------------
def verdict(value: float, target: float, higher_is_better: bool) -> str:
    met = value >= target if higher_is_better else value <= target
    return f"(target {'>=' if higher_is_better else '<='} {target}: {'met' if met else 'NOT met'})"


def cpu_name() -> str:
    """The processor's model and its bf16 units, as Linux names them: a figure holds for that CPU only."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.processor() or "unknown")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    units = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags] or ["no bf16 units"]
    return f"{model} ({', '.join(units)})"


# --- the server ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(log: Path, *arguments, timeout: float = 120, env: dict | None = None,
                 new_session: bool = False, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """`mtbert serve` on a loopback port (`port`, else a free one; its stderr to `log`; `env` added to the
    environment; in a process group of its own with `new_session`), once /health answers: the process and
    its base URL; with `--workers N`, once the supervisor also says all N serve."""
    import os

    import httpx

    port = port or free_port()
    arguments = list(map(str, arguments))
    workers = int(arguments[arguments.index("--workers") + 1]) if "--workers" in arguments else 1
    with log.open("w") as stderr:  # a file, not a pipe: a pipe nobody reads could fill and block the server
        process = subprocess.Popen([sys.executable, "-m", "mtbert.cli", "serve", "--host", "127.0.0.1", "--port",
                                    str(port), *arguments], stdout=subprocess.DEVNULL, stderr=stderr,
                                   env={**os.environ, **(env or {})}, start_new_session=new_session)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    # one client for every poll: each of httpx's module-level calls builds an SSL context, tens of ms of CPU
    with httpx.Client(timeout=2, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        while time.time() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"mtbert serve exited: {log.read_text().strip()}")
            try:
                # several workers: /health reaches one of them, so also wait for the supervisor's word on all
                if http.get(f"{url}/health").status_code == 200 and (
                        workers == 1 or f"all {workers} worker(s) serving" in log.read_text()):
                    return process, url
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    stop_server(process)
    raise RuntimeError(f"mtbert serve did not answer /health within {timeout:.0f} s")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def load_test(url: str, task: str, sentences: list[tuple[str, ...]], clients: int, requests: int,
              timeout: float = 60) -> dict:
    """`clients` concurrent clients, each sending `requests` one-text requests one after another; every
    request ends as a status or a client error (a timeout, a refused connection), and all are counted."""
    import httpx

    outcomes: list[tuple[str, float]] = []

    async def client(number: int, http: httpx.AsyncClient) -> None:
        for index in range(requests):
            text = sentences[(number * requests + index) % len(sentences)]
            body = {"task": task, "texts": [text[0] if len(text) == 1 else list(text)]}
            started = time.perf_counter()
            try:
                response = await http.post("/predict", json=body)
                outcome = str(response.status_code)
            except httpx.HTTPError as error:
                outcome = type(error).__name__
            outcomes.append((outcome, time.perf_counter() - started))

    async def run() -> float:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
            started = time.perf_counter()
            await asyncio.gather(*(client(number, http) for number in range(clients)))
            return time.perf_counter() - started

    wall = asyncio.run(run())
    return {"clients": clients, "requests_per_client": requests, **load_summary(outcomes, wall, clients * requests)}


SHED = ("429", "503")  # the statuses of requests the server refused to compute



def load_summary(outcomes: list[tuple[str, float]], wall: float, sent: int) -> dict:
    """What a load test's (outcome, seconds) pairs add up to: every outcome counted, the share shed, the
    200s' p50 and p99 latency and rate, and the slowest answer of any outcome."""
    ok = [1000 * seconds for outcome, seconds in outcomes if outcome == "200"]
    counts = {outcome: sum(1 for o, _ in outcomes if o == outcome) for outcome in sorted({o for o, _ in outcomes})}
    return {"sent": sent, "answered": counts, "accounted_for": sum(counts.values()) == sent,
            "shed_share": round(sum(counts.get(status, 0) for status in SHED) / sent, 4),
            "latency_ms": {"p50": round(float(np.percentile(ok, 50)), 2) if ok else None,
                           "p99": round(float(np.percentile(ok, 99)), 2) if ok else None},
            "slowest_answer_s": round(max((seconds for _, seconds in outcomes), default=0.0), 2),
            "requests_per_second": round(len(ok) / wall, 1), "seconds": round(wall, 2)}


def peak_rss_mib(pid: int) -> float | None:
    """The peak resident memory (VmHWM) of a process and all its descendants (uvicorn's workers) summed,
    in MiB; None where /proc is not there (not Linux)."""
    def status(process: int, key: str) -> int:
        for line in Path(f"/proc/{process}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])  # kB
        return 0

    if not Path(f"/proc/{pid}/status").exists():
        return None
    family, total = [pid], 0
    while family:
        process = family.pop()
        total += status(process, "VmHWM:")
        for task in Path(f"/proc/{process}/task").iterdir():
            family += [int(child) for child in (task / "children").read_text().split()]
    return round(total / 1024, 1)
