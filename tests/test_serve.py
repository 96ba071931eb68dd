"""`mtbert serve`: the real server in its own process on a loopback port, called over HTTP by concurrent
clients; its results are the engine's, every limit and bad input gets its status and one-line message,
and it goes on answering."""

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.common import free_port, start_server, stop_server
from mtbert.deploy.engine import OnnxPredictor
from tests.conftest import REPO_ROOT, wait_for
from tests.loopback import HTTP

LIMITS = {"max_texts": 4, "max_chars": 200, "max_body_bytes": 2000}
STARTUP_SECONDS = 300  # generous: a loaded machine (the other test workers) slows the start
# the supervisor starts two spawned workers, each importing the engine and loading the export
TWO_WORKERS_ARE_SLOW = pytest.mark.slow(reason="two server worker processes")


@pytest.fixture(scope="module")
def server(deployed, tmp_path_factory):
    process, url = start_server(tmp_path_factory.mktemp("serve") / "stderr.log",
                                "--model", deployed.exports / "bi", "--engine", "onnx", "--threads", "1",
                                "--batch-wait-ms", "50", "--max-batch", "16",
                                *(f"--{key.replace('_', '-')}={value}" for key, value in LIMITS.items()),
                                timeout=STARTUP_SECONDS)
    yield url
    stop_server(process)


def requests_and_expected(deployed) -> list[tuple[dict, list[dict]]]:
    """Requests of every task, and what the engine itself answers to each."""
    engine = OnnxPredictor.load(deployed.exports / "bi", engine="onnx", threads=1)
    bodies = [{"task": "sst", "texts": ["A gorgeous, witty film."]},
              {"task": "sst", "texts": ["Dull.", "  It 's a -LRB- lovely -RRB- film . "]},
              {"task": "qqp", "texts": [["How do I cook rice?", "How to cook rice?"]]},
              {"task": "sts", "texts": [["A dog runs.", "A dog is running."], ["A man sings.", "A cat sleeps."]]},
              {"task": "sts", "texts": [["Two dogs play.", "Dogs are playing."]]}]
    return [(body, engine.predict(body["task"], [tuple(t) if isinstance(t, list) else t for t in body["texts"]]))
            for body in bodies]


def assert_results_equal(got: list[dict], expected: list[dict]) -> None:
    assert len(got) == len(expected)
    for row, want in zip(got, expected, strict=True):
        assert row.keys() == want.keys()
        for key, value in row.items():  # the batch a request joins changes the padding, not the values
            assert value == pytest.approx(want[key], abs=1e-5)


def test_concurrent_requests_get_the_engines_results_in_shared_batches(server, deployed):
    cases = requests_and_expected(deployed) * 6  # 30 requests, sent 15 at a time
    with httpx.Client(base_url=server, timeout=60) as client, ThreadPoolExecutor(15) as pool:
        before = client.get("/health").json()
        responses = list(pool.map(lambda case: client.post("/predict", json=case[0]), cases))
        after = client.get("/health").json()
    for response, (body, expected) in zip(responses, cases, strict=True):
        assert response.status_code == 200, response.text
        assert response.json()["task"] == body["task"]
        assert_results_equal(response.json()["results"], expected)
    assert after["requests"] - before["requests"] == len(cases)
    assert after["engine_calls"] - before["engine_calls"] < len(cases)  # requests shared engine calls


def test_tasks_and_health_describe_the_model(server):
    tasks = HTTP.get(f"{server}/tasks").json()["tasks"]
    assert tasks["sst"] == {"kind": "classification", "text": ["sentence"],
                            "results": [*(f"prob_{c}" for c in range(5)), "label"]}
    assert tasks["sts"] == {"kind": "regression", "text": ["sentence1", "sentence2"], "results": ["score", "label"]}
    health = HTTP.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["tasks"] == ["sst", "qqp", "sts"]


def chunks(data: bytes, size: int = 500):
    for start in range(0, len(data), size):
        yield data[start:start + size]


OVERSIZED = b'{"task": "sst", "texts": ["' + b"a" * 2100 + b'"]}'
REFUSALS = [
    # (what is sent, status, the one-line message)
    ({"content": b'{"task": "sst", "texts": ['}, 400, r"^the body is not valid JSON \(Expecting value: line 1"),
    ({"content": b"\xff\xfe\x00"}, 400, r"^the body is not valid JSON"),
    ({"content": b"[" * 1900}, 400, r"^the body is not valid JSON"),
    ({"json": ["sst"]}, 422, r'^expected a JSON object \{"task": \.\.\., "texts": \[\.\.\.\]\}$'),
    ({"json": {"task": "sst", "texts": ["x"], "id": 1}}, 422, r"^unknown key 'id'; a request has task and texts$"),
    ({"json": {"texts": ["x"]}}, 422, r"^task: expected the name of a task \(sst, qqp, sts\), got null$"),
    ({"json": {"task": "nli", "texts": ["x"]}}, 404, r"^unknown task 'nli'; this model predicts sst, qqp, sts$"),
    ({"json": {"task": "sst", "texts": []}}, 422, r"^texts: expected a non-empty list of texts"),
    ({"json": {"task": "sst", "texts": "one text"}}, 422, r"^texts: expected a non-empty list of texts"),
    ({"json": {"task": "sst", "texts": ["a", 5]}}, 422, r"^texts row 2: expected a string \(a pair task: a list of "
                                                        r"two strings\), got 5$"),
    ({"json": {"task": "sst", "texts": ["a", "\u200b "]}}, 422, r"^texts row 2: sentence is empty or invisible; "
                                                                r"expected a text with at least one visible char"),
    ({"json": {"task": "sts", "texts": [["only one side"]]}}, 422, r"^texts row 1: task sts reads a pair of "
                                                                   r"sentences \(sentence1, sentence2\), got 1 text"),
    ({"json": {"task": "sst", "texts": ["a"] * 5}}, 413, r"^texts: 5 texts, over the limit of 4 per request "
                                                         r"\(--max-texts\)$"),
    ({"json": {"task": "sts", "texts": [["a", "b" * 201]]}}, 413, r"^texts row 1: a text of 201 characters, over the "
                                                                  r"limit of 200 per text \(--max-chars\)$"),
    ({"content": OVERSIZED}, 413, rf"^request body of {len(OVERSIZED)} bytes is over the limit of 2000 bytes "
                                  r"\(--max-body-bytes\)$"),
    ({"content": chunks(b" " * 2500)}, 413, r"^request body is over the limit of 2000 bytes \(--max-body-bytes\)$"),
]


@pytest.mark.parametrize(("sent", "status", "message"), REFUSALS)
def test_every_limit_and_bad_input_is_refused_in_one_line_and_the_server_goes_on(server, sent, status, message):
    response = HTTP.post(f"{server}/predict", timeout=30, **sent)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(response.json()) == {"error"} and "\n" not in error and re.search(message, error), error
    assert HTTP.post(f"{server}/predict", json={"task": "sst", "texts": ["Fine."]}).status_code == 200


def test_unknown_paths_and_methods_are_refused_in_json(server):
    missing = HTTP.get(f"{server}/nothing")
    assert missing.status_code == 404 and missing.json() == {
        "error": "not found: GET /nothing; the API has POST /predict, GET /tasks, GET /health, GET /ready, "
                 "GET /metrics, GET /openapi.json"}
    wrong = HTTP.get(f"{server}/predict")
    assert wrong.status_code == 405 and wrong.json()["error"].startswith("method not allowed: GET /predict")


@TWO_WORKERS_ARE_SLOW
def test_several_workers_serve_the_same_results(deployed, tmp_path):
    process, url = start_server(tmp_path / "stderr.log", "--model", deployed.exports / "bi", "--engine", "onnx",
                                "--workers", "2", "--threads", "1", timeout=STARTUP_SECONDS)  # the fp32 graphs
    try:
        cases = requests_and_expected(deployed)
        with httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda case: client.post("/predict", json=case[0]), cases * 2))
        for response, (_, expected) in zip(responses, cases * 2, strict=True):
            assert response.status_code == 200, response.text
            assert_results_equal(response.json()["results"], expected)
    finally:
        stop_server(process)
    assert process.returncode is not None


def test_a_folder_that_cannot_be_served_stops_the_command_in_one_line(deployed, tmp_path):
    result = subprocess.run([sys.executable, "-m", "mtbert.cli", "serve", "--model", str(tmp_path / "none"),
                             "--engine", "onnx", "--port", str(free_port())], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=STARTUP_SECONDS)
    assert result.returncode == 1 and result.stderr == f"error: {tmp_path / 'none'} is not an export (no " \
        f"manifest.json), so ONNX Runtime cannot run it; write one with `mtbert export --model {tmp_path / 'none'} " \
        "--out exports/none` (or `dvc repro export@<variant>`), or use --engine torch\n"


def test_a_failed_engine_call_fails_only_the_request_at_fault(deployed):
    """An engine call that fails (here: a predictor that raises on one text) is run again one request at a
    time: the other requests of its batch get their results, the one at fault a 500 naming no internals."""
    import asyncio

    from mtbert.deploy.api import create_app
    from mtbert.deploy.serve_config import Batching

    class Failing:
        tasks = OnnxPredictor.load(deployed.exports / "bi").tasks
        calls = 0

        def predict(self, task, rows):
            Failing.calls += 1
            if any(row[0] == "boom" for row in rows):
                raise RuntimeError("the engine broke at /secret/path")
            return [{"score": 1.0, "label": 1.0} for _ in rows]

    async def scenario():
        app = create_app(Failing(), batching=Batching(wait_ms=200))  # the three requests share one batch
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport,
                                                                        base_url="http://test") as client:
            return await asyncio.gather(*(client.post("/predict", json={"task": "sst", "texts": [text]},
                                                      headers={"x-request-id": f"r{i}"})
                                          for i, text in enumerate(["fine", "boom", "also fine"])))

    fine, broken, also_fine = asyncio.run(scenario())
    assert broken.status_code == 500 and broken.json() == {
        "error": "internal error: the engine failed on this request; the server's log has the details under its "
                 "id r1"}
    assert fine.status_code == also_fine.status_code == 200 and fine.json()["results"] == [{"score": 1.0,
                                                                                              "label": 1.0}]
    assert Failing.calls == 4  # the batch, then each request alone


def test_a_trained_folder_is_served_by_pytorch_with_the_same_api(deployed):
    """The server takes any predictor: here PyTorch's, on the trained folder, in this process."""
    import asyncio

    from mtbert.deploy.api import create_app
    from mtbert.inference import Predictor

    predictor = Predictor.load(deployed.models / "cross", batch_size=8)
    pairs = [["A dog runs.", "A dog is running."], ["A man sings.", "A cat sleeps."]]

    async def scenario():
        app = create_app(predictor)
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport,
                                                                        base_url="http://test") as client:
            return await asyncio.gather(client.post("/predict", json={"task": "sts", "texts": pairs}),
                                        client.get("/tasks"))

    predicted, tasks = asyncio.run(scenario())
    assert predicted.status_code == 200
    assert_results_equal(predicted.json()["results"], predictor.predict("sts", [tuple(p) for p in pairs]))
    assert tasks.json()["tasks"]["qqp"] == {"kind": "binary", "text": ["sentence1", "sentence2"],
                                            "results": ["prob", "label"]}


# --- stopping, readiness and metrics -----------------------------------------------------------------------------
def send_until_stopped(url: str, stop: threading.Event, outcomes: list, text: str) -> None:
    """One client on one keep-alive connection: requests back to back until `stop`, each recorded as
    (when it was sent, its status or the name of the error that ended it)."""
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                outcome = client.post("/predict", json={"task": "sst", "texts": [text]}).status_code
            except httpx.TransportError as error:
                outcome = type(error).__name__
            outcomes.append((sent, outcome))
            if not isinstance(outcome, int):
                return  # the server is gone: a real client would go elsewhere


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=TWO_WORKERS_ARE_SLOW)])
def test_sigterm_under_load_answers_every_request_sent_before_it_and_exits_0(deployed, tmp_path, workers):
    log = tmp_path / "stderr.log"
    process, url = start_server(log, "--model", deployed.exports / "bi", "--engine", "onnx", "--threads", "1",
                                "--workers", str(workers), "--batch-wait-ms", "20", timeout=STARTUP_SECONDS)
    stop, outcomes = threading.Event(), []
    clients = [threading.Thread(target=send_until_stopped, args=(url, stop, outcomes, f"Film number {i}."))
               for i in range(8)]
    try:
        for client in clients:
            client.start()
        deadline = time.monotonic() + 60
        while len(outcomes) < 40 and time.monotonic() < deadline:  # under load
            time.sleep(0.01)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text()
    finally:
        stop.set()
        for client in clients:
            client.join()
        if process.poll() is None:
            stop_server(process)
    before = [outcome for sent, outcome in outcomes if sent < signalled]
    assert len(before) >= 40 and set(before) == {200}, collections.Counter(before)
    after = collections.Counter(outcome for sent, outcome in outcomes if sent >= signalled)
    # served on its connection, or refused; a close without an answer only on a connection the drain closed
    # as idle (a client thread that the test's load kept from sending for IDLE_LINGER), never a read request
    idle_closed = sum(int(n) for n in re.findall(r"; (\d+) idle connection\(s\) closed", log.read_text()))
    assert set(after) <= {200, "ConnectError", "RemoteProtocolError"}, after
    assert after["RemoteProtocolError"] <= idle_closed, (after, log.read_text())
    assert "SIGTERM: draining" in log.read_text() and "drained:" in log.read_text()


def test_a_drain_closes_a_connection_left_idle_and_counts_it(deployed, tmp_path):
    """The count that the SIGTERM test above holds a close without an answer to."""
    log = tmp_path / "stderr.log"
    process, url = start_server(log, "--model", deployed.exports / "bi", "--engine", "onnx", "--threads", "1",
                                timeout=STARTUP_SECONDS)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.post("/predict", json={"task": "sst", "texts": ["Fine."]}).status_code == 200
            process.send_signal(signal.SIGTERM)  # the connection stays open, idle
            assert process.wait(timeout=60) == 0
            with pytest.raises(httpx.TransportError):  # closed by the server: nothing answers on it
                client.post("/predict", json={"task": "sst", "texts": ["Too late."]})
    finally:
        if process.poll() is None:
            stop_server(process)
    assert "; 1 idle connection(s) closed; exiting" in log.read_text(), log.read_text()


def test_ready_is_503_while_draining_a_request_and_the_grace_period_ends_in_a_503(deployed, tmp_path):
    log = tmp_path / "stderr.log"
    # each batch waits 3 s for company: a request stays in flight that long
    process, url = start_server(log, "--model", deployed.exports / "bi", "--engine", "onnx", "--threads", "1",
                                "--batch-wait-ms", "3000", "--grace", "1", timeout=STARTUP_SECONDS)
    try:
        with httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(1) as pool:
            assert client.get("/ready").json() == {"status": "ready"}
            queued = client.get("/health").json()["requests"]
            waiting = pool.submit(lambda: HTTP.post(f"{url}/predict", json={"task": "sst", "texts": ["Fine."]},
                                                    timeout=60))
            wait_for(lambda: client.get("/health").json()["requests"] > queued, "the request queued")
            process.send_signal(signal.SIGTERM)
            answers = []  # /ready on the connection the server already had, until the drain has begun
            wait_for(lambda: answers.append(client.get("/ready")) or answers[-1].status_code != 200, "the drain")
            ready = answers[-1]
            assert ready.status_code == 503 and ready.headers["connection"] == "close"
            assert ready.json() == {"error": "draining: the server is shutting down and takes no new work"}
            refused = waiting.result()
        assert refused.status_code == 503 and refused.json()["error"].startswith(
            "the server is shutting down and its grace period ended before this request was served")
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            stop_server(process)
    # the request and the 503 at least. No upper bound: a request answered just before the signal (a /ready
    # or /health poll above) can be counted, when its bookkeeping runs after the drain began.
    drained = re.search(r"drained: (\d+) request\(s\) answered", log.read_text())
    assert drained and int(drained[1]) >= 2, log.read_text()


def counted(url: str) -> dict[tuple[str, str], float]:
    """mtbert_requests_total by (endpoint, status), parsed as Prometheus parses the text format."""
    from prometheus_client.parser import text_string_to_metric_families

    response = HTTP.get(f"{url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {family.name: family for family in text_string_to_metric_families(response.text)}
    assert {"mtbert_request_seconds", "mtbert_engine_batch_texts", "mtbert_queue_depth",
            "mtbert_engine_errors", "mtbert_requests_in_flight"} <= set(families)
    assert [s.value for s in families["mtbert_requests_in_flight"].samples] == [1]  # this scrape alone
    return {(s.labels["endpoint"], s.labels["status"]): s.value for s in families["mtbert_requests"].samples
            if s.name == "mtbert_requests_total"}


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=TWO_WORKERS_ARE_SLOW)])
def test_metrics_count_every_request_of_every_worker(deployed, tmp_path, workers):
    process, url = start_server(tmp_path / "stderr.log", "--model", deployed.exports / "bi", "--engine", "onnx",
                                "--threads", "1", "--workers", str(workers), timeout=STARTUP_SECONDS)
    try:
        before = counted(url)
        for index in range(12):  # a connection each: the kernel spreads them over the workers
            HTTP.post(f"{url}/predict", json={"task": "sst", "texts": [f"Film {index}."]}).raise_for_status()
        assert HTTP.post(f"{url}/predict", json={"task": "sst", "texts": []}).status_code == 422
        after = counted(url)
    finally:
        stop_server(process)
    def grew(key):
        return after.get(key, 0) - before.get(key, 0)
    assert grew(("/predict", "200")) == 12 and grew(("/predict", "422")) == 1
    assert grew(("/metrics", "200")) == 1  # the first scrape, counted before its answer ended


def test_an_output_file_that_cannot_be_written_is_one_line(deployed, tmp_path):
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    result = subprocess.run([sys.executable, "-m", "mtbert.cli", "predict", "--model", str(deployed.exports / "bi"),
                             "--task", "sst", "--output", str(read_only / "out.jsonl"), "Fine."], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=STARTUP_SECONDS)
    if os.geteuid() == 0:  # root writes anywhere: a path under a file fails for everyone
        result = subprocess.run([sys.executable, "-m", "mtbert.cli", "predict", "--model",
                                 str(deployed.exports / "bi"), "--task", "sst", "--output",
                                 str(REPO_ROOT / "README.md" / "out.jsonl"), "Fine."], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=STARTUP_SECONDS)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: --output ") and "cannot write it (" in result.stderr


def test_a_layout_with_more_threads_than_cores_is_warned_about():
    from mtbert.cli import oversubscription

    assert oversubscription(1, 2, 2) is None and oversubscription(2, 1, 2) is None
    assert oversubscription(2, 2, 2).startswith("2 worker(s) x 2 thread(s) = 4 threads on 2 core(s)")


def test_each_option_is_described_once_and_the_command_line_is_made_from_it(monkeypatch):
    """serve_config's dataclasses describe every flag (default, bound, help, environment variable): a flag
    sets its field, a bound and a choice are enforced, the api key comes from its variable, and every
    described option is in `--help`."""
    from typer.testing import CliRunner

    from mtbert.cli import CommandInputError, app
    from mtbert.deploy import server
    from mtbert.deploy.serve_config import Admission, Listening, serve_options
    from mtbert.predictors import serving_predictor

    seen = {}
    monkeypatch.setattr(server, "run_server",
                        lambda config, load, **listening: seen.update(config=config, load=load, **listening))
    result = CliRunner().invoke(app, ["serve", "--model", "m", "--max-texts", "7", "--batch-wait-ms", "5",
                                      "--port", "9", "--threads", "1"], env={"MTBERT_API_KEY": "k"})
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.model, config.limits.max_texts, config.batching.wait_ms, config.operations.api_key,
            config.threads) == ("m", 7, 5.0, "k", 1)
    assert (seen["port"], seen["grace"], seen["workers"]) == (9, Listening.grace, 1)
    assert config.admission == Admission()  # what was not given keeps its described default
    assert seen["load"] is serving_predictor  # handed to the server, which imports nothing from above it
    bound = CliRunner().invoke(app, ["serve", "--model", "m", "--max-texts", "0"])
    assert bound.exit_code == 2 and "--max-texts" in bound.output
    choice = CliRunner().invoke(app, ["serve", "--model", "m", "--access-log", "xml"])
    assert isinstance(choice.exception, CommandInputError)
    assert str(choice.exception) == "--access-log 'xml': expected one of none, text, json"
    shown = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    assert all(f"--{described.flag}" in shown for described in serve_options())


def post_until_answered(http: httpx.Client, url: str, body: dict, request_id: str, deadline: float,
                        sent: collections.Counter) -> httpx.Response:
    """The client docs/serving.md shows: a 429 or 503 is sent again after its Retry-After, a refused or
    dropped connection (the server restarting) after a moment; anything else is the answer. `sent` counts
    each attempt under the request's id."""
    while time.monotonic() < deadline:
        sent[request_id] += 1
        try:
            answer = http.post(f"{url}/predict", json=body, headers={"X-Request-ID": request_id})
        except httpx.TransportError:
            time.sleep(0.2)
            continue
        if answer.status_code not in (429, 503):
            return answer
        time.sleep(float(answer.headers.get("Retry-After", "1")))
    raise TimeoutError(f"request {request_id}: no answer before the deadline")


def answered(log: Path) -> collections.Counter:
    """The request ids a server answered 200 to /predict, as its JSON access log counts them."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"time"')]
    return collections.Counter(line["request_id"] for line in lines
                               if line["path"] == "/predict" and line["status"] == 200)


@pytest.mark.slow(reason="two real servers, one after the other, under load")
def test_a_retrying_client_gets_every_answer_once_across_a_drain_and_a_restart(deployed, tmp_path):
    """N requests from 4 clients while the server drains on SIGTERM and a new one starts on the same port:
    N answers, each request's own (its X-Request-ID) and the engine's, each answered once by the servers
    (their access logs), the second server answering some, and no traceback in either log."""
    engine = OnnxPredictor.load(deployed.exports / "bi", engine="onnx", threads=1)
    port, requests = free_port(), 60
    arguments = ("--model", deployed.exports / "bi", "--engine", "onnx", "--threads", "1", "--access-log", "json")
    first, url = start_server(tmp_path / "first.log", *arguments, port=port, timeout=STARTUP_SECONDS)
    answers: dict[int, list[httpx.Response]] = collections.defaultdict(list)
    sent = collections.Counter()
    deadline = time.monotonic() + STARTUP_SECONDS

    def client(numbers: range) -> None:
        with httpx.Client(timeout=60) as http:
            for number in numbers:
                answers[number].append(post_until_answered(
                    http, url, {"task": "sst", "texts": [f"Film number {number}."]}, str(number), deadline, sent))

    clients = [threading.Thread(target=client, args=(range(k, requests, 4),)) for k in range(4)]
    second = None
    try:
        for thread in clients:
            thread.start()
        while len(answers) < requests // 4 and time.monotonic() < deadline:  # a quarter answered: under load
            time.sleep(0.01)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0
        second, _ = start_server(tmp_path / "second.log", *arguments, port=port, timeout=STARTUP_SECONDS)
        for thread in clients:
            thread.join()
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                stop_server(process)
    assert sorted(answers) == list(range(requests)) and all(len(got) == 1 for got in answers.values())
    for number, (answer,) in answers.items():
        assert answer.status_code == 200 and answer.headers["X-Request-ID"] == str(number)
        assert_results_equal(answer.json()["results"], engine.predict("sst", [f"Film number {number}."]))
    by_first, by_second = answered(tmp_path / "first.log"), answered(tmp_path / "second.log")
    assert by_first + by_second == collections.Counter(str(number) for number in range(requests))  # each once
    assert by_second, "the second server answered none: the restart was not under load"
    retries = sum(sent.values()) - requests  # counted, not bounded: a drain need not refuse any request
    print(f"\n  first server answered {len(by_first)}, second {len(by_second)}; {retries} retries")
    for log in ("first.log", "second.log"):
        assert "Traceback" not in (tmp_path / log).read_text()
