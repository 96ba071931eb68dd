"""The server's own rules, each shown on a real server in this process (tests/inprocess.py) called by a real HTTP
client: request ids, the bearer token, admission (the concurrency bound, the queue's bounds), deadlines, the end of
a drain's grace period, the drain's accept queue (lifecycle.py: queued clients taken, late ones refused, never
reset), clients that hang up, counting and access logs (mtbert/deploy/middleware.py, batcher.py), and the OpenAPI
document's parts (schema.py). The engine is held at a gate the test opens, so events are ordered by what the server
answers and counts, never by sleeps; it answers the label a text's length gives, because the rules are the server's,
not a model's (the subprocess tests of test_serve.py and test_serve_hostile.py serve a real export). No fixture is
built, so `make mutation` runs these per mutant."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time

import httpx
import pytest

from mtbert.deploy.api import create_app
from mtbert.deploy.engine import ExportedTask
from mtbert.deploy.serve_config import Admission, Batching, Limits, Operations
from tests.conftest import wait_for
from tests.inprocess import InProcess
from tests.loopback import HTTP

KEY = "s3cret-token"
PATIENCE = 10  # seconds for what takes milliseconds here: the server's answers, its counters, the engine's gate
SENTENCE = {"kind": "classification", "columns": ["prob_0", "prob_1"], "text": ["sentence"], "encoding": "single",
            "clean": {"replace": []}, "graphs": {"onnx": "sst.onnx"}}
PAIR = {"kind": "binary", "columns": ["prob_1"], "text": ["sentence1", "sentence2"], "encoding": "bi",
        "clean": {"replace": []}, "graphs": {"onnx": "qqp.onnx"}}
PLANTED_FAILURE = "a planted\nengine failure, " + "long " * 80  # several lines, over 300 characters


class GatedEngine:
    """Two tasks as an export's manifest describes them (a sentence, a pair), and engine calls that wait at a
    gate while it is shut. Records each call's rows; a text "boom" makes its call fail."""

    def __init__(self, shut: bool = False):
        self.tasks = {"sst": ExportedTask.from_manifest("sst", SENTENCE, "test"),
                      "qqp": ExportedTask.from_manifest("qqp", PAIR, "test")}
        self.gate = threading.Event()
        if not shut:
            self.gate.set()
        self.calls: list[list[tuple[str, ...]]] = []

    def predict(self, task: str, rows: list[tuple[str, ...]]) -> list[dict]:
        if task not in self.tasks:
            raise KeyError(f"no task {task!r}")
        self.calls.append(list(rows))
        assert self.gate.wait(PATIENCE), "the test never opened the gate"
        if any(text == "boom" for row in rows for text in row):
            raise RuntimeError(PLANTED_FAILURE)
        return [{"prob_1": 0.5, "label": len(row[0])} for row in rows]

    def texts_called(self) -> list[str]:
        return [row[0] for call in self.calls for row in call]


@contextlib.contextmanager
def serving(engine: GatedEngine, limits=Limits(), admission=Admission(), operations=Operations(),
            batching=Batching(wait_ms=0)):
    """The app over `engine`, served in this process: its URL, the app (its lifecycle) and the server."""
    app = create_app(engine, limits=limits, batching=batching, admission=admission, operations=operations)
    server = InProcess(app)
    try:
        with server as url:
            yield url, app, server
    finally:
        engine.gate.set()  # a test that failed with the gate shut leaves no engine call waiting


def predict(url: str, texts: list, task: str = "sst", **headers) -> httpx.Response:
    return HTTP.post(f"{url}/predict", json={"task": task, "texts": texts}, headers=headers, timeout=PATIENCE)


def in_background(call) -> tuple[threading.Thread, list]:
    """`call()` in a thread; its answer lands in the list."""
    answers: list = []
    thread = threading.Thread(target=lambda: answers.append(call()), daemon=True)
    thread.start()
    return thread, answers


def counted(url: str, name: str, **labels) -> float:
    """A figure of /metrics (0 if it has no such sample yet)."""
    text = HTTP.get(f"{url}/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def held_in_the_engine(url: str, engine: GatedEngine, texts: list[str]) -> tuple[threading.Thread, list]:
    """A request sent in the background and held in the engine's first call, at its shut gate."""
    held = in_background(lambda: predict(url, texts))
    until(lambda: len(engine.calls) == 1, "the first request in the engine")
    return held


def until(condition, what: str) -> None:
    wait_for(condition, what, timeout=PATIENCE)


def submitted(url: str) -> int:
    return HTTP.get(f"{url}/health").json()["requests"]


# --- request ids --------------------------------------------------------------------------------------------
def test_a_plain_request_id_is_echoed_and_any_other_is_replaced_by_a_new_one():
    with serving(GatedEngine()) as (url, _, _):
        assert predict(url, ["a film"], **{"x-request-id": "client-7.a:b_c"}).headers["x-request-id"] == \
            "client-7.a:b_c"
        for unsafe in ("two words", "x" * 129, "quote\"d", "new%0Aline"):
            echoed = predict(url, ["a film"], **{"x-request-id": unsafe}).headers["x-request-id"]
            assert re.fullmatch(r"[0-9a-f]{32}", echoed), (unsafe, echoed)
        assert predict(url, ["a film"], **{"x-request-id": "y" * 128}).headers["x-request-id"] == "y" * 128
        first, second = (predict(url, ["a film"]).headers["x-request-id"] for _ in range(2))
        assert first != second and re.fullmatch(r"[0-9a-f]{32}", first)


def test_every_answer_carries_its_request_id_refusals_and_unknown_paths_included():
    with serving(GatedEngine(), operations=Operations(api_key=KEY)) as (url, _, _):
        answers = [HTTP.post(f"{url}/predict", json={}, headers={"x-request-id": "r1"}),  # 401
                   HTTP.get(f"{url}/nowhere", headers={"x-request-id": "r2"}),  # 404
                   predict(url, ["a film"], authorization=f"Bearer {KEY}", **{"x-request-id": "r3"}),
                   predict(url, [""], authorization=f"Bearer {KEY}", **{"x-request-id": "r4"})]  # 422
        assert [(answer.status_code, answer.headers["x-request-id"]) for answer in answers] == \
            [(401, "r1"), (404, "r2"), (200, "r3"), (422, "r4")]


# --- the bearer token ---------------------------------------------------------------------------------------
def test_predict_and_metrics_ask_for_the_token_and_the_probes_and_the_document_do_not():
    with serving(GatedEngine(), operations=Operations(api_key=KEY)) as (url, _, _):
        for path in ("/predict", "/metrics"):
            method = "POST" if path == "/predict" else "GET"
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                            {"authorization": f"Basic {KEY}"}, {"authorization": f"Bearer {KEY}x"},
                            {"x-api-key": f"Bearer {KEY}"}):  # the token counts only as Authorization
                answer = httpx.request(method, f"{url}{path}", json={"task": "sst", "texts": ["a"]}, headers=headers)
                assert answer.status_code == 401, (path, headers)
                assert answer.headers["www-authenticate"] == "Bearer"
                assert answer.headers["content-type"] == "application/json"
                assert answer.headers["content-length"] == str(len(answer.content))
                assert answer.json() == {"error": "missing or wrong bearer token: send `Authorization: Bearer "
                                                  "<key>` (--api-key)"}
        for written in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER   {KEY}"):
            assert predict(url, ["a film"], authorization=written).status_code == 200, written
        for path in ("/health", "/ready", "/tasks", "/openapi.json"):
            assert HTTP.get(f"{url}{path}").status_code == 200, path


def test_without_a_key_nothing_asks_for_a_token():
    with serving(GatedEngine()) as (url, _, _):
        assert predict(url, ["a film"]).status_code == 200
        assert HTTP.get(f"{url}/metrics").status_code == 200
        assert "securitySchemes" not in HTTP.get(f"{url}/openapi.json").json().get("components", {})


# --- admission ----------------------------------------------------------------------------------------------
def test_past_the_concurrency_bound_a_predict_is_refused_at_once_and_the_others_are_answered():
    engine = GatedEngine(shut=True)
    with serving(engine, admission=Admission(max_concurrent_requests=2)) as (url, _, _):
        held = [in_background(lambda: predict(url, ["a film"])) for _ in range(2)]
        until(lambda: submitted(url) == 2, "both requests in the server")
        refused = predict(url, ["a third"])
        assert refused.status_code == 429
        assert refused.json() == {"error": "overloaded: 2 requests are in the server, its bound "
                                           "(--max-concurrent-requests); send it again after Retry-After"}
        assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
        assert HTTP.get(f"{url}/health").status_code == 200  # only /predict is bounded
        engine.gate.set()
        for thread, answers in held:
            thread.join(PATIENCE)
            assert answers[0].status_code == 200
        assert predict(url, ["a fourth"]).status_code == 200  # the bound counts requests inside, not ever seen
        assert counted(url, "mtbert_shed_requests_total", reason="overloaded") == 1
        assert counted(url, "mtbert_requests_total", endpoint="/predict", status="429") == 1
        assert "a third" not in engine.texts_called()


def test_past_the_queues_bound_of_texts_a_predict_is_refused_naming_the_bound():
    engine = GatedEngine(shut=True)
    with serving(engine, admission=Admission(max_queued_texts=3)) as (url, _, _):
        computing = held_in_the_engine(url, engine, ["first"])  # taken by the engine: no longer queued
        queued = [in_background(lambda: predict(url, ["a", "b"]))]
        until(lambda: submitted(url) == 2, "the second request queued")
        queued.append(in_background(lambda: predict(url, ["c"])))  # the queue's 3 texts, of two requests
        until(lambda: submitted(url) == 3, "the third request queued")
        refused = predict(url, ["one more"])
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"] == ("overloaded: 3 texts are waiting for the engine; this request's 1 would "
                                           "pass the bound of 3 (--max-queued-texts); send it again after "
                                           "Retry-After")
        engine.gate.set()
        for thread, answers in (computing, *queued):
            thread.join(PATIENCE)
            assert answers[0].status_code == 200
        assert predict(url, ["a", "b", "c"]).status_code == 200  # the queue is empty again: 3 texts fit
        assert counted(url, "mtbert_shed_requests_total", reason="overloaded") == 1


def test_the_engines_speed_bounds_admission_once_the_queue_holds_work():
    """The estimate of the queue's wait (characters over the engine's speed) is checked against half the
    request timeout, and only when something is queued: a lone request is always tried."""
    from mtbert.deploy.batcher import CHARS_COUNTED, MicroBatcher, Overloaded
    from mtbert.deploy.metrics import ServerMetrics

    async def scenario() -> None:
        batcher = MicroBatcher(GatedEngine(), Batching(), Admission(request_timeout=10.0), ServerMetrics())
        batcher.arrived = asyncio.Event()
        batcher.chars_per_second = 10.0  # as if measured: 10 characters a second
        batcher.submit("sst", [("x" * 600,)], "alone")  # 51 s of work, but nothing was queued before it
        assert batcher.queued_texts == 1 and batcher.queued_chars == CHARS_COUNTED  # a long text counts the cap
        with pytest.raises(Overloaded, match=r"would need about 51 s to reach this request and compute it, more "
                                             r"than half the request timeout of 10 s \(--request-timeout\)"):
            batcher.submit("sst", [("y",)], "behind")
        batcher.withdraw(batcher.waiting[0])
        assert batcher.queued_texts == 0 and batcher.queued_chars == 0
        batcher.submit("sst", [("z" * 20,)], "first")
        batcher.submit("sst", [("w" * 30,)], "within")  # (20 + 30) / 10 = 5 s: at most half the timeout
        with pytest.raises(Overloaded):
            batcher.submit("sst", [("v",)], "over")  # (50 + 1) / 10 = 5.1 s
        assert batcher.requests == 3 and [pending.request_id for pending in batcher.waiting] == \
            ["alone", "first", "within"]
        batcher.executor.shutdown()

    asyncio.run(scenario())


def test_waiting_requests_share_calls_up_to_max_batch_and_a_failed_call_is_retried_one_request_at_a_time(capfd):
    engine = GatedEngine(shut=True)
    with serving(engine, batching=Batching(max_batch=3, wait_ms=0)) as (url, _, _):
        first = held_in_the_engine(url, engine, ["a"])
        waiting = []
        for count, texts in enumerate((["b1", "b2"], ["boom"], ["d"]), start=2):  # queued in this order
            waiting.append(in_background(lambda texts=texts: predict(url, texts, **{"x-request-id": texts[0]})))
            until(lambda count=count: submitted(url) == count, f"request {count} queued")
        engine.gate.set()
        answers = [thread.join(PATIENCE) or answer[0] for thread, answer in (first, *waiting)]
        assert [answer.status_code for answer in answers] == [200, 200, 500, 200]
        assert answers[1].json()["results"] == [{"prob_1": 0.5, "label": 2}, {"prob_1": 0.5, "label": 2}]
        # the second batch holds 3 texts (b1, b2, boom); its call fails, so each request runs alone
        assert engine.calls == [[("a",)], [("b1",), ("b2",), ("boom",)], [("b1",), ("b2",)], [("boom",)], [("d",)]]
        assert HTTP.get(f"{url}/health").json()["engine_calls"] == 3  # the calls that answered
    # the retried request's own failure is logged, naming it and its error
    assert "request boom: the engine failed on its 1 text(s) of task sst: RuntimeError: a planted engine failure" \
        in capfd.readouterr().err


def test_a_failed_request_does_not_hold_up_another_tasks_request_in_its_batch(capfd):
    engine = GatedEngine(shut=True)
    with serving(engine) as (url, _, _):
        first = held_in_the_engine(url, engine, ["a"])
        failing = in_background(lambda: predict(url, ["boom", "fine"], **{"x-request-id": "bad-2"}))
        until(lambda: submitted(url) == 2, "the failing request queued")
        other = in_background(lambda: predict(url, [["x", "y"]], task="qqp"))
        until(lambda: submitted(url) == 3, "the other task's request queued")
        engine.gate.set()
        statuses = [thread.join(PATIENCE) or answer[0].status_code for thread, answer in (first, failing, other)]
        assert statuses == [200, 500, 200]
    assert "request bad-2: the engine failed on its 2 text(s) of task sst: RuntimeError: a planted engine failure" \
        in capfd.readouterr().err


def test_a_request_longer_than_a_call_is_cut_by_texts_and_characters_and_answered_whole():
    engine = GatedEngine()
    with serving(engine, batching=Batching(max_batch=3, max_batch_chars=10, wait_ms=0)) as (url, _, _):
        texts = ["aaaa", "bbbb", "cccc", "d", "e", "f", "g"]
        answer = predict(url, texts)
        assert [result["label"] for result in answer.json()["results"]] == [4, 4, 4, 1, 1, 1, 1]
        # 4 + 4 characters, then 4 + 1 + 1 (three texts), then the last
        assert engine.calls == [[("aaaa",), ("bbbb",)], [("cccc",), ("d",), ("e",)], [("f",), ("g",)]]
        assert predict(url, [["x", "yy"]], task="qqp").json()["results"] == [{"prob_1": 0.5, "label": 1}]
        engine.calls.clear()
        assert predict(url, ["aaaa", "bbbbbb"]).status_code == 200  # 10 characters: the budget, one call
        assert engine.calls == [[("aaaa",), ("bbbbbb",)]]
        engine.calls.clear()
        assert predict(url, ["a" * 30]).status_code == 200  # one text over the budget still goes, alone
        assert engine.calls == [[("a" * 30,)]]


def test_an_engine_calls_seconds_make_the_requests_compute_time_and_the_engines_speed(monkeypatch):
    """Each call's seconds (a clock the test sets) add up in the request's compute time, and set the
    engine's speed: characters a second, then a moving average with SPEED_MEMORY of the past."""
    from mtbert.deploy import batcher as batching
    from mtbert.deploy.metrics import ServerMetrics

    class Clock:
        def __init__(self, readings):
            self.readings = iter(readings)

        def monotonic(self) -> float:
            return next(self.readings)

    async def scenario() -> None:
        batcher = batching.MicroBatcher(GatedEngine(), Batching(max_batch=2), Admission(), ServerMetrics())
        batcher.arrived = asyncio.Event()
        pending = batcher.submit("sst", [("abcd",), ("ef",), ("ghijkl",)], "r1")
        pending.queued_at = 0.0
        # readings: taken at 1; call 1 from 2 to 4 (2 s); call 2 from 10 to 10.5 (0.5 s)
        monkeypatch.setattr(batching, "time", Clock([1.0, 2.0, 4.0, 10.0, 10.5]))
        await batcher.run_batch(batcher.take_batch())
        assert [result["label"] for result in pending.future.result()] == [4, 2, 6]
        assert pending.queue_seconds == 1.0 and pending.compute_seconds == 2.5
        first_speed = 6 / 2.0  # abcd + ef in 2 s
        assert batcher.chars_per_second == \
            batching.SPEED_MEMORY * first_speed + (1 - batching.SPEED_MEMORY) * 6 / 0.5  # then ghijkl in 0.5 s
        assert batcher.engine_calls == 2 and batcher.call_started is None
        batcher.executor.shutdown()

    asyncio.run(scenario())


def test_a_batch_takes_whole_requests_up_to_max_batch_texts_and_steps_over_withdrawn_ones():
    """The queue's side of a batch, which the engine calls' own cut hides from every answer: requests are
    taken oldest first while the batch holds fewer than max_batch texts, a withdrawn one is dropped on the way
    without ending the batch, and the queue's count of texts falls by exactly the texts taken."""
    from mtbert.deploy import batcher as batching
    from mtbert.deploy.metrics import ServerMetrics

    async def scenario() -> None:
        batcher = batching.MicroBatcher(GatedEngine(), Batching(max_batch=3), Admission(), ServerMetrics())
        batcher.arrived = asyncio.Event()
        gone, two, one, last = (batcher.submit("sst", [(text,)] * size, text)
                                for text, size in (("gone", 1), ("two", 2), ("one", 1), ("last", 1)))
        batcher.withdraw(gone)  # its client hung up while it waited at the head of the queue
        assert batcher.queued_texts == 4
        assert batcher.take_batch() == [two, one]  # 3 texts: the bound, so `last` waits
        assert list(batcher.waiting) == [last] and batcher.queued_texts == 1
        assert batcher.take_batch() == [last] and batcher.queued_texts == 0
        batcher.executor.shutdown()

    asyncio.run(scenario())


def test_a_batch_waits_wait_ms_for_more_requests(capfd):
    logging_json = Operations(access_log="json")
    with serving(GatedEngine(), batching=Batching(wait_ms=300), operations=logging_json) as (url, _, _):
        assert predict(url, ["a film"], **{"x-request-id": "waited"}).status_code == 200
        written: list[str] = []
        until(lambda: written.append(capfd.readouterr().err) or '"waited"' in "".join(written), "its log line")
    line = next(json.loads(text) for text in "".join(written).splitlines() if '"waited"' in text)
    assert line["queue_seconds"] >= 0.3  # a sleep is never shorter than asked


def test_a_text_counts_its_characters_up_to_the_cap():
    from mtbert.deploy.batcher import CHARS_COUNTED, row_chars

    assert row_chars(("abc",)) == 3 and row_chars(("ab", "cde")) == 5
    assert row_chars(("x" * (CHARS_COUNTED + 50), "y")) == CHARS_COUNTED + 1


# --- deadlines, the grace period, clients that hang up ------------------------------------------------------
def test_past_its_deadline_a_request_gets_503_and_a_queued_one_is_never_computed(capfd):
    engine = GatedEngine(shut=True)
    with serving(engine, admission=Admission(request_timeout=0.5), batching=Batching(max_batch=1, wait_ms=0),
                 operations=Operations(access_log="text")) as (url, _, _):
        computing = held_in_the_engine(url, engine, ["computing", "its second text"])  # one call each
        queued = predict(url, ["queued"], **{"x-request-id": "late-1"})  # waits behind it until its own deadline
        assert queued.status_code == 503 and queued.headers["retry-after"] == "1"
        assert queued.json() == {"error": "not answered within the request timeout of 0.5 s (--request-timeout): "
                                          "the server is busy; send it again later"}
        computing[0].join(PATIENCE)
        assert computing[1][0].status_code == 503
        engine.gate.set()
        assert predict(url, ["after"]).status_code == 200
        # "queued" left the queue uncomputed, and the rest of the one cut short is dropped
        assert engine.texts_called() == ["computing", "after"]
        assert counted(url, "mtbert_shed_requests_total", reason="timeout") == 2
        assert counted(url, "mtbert_requests_total", endpoint="/predict", status="503") == 2
        assert counted(url, "mtbert_queue_depth") == 0
    assert re.search(r'"POST /predict" 503 \d+\.\d{4} s id=late-1\n', capfd.readouterr().err)  # its access-log line


def test_the_end_of_the_grace_period_answers_every_request_in_flight_503():
    """The lifecycle the drain reads: requests in flight, the time of the last activity, the requests served
    since the drain began; at the grace period's end every request still in flight gets its 503; and at
    the server's exit the app's own shutdown runs."""
    engine = GatedEngine(shut=True)
    with serving(engine) as (url, app, server):
        lifecycle = app.state.lifecycle
        quiet_since = lifecycle.last_activity
        held = [in_background(lambda: predict(url, ["held"])) for _ in range(2)]
        until(lambda: submitted(url) == 2, "both requests in the server")
        until(lambda: lifecycle.in_flight == 2, "both counted in flight")
        assert lifecycle.last_activity > quiet_since
        server.call_soon(lifecycle.begin_drain)  # what a SIGTERM does (mtbert/deploy/lifecycle.py)
        until(lambda: lifecycle.draining, "the drain begun")
        assert HTTP.get(f"{url}/ready").status_code == 503
        answer = HTTP.get(f"{url}/health")
        assert answer.headers["connection"] == "close" and answer.json()["draining"] is True
        server.call_soon(lambda: [answer_now() for answer_now in lifecycle.on_grace_end])  # the grace period's end
        for thread, answers in held:
            thread.join(PATIENCE)
            assert answers[0].status_code == 503 and answers[0].headers["retry-after"] == "1"
            assert answers[0].json() == {"error": "the server is shutting down and its grace period ended before "
                                                  "this request was served; send it again (to another server)"}
        # since the drain began: /ready, /health and the two refused
        until(lambda: lifecycle.in_flight == 0 and lifecycle.served == 4, "every request out, four served")
        engine.gate.set()
        assert counted(url, "mtbert_shed_requests_total", reason="shutdown") == 2
    assert lifecycle.ready is False  # the app's shutdown ran (its micro-batcher stopped)


def test_health_is_503_while_an_engine_call_runs_past_the_request_timeout():
    engine = GatedEngine(shut=True)
    with serving(engine, admission=Admission(request_timeout=0.5)) as (url, _, _):
        assert HTTP.get(f"{url}/health").json()["status"] == "ok"
        stuck = in_background(lambda: predict(url, ["stuck"]))
        until(lambda: HTTP.get(f"{url}/health").status_code == 503, "the stalled engine call seen")
        body = HTTP.get(f"{url}/health").json()
        assert body["status"] == "unhealthy" and body["engine_calls"] == 0 and body["requests"] == 1
        ran = re.fullmatch(r"an engine call has run for (\d+) s, past the request timeout of 0.5 s", body["error"])
        assert ran and int(ran.group(1)) <= PATIENCE, body["error"]
        stuck[0].join(PATIENCE)
        assert stuck[1][0].status_code == 503  # its own deadline passed
        engine.gate.set()
        until(lambda: HTTP.get(f"{url}/health").status_code == 200, "the engine healthy again")
        assert HTTP.get(f"{url}/health").json() == {"status": "ok", "tasks": ["sst", "qqp"], "requests": 1,
                                                    "engine_calls": 1, "draining": False}


def test_an_aborted_request_keeps_its_first_reason_and_a_finished_one_is_not_aborted():
    from mtbert.deploy.middleware import Exchange

    async def scenario() -> None:
        running = Exchange("r1", "/predict")
        running.task = asyncio.ensure_future(asyncio.sleep(PATIENCE))
        running.abort("timeout")
        running.abort("shutdown")  # the grace period ends while its 503 is on its way
        assert running.aborted == "timeout"
        with contextlib.suppress(asyncio.CancelledError):
            await running.task
        assert running.task.cancelled()
        finished = Exchange("r2", "/predict")
        finished.task = asyncio.ensure_future(asyncio.sleep(0))
        await finished.task
        finished.abort("timeout")
        assert finished.aborted is None
        unstarted = Exchange("r3", "/predict")  # no task yet: nothing to abort
        unstarted.abort("shutdown")
        assert unstarted.aborted is None

    asyncio.run(scenario())


def test_the_middleware_follows_each_exchange_from_its_entry_to_its_one_answer():
    """The middleware driven directly (ASGI, no HTTP): inside the app a request is counted in flight and its start
    is the last activity; only /predict has a deadline; a /predict whose response had started when its deadline
    passed gets no second answer; a finished request leaves nothing in flight."""
    from mtbert.deploy.lifecycle import Lifecycle
    from mtbert.deploy.metrics import ServerMetrics
    from mtbert.deploy.middleware import ServingMiddleware

    async def scenario() -> None:
        lifecycle, seen, body_sent = Lifecycle(), {}, asyncio.Event()

        async def app(scope, receive, send) -> None:  # starts its answer, then sends the body when told
            seen[scope["path"]] = (lifecycle.in_flight, lifecycle.last_activity)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await body_sent.wait()
            await send({"type": "http.response.body", "body": b"{}"})

        serving = ServingMiddleware(app, lifecycle, ServerMetrics(), Admission(request_timeout=0.1), Operations())

        async def call(path: str) -> list[dict]:
            sent = []

            async def send(message) -> None:
                sent.append(message)

            await asyncio.wait_for(serving({"type": "http", "path": path, "method": "GET", "headers": []},
                                           None, send), PATIENCE)
            assert serving.in_flight == set() and lifecycle.in_flight == 0, path
            return sent

        entered = time.monotonic()
        answered = await call("/predict")  # its body never comes: the deadline ends it
        assert [message["type"] for message in answered] == ["http.response.start"]  # not a second start, a 503
        assert seen["/predict"][0] == 1 and entered <= seen["/predict"][1] <= time.monotonic()
        asyncio.get_running_loop().call_later(1.0, body_sent.set)  # ten times the deadline /predict has
        answered = await call("/health")
        assert [(message["type"], message.get("status")) for message in answered] == [
            ("http.response.start", 200), ("http.response.body", None)]

    asyncio.run(scenario())


def test_a_request_is_counted_before_the_last_part_of_its_answer_is_sent():
    """With `--workers N` a client's next request can reach another worker, which reads this worker's figures at
    once: so a request leaves the in-flight gauge and enters the counts before its answer ends, not after."""
    from mtbert.deploy.lifecycle import Lifecycle
    from mtbert.deploy.metrics import ServerMetrics
    from mtbert.deploy.middleware import ServingMiddleware

    async def app(scope, receive, send) -> None:  # an answer in two parts
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        await send({"type": "http.response.body", "body": b"}"})

    metrics = ServerMetrics()
    serving = ServingMiddleware(app, Lifecycle(), metrics, Admission(), Operations(api_key=KEY))

    def figures(endpoint: str, status: str) -> tuple[float, float]:
        count = metrics.registry.get_sample_value("mtbert_requests_total", {"endpoint": endpoint, "status": status})
        return metrics.registry.get_sample_value("mtbert_requests_in_flight"), count or 0.0

    def seen_at_each_send(path: str, status: str) -> list[tuple[str, float, float]]:
        seen = []

        async def send(message) -> None:
            seen.append((message["type"], *figures(path, status)))

        asyncio.run(serving({"type": "http", "path": path, "method": "GET", "headers": []}, None, send))
        return seen

    assert seen_at_each_send("/health", "200") == [("http.response.start", 1, 0), ("http.response.body", 1, 0),
                                                   ("http.response.body", 0, 1)]
    # the middleware's own answer: /metrics without the token
    assert seen_at_each_send("/metrics", "401") == [("http.response.start", 1, 0), ("http.response.body", 0, 1)]
    assert figures("/health", "200") == (0, 1)  # counted once


@pytest.mark.parametrize("supervised", [True, False])
def test_a_signal_that_arrives_inside_the_first_ones_handler_is_a_second_signal(supervised, capsys):
    """CPython runs a signal's handler between bytecodes, so a second SIGTERM (a signal to the process group and
    the supervisor's copy of it) can run the handler again inside the first. That is still one drain; without
    the supervisor it ends the grace period, as any second signal does."""
    import signal

    import uvicorn

    from mtbert.deploy.lifecycle import DrainingServer, Lifecycle

    lifecycle = Lifecycle()
    server = DrainingServer(uvicorn.Config(app=None), lifecycle, grace=10, supervised=supervised)
    begin_drain = lifecycle.begin_drain

    def begin_drain_interrupted() -> None:  # the second signal lands as the first one's handler runs
        lifecycle.begin_drain = begin_drain
        server.handle_exit(signal.SIGTERM, None)
        begin_drain()

    lifecycle.begin_drain = begin_drain_interrupted
    server.handle_exit(signal.SIGTERM, None)
    assert capsys.readouterr().err.count("SIGTERM: draining") == 1
    assert lifecycle.draining and server.grace_over is not supervised
    server.handle_exit(signal.SIGTERM, None)  # a third, later
    assert capsys.readouterr().err == "" and server.grace_over is not supervised


def test_a_drain_takes_the_waiting_connections_and_a_client_arriving_at_its_close_is_refused_never_reset(
        monkeypatch):
    """Closing a listening socket resets every connection in its accept queue. The drain takes the waiting
    ones, and a client that connects just after it took them (here: right after the last accept, before the
    close) must not complete its connection only to have it reset once its request is sent: its connect is
    refused, which a client can retry elsewhere."""
    import errno
    import select

    from mtbert.deploy import lifecycle

    listener = socket.create_server(("127.0.0.1", 0))
    early, late = socket.socket(), socket.socket()
    take_waiting = lifecycle.waiting_connections

    def take_waiting_then_a_client_connects(listener_fd: int) -> list[socket.socket]:
        taken = take_waiting(listener_fd)
        late.setblocking(False)
        late.connect_ex(listener.getsockname())  # in progress while the listener is still open
        return taken

    async def drain() -> int:
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, sock=listener,
                                                                start_serving=False)
        return await lifecycle.stop_accepting([server])

    monkeypatch.setattr(lifecycle, "waiting_connections", take_waiting_then_a_client_connects)
    with early, late:
        early.connect(listener.getsockname())  # completed by the kernel, waiting to be accepted
        assert asyncio.run(drain()) == 1
        _, writable, _ = select.select([], [late], [], PATIENCE)  # its connect ends: completed, or refused
        assert writable and late.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED


def test_the_batching_loop_says_when_it_has_stopped():
    from mtbert.deploy.batcher import MicroBatcher
    from mtbert.deploy.metrics import ServerMetrics

    async def scenario() -> None:
        batcher = MicroBatcher(GatedEngine(), Batching(), Admission(), ServerMetrics())
        assert not batcher.stopped()  # not started
        batcher.start()
        await asyncio.sleep(0)
        assert not batcher.stopped() and batcher.stalled(0.0) is None  # running, no engine call
        batcher.loop_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await batcher.loop_task
        assert batcher.stopped()
        await batcher.stop()

    asyncio.run(scenario())


def test_stopping_the_batcher_ends_its_running_loop():
    """The app's shutdown (`stop`) cancels the batching loop, so none is left pending when the event loop closes."""
    from mtbert.deploy.batcher import MicroBatcher
    from mtbert.deploy.metrics import ServerMetrics

    async def scenario() -> None:
        batcher = MicroBatcher(GatedEngine(), Batching(), Admission(), ServerMetrics())
        batcher.start()
        await asyncio.sleep(0)
        assert not batcher.stopped()
        await batcher.stop()
        assert batcher.stopped() and batcher.loop_task.cancelled()

    asyncio.run(scenario())


def test_a_client_that_hangs_up_is_counted_499_and_its_rows_are_dropped(capfd):
    engine = GatedEngine(shut=True)
    with serving(engine, operations=Operations(access_log="text")) as (url, _, _):
        computing = held_in_the_engine(url, engine, ["computing"])
        body = json.dumps({"task": "sst", "texts": ["gone"]}).encode()
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /predict HTTP/1.1\r\nhost: x\r\nx-request-id: gone-1\r\n"
                           b"content-type: application/json\r\n"
                           + f"content-length: {len(body)}\r\n\r\n".encode() + body)
            until(lambda: submitted(url) == 2, "the request queued")
        until(lambda: counted(url, "mtbert_requests_total", endpoint="/predict", status="499") == 1,
                 "the hang-up counted")
        engine.gate.set()
        computing[0].join(PATIENCE)
        assert predict(url, ["after"]).status_code == 200
        assert engine.texts_called() == ["computing", "after"]
        assert counted(url, "mtbert_shed_requests_total", reason="client_gone") == 1
    err = capfd.readouterr().err
    assert "request gone-1: the client hung up while its request waited for the engine; nothing was sent" in err
    assert re.search(r'"POST /predict" 499 \d+\.\d{4} s id=gone-1\n', err), err  # its access-log line


# --- counting and access logs -------------------------------------------------------------------------------
def test_each_request_is_counted_once_by_endpoint_and_status_and_unknown_paths_as_other():
    with serving(GatedEngine()) as (url, _, _):
        predict(url, ["a film"])
        predict(url, ["a film"], task="nli")
        HTTP.get(f"{url}/tasks")
        HTTP.get(f"{url}/nowhere")
        HTTP.get(f"{url}/nowhere/else")
        assert counted(url, "mtbert_requests_total", endpoint="/predict", status="200") == 1
        assert counted(url, "mtbert_requests_total", endpoint="/predict", status="404") == 1
        assert counted(url, "mtbert_requests_total", endpoint="/tasks", status="200") == 1
        assert counted(url, "mtbert_requests_total", endpoint="other", status="404") == 2
        assert counted(url, "mtbert_request_seconds_count", endpoint="/predict") == 2


def test_a_failing_engine_fails_only_its_own_request_with_a_500_naming_its_id(capfd):
    with serving(GatedEngine()) as (url, _, _):
        failed = predict(url, ["boom"], **{"x-request-id": "bad-1"})
        assert failed.status_code == 500
        assert failed.json() == {"error": "internal error: the engine failed on this request; the server's log has "
                                          "the details under its id bad-1"}
        assert predict(url, ["fine"]).json() == {"task": "sst", "results": [{"prob_1": 0.5, "label": 4}]}
        assert counted(url, "mtbert_engine_errors_total") == 1
    # the log says why, in one line cut to 300 characters of the error; no access log by default, no traceback
    err = capfd.readouterr().err
    assert '"POST /predict"' not in err and "Traceback" not in err
    logged = [line for line in err.splitlines() if "request bad-1:" in line]
    cause = " ".join(PLANTED_FAILURE.split())[:300]
    assert len(logged) == 1 and logged[0].endswith(
        f"request bad-1: the engine failed on its 1 text(s) of task sst: RuntimeError: {cause}"), logged


@pytest.mark.parametrize("style", ["json", "text"])
def test_each_request_is_one_access_log_line(style, capfd):
    with serving(GatedEngine(), operations=Operations(access_log=style, api_key=KEY)) as (url, _, _):
        sent = time.monotonic()
        predict(url, ["a film", "another"], **{"x-request-id": "log-1", "authorization": f"Bearer {KEY}"})
        round_trip = time.monotonic() - sent
        HTTP.get(f"{url}/tasks", headers={"x-request-id": "log-2"})
        assert HTTP.get(f"{url}/metrics", headers={"x-request-id": "log-3"}).status_code == 401  # no token
    # each line is written before the last part of its answer is sent (mtbert/deploy/middleware.py)
    lines = [line for line in capfd.readouterr().err.splitlines() if "log-" in line]
    assert len(lines) == 3, lines
    if style == "json":
        first, second, refused = map(json.loads, lines)
        assert {key: first[key] for key in ("request_id", "method", "path", "status", "texts")} == \
            {"request_id": "log-1", "method": "POST", "path": "/predict", "status": 200, "texts": 2}
        assert first["queue_seconds"] >= 0 and first["compute_seconds"] >= 0
        assert 0 < first["seconds"] <= round_trip and first["seconds"] == round(first["seconds"], 6)
        assert first["queue_seconds"] + first["compute_seconds"] <= first["seconds"]
        assert first["client"].startswith("127.0.0.1:") and isinstance(first["time"], float)
        assert second["path"] == "/tasks" and second["queue_seconds"] is None and second["texts"] is None
        assert refused["path"] == "/metrics" and refused["status"] == 401
    else:
        assert re.fullmatch(r'mtbert serve \[\d+\]: 127\.0\.0\.1:\d+ "POST /predict" 200 \d+\.\d{4} s '
                            r'\(queued \d+\.\d{4} s, computed \d+\.\d{4} s\) id=log-1', lines[0]), lines[0]
        assert re.fullmatch(r'mtbert serve \[\d+\]: 127\.0\.0\.1:\d+ "GET /tasks" 200 \d+\.\d{4} s id=log-2',
                            lines[1]), lines[1]
        assert re.fullmatch(r'mtbert serve \[\d+\]: 127\.0\.0\.1:\d+ "GET /metrics" 401 \d+\.\d{4} s id=log-3',
                            lines[2]), lines[2]


# --- the OpenAPI document's parts ---------------------------------------------------------------------------
def test_the_predict_schema_accepts_what_the_server_answers_and_refuses_what_it_refuses():
    import jsonschema_rs

    from mtbert.deploy import schema

    body = schema.predict_body({"sst": 1, "qqp": 2}, max_texts=2, max_chars=5)
    assert body["requestBody"]["required"] is True
    validator = jsonschema_rs.validator_for(body["requestBody"]["content"]["application/json"]["schema"])
    accepted = [{"task": "sst", "texts": ["a"]}, {"task": "sst", "texts": ["abcde", "b"]},
                {"task": "qqp", "texts": [["a", "b"]]}]
    refused = [{"task": "sst"}, {"texts": ["a"]}, {"task": "nli", "texts": ["a"]}, {"task": "sst", "texts": []},
               {"task": "sst", "texts": ["a", "b", "c"]}, {"task": "sst", "texts": ["abcdef"]},
               {"task": "sst", "texts": [""]}, {"task": "sst", "texts": [["a", "b"]]},
               {"task": "qqp", "texts": ["a"]}, {"task": "qqp", "texts": [["a"]]},
               {"task": "qqp", "texts": [["a", "b", "c"]]},
               {"task": "sst", "texts": ["a"], "extra": 1}, {"task": "sst", "texts": [1]},
               {"task": "qqp", "texts": [[1, 2]]}, {"task": "sst", "texts": "a"}, ["sst", ["a"]], "a"]
    assert [validator.is_valid(case) for case in accepted] == [True] * len(accepted)
    assert [case for case in refused if validator.is_valid(case)] == []
    one_task = schema.predict_body({"sst": 1}, max_texts=2, max_chars=5)["requestBody"]["content"]
    assert not jsonschema_rs.validator_for(one_task["application/json"]["schema"]).is_valid(["sst", ["a"]])
    text = body["requestBody"]["content"]["application/json"]["schema"]["oneOf"][0]["properties"]["texts"]["items"]
    assert text["format"] == schema.VISIBLE_TEXT


def test_every_error_is_documented_with_its_body_and_retry_after_where_the_server_sends_it():
    from mtbert.deploy import schema

    for status in schema.ERRORS:
        response = schema.error(status)
        assert response["description"] == schema.ERRORS[status]
        assert response["content"]["application/json"]["schema"] == schema.ERROR_BODY
        assert ("headers" in response) == (status in (429, 503)), status
    assert schema.error(429)["headers"]["Retry-After"]["schema"] == {"type": "string"}
    assert schema.json_response("d", {"type": "object"}) == {
        "description": "d", "content": {"application/json": {"schema": {"type": "object"}}}}


def test_the_document_marks_only_the_guarded_operations_as_asking_for_the_token():
    from mtbert.deploy import schema

    document = {"paths": {"/predict": {"post": {}}, "/metrics": {"get": {}}, "/health": {"get": {}}}}
    marked = schema.with_bearer(document, ("/predict", "/metrics"))
    assert marked["components"]["securitySchemes"] == schema.BEARER
    assert marked["paths"]["/predict"]["post"]["security"] == [{"bearer": []}]
    assert marked["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in marked["paths"]["/health"]["get"]
