"""`python -m bench.serve`: `mtbert serve` under a normal load and an overload, driven over loopback by a real
HTTP client (httpx), bounded in count and time. Writes metrics/bench-serve.json.

One server, with its default limits, serves three phases in turn:
1. **normal**: `--clients` clients, each sending `--requests` one-sentence requests back to back;
2. **overload**: `--overload` connections at once, each sending one request of `--overload-texts` texts of
   `--overload-chars` characters (the issue's probe: 1,500 x 64 x 2,000), every client waiting longer than
   the server's request timeout, so that each request ends as the server's answer;
3. **vanishing clients**: the same overload again, but every client hangs up after `--give-up` seconds,
   as clients that time out do.
After phases 2 and 3 a fresh one-sentence request is sent and timed: how soon the server answers again.
Per phase: throughput, p50 and p99 latency of the answered (200) requests, every status counted, the share
shed (429 and 503), the slowest answer of any status, and the server's peak memory (VmHWM, summed over
its processes) after it. And from the server's own JSON access log, each admitted request's (every status
but 429) time to its answer, against `--request-timeout`: the server answers or refuses every request it
took within that bound, whatever its clients wait.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import typer

from bench.common import load_summary, load_test, peak_rss_mib, start_server, stop_server

app = typer.Typer(add_completion=False)


def overload(url: str, task: str, texts: list[str], connections: int, timeout: float) -> dict:
    """`connections` clients at once, each one request of `texts`, each waiting at most `timeout` seconds."""
    import httpx

    body = httpx.Request("POST", "/predict", json={"task": task, "texts": texts}).content  # serialized once
    outcomes: list[tuple[str, float]] = []

    async def client(http: httpx.AsyncClient) -> None:
        started = time.perf_counter()
        try:
            response = await http.post("/predict", content=body, headers={"content-type": "application/json"})
            outcome = str(response.status_code)
        except httpx.HTTPError as error:
            outcome = type(error).__name__
        outcomes.append((outcome, time.perf_counter() - started))

    async def run() -> float:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
            started = time.perf_counter()
            await asyncio.gather(*(client(http) for _ in range(connections)))
            return time.perf_counter() - started

    wall = asyncio.run(run())
    return load_summary(outcomes, wall, sent=connections)


TIMER_SLACK = 1.0  # seconds past --request-timeout that an answer may take: the deadline's timer and the event loop


def admitted_answers(log: Path, start: int, request_timeout: float, answered: int = 0,
                     wait: float = 30.0) -> tuple[dict, int]:
    """What the server's JSON access log says, after byte `start`, of the /predict requests it admitted (every
    status but 429): how many, the slowest one's seconds to its answer, and whether each came within
    `request_timeout`; and the end of its last whole line, for the next phase. The server writes a request's
    line just after its answer has gone, so this first waits (up to `wait` seconds) until the log holds a
    /predict line for each of the `answered` requests that its clients saw answered."""
    waited_until = time.monotonic() + wait
    while True:
        text = log.read_bytes()
        end = text.rfind(b"\n", start) + 1 or start  # a line still being written is left for the next read
        lines = [json.loads(line) for line in text[start:end].decode(errors="replace").splitlines()
                 if line.startswith('{"time"')]
        predict = [line for line in lines if line["path"] == "/predict"]
        if len(predict) >= answered or time.monotonic() > waited_until:
            break
        time.sleep(0.05)
    seconds = [line["seconds"] for line in predict if line["status"] != 429]
    return {"requests": len(seconds), "slowest_s": round(max(seconds, default=0.0), 3),
            "request_timeout_s": request_timeout, "logged_of_answered": [len(predict), answered],
            "within_timeout": all(value <= request_timeout + TIMER_SLACK for value in seconds)}, end


def http_answers(phase: dict) -> int:
    """How many of a phase's requests got an HTTP answer (a status, not a client-side error)."""
    return sum(count for outcome, count in phase["answered"].items() if outcome.isdigit())


def first_answer_seconds(url: str, task: str, sentence: str, timeout: float = 60) -> tuple[float, int]:
    """How long a fresh one-sentence request takes to be answered, and its status. The client is made before
    the clock starts: making one builds an SSL context, tens of ms that are the client's, not the server's."""
    import httpx

    with httpx.Client(timeout=timeout) as http:
        started = time.perf_counter()
        response = http.post(f"{url}/predict", json={"task": task, "texts": [sentence]})
        return round(time.perf_counter() - started, 3), response.status_code


def long_texts(sentences: list[str], count: int, chars: int) -> list[str]:
    """`count` texts of exactly `chars` characters, made of real sentences."""
    stream = " ".join(sentences)
    while len(stream) < chars * count:
        stream += " " + stream
    return [stream[start * chars:(start + 1) * chars] for start in range(count)]


def serve_figures(export_dir: Path, sentences: list[str], *, task: str = "sst", clients: int = 32,
                  requests: int = 20, connections: int = 1500, texts: int = 64, chars: int = 2000,
                  give_up: float = 1.0, client_timeout: float = 45.0, request_timeout: float = 30.0,
                  server_args: tuple = (), scratch: Path) -> dict:
    log = scratch / "serve.log"
    process, url = start_server(log, "--model", export_dir, "--access-log", "json", "--request-timeout",
                                request_timeout, *server_args, timeout=300)
    heavy = long_texts(sentences, texts, chars)
    figures: dict = {"server_args": [str(a) for a in server_args], "peak_rss_mib": {}}
    try:
        figures["peak_rss_mib"]["idle"] = peak_rss_mib(process.pid)
        print(f"  normal: {clients} clients x {requests} one-sentence requests ...", flush=True)
        figures["normal"] = load_test(url, task, [(s,) for s in sentences], clients, requests,
                                      timeout=client_timeout)
        figures["peak_rss_mib"]["normal"] = peak_rss_mib(process.pid)
        print(f"  overload: {connections} connections at once, {texts} texts x {chars} characters each ...",
              flush=True)
        read = log.stat().st_size
        figures["overload"] = overload(url, task, heavy, connections, client_timeout)
        figures["overload"]["admitted"], read = admitted_answers(log, read, request_timeout,
                                                                 answered=http_answers(figures["overload"]))
        figures["overload"]["fresh_request_after"] = first_answer_seconds(url, task, sentences[0])
        figures["peak_rss_mib"]["overload"] = peak_rss_mib(process.pid)
        print(f"  vanishing: the same, every client hanging up after {give_up:g} s ...", flush=True)
        figures["vanishing"] = overload(url, task, heavy, connections, give_up)
        figures["vanishing"]["fresh_request_after"] = first_answer_seconds(url, task, sentences[0])
        figures["peak_rss_mib"]["vanishing"] = peak_rss_mib(process.pid)
    finally:
        stop_server(process)
    # after the drain, which logs every request still held: hung-up clients' requests end after they went
    figures["vanishing"]["admitted"], _ = admitted_answers(log, read, request_timeout)
    figures["server_exit_status"] = process.returncode
    figures["server_log_tail"] = [line for line in log.read_text().splitlines() if not line.startswith('{"time"')][-3:]
    return figures


def report(f: dict) -> None:
    n = f["normal"]
    print(f"mtbert serve {' '.join(f['server_args'])}; peak RSS (MiB) {f['peak_rss_mib']}")
    print(f"  normal: {n['sent']} requests from {n['clients']} clients, {n['requests_per_second']} requests/s, "
          f"p50 {n['latency_ms']['p50']} ms, p99 {n['latency_ms']['p99']} ms, answered {n['answered']} (shed "
          f"{100 * n['shed_share']:.1f}%)")
    for phase in ("overload", "vanishing"):
        o = f[phase]
        print(f"  {phase}: {o['sent']} requests, answered {o['answered']} (shed {100 * o['shed_share']:.1f}%), "
              f"{o['requests_per_second']} answered requests/s, p50 {o['latency_ms']['p50']} ms, p99 "
              f"{o['latency_ms']['p99']} ms, slowest {o['slowest_answer_s']} s; a fresh request after it: "
              f"{o['fresh_request_after'][0]} s ({o['fresh_request_after'][1]}); {o['admitted']['requests']} "
              f"admitted, the slowest answered in {o['admitted']['slowest_s']} s against a request timeout of "
              f"{o['admitted']['request_timeout_s']:g} s")


@app.command()
def main(model: Path = typer.Option(Path("exports/ensemble"), help="the export to serve"),
         tokenized_dir: Path = typer.Option(Path("data/tokenized/base"), help="where the dev sentences come from"),
         task: str = typer.Option("sst", help="a one-sentence task of the model"),
         clients: int = typer.Option(32, min=1), requests: int = typer.Option(20, min=1),
         connections: int = typer.Option(1500, "--overload", min=1, help="concurrent connections of the overload"),
         texts: int = typer.Option(64, "--overload-texts", min=1), chars: int = typer.Option(2000, "--overload-chars"),
         give_up: float = typer.Option(1.0, min=0.1, help="seconds after which a vanishing client hangs up"),
         threads: int = typer.Option(0, min=0, help="the server's threads; 0: every core"),
         request_timeout: float = typer.Option(30.0, min=0.1, help="the server's --request-timeout, the bound "
                                                                   "each admitted request's answer is held to"),
         server_arg: list[str] = typer.Option([], help="one more argument for `mtbert serve` (repeat)"),
         json_out: Path = typer.Option(Path("metrics/bench-serve.json"))) -> None:
    """`mtbert serve` under normal load, overload and vanishing clients (see the module's docstring)."""
    import tempfile

    from mtbert import io
    from mtbert.deploy.engine import load_export
    from mtbert.export.ensemble import dev_texts

    sentences = [row[0] for row in dev_texts(tokenized_dir, {task: load_export(model).tasks[task]}, 1000)[task]]
    server_args = (*(("--threads", threads) if threads else ()), *server_arg)
    with tempfile.TemporaryDirectory() as scratch:
        figures = serve_figures(model, sentences, task=task, clients=clients, requests=requests,
                                connections=connections, texts=texts, chars=chars, give_up=give_up,
                                request_timeout=request_timeout, server_args=server_args, scratch=Path(scratch))
    report(figures)
    io.write_json(json_out, figures)


if __name__ == "__main__":
    app()
