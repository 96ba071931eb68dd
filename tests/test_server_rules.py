"""The server's own rules, each shown on a real server in this process (tests/inprocess.py) called by a real
HTTP client: request ids, the bearer token, admission (the concurrency bound, the queue's bounds), deadlines,
the end of a drain's grace period, clients that hang up, counting and access logs (mtbert/deploy/middleware.py,
batcher.py), and the OpenAPI document's parts (schema.py). The engine is held at a gate the test opens, so
events are ordered by what the server answers and counts, never by sleeps; it answers the label a text's
length gives, because the rules are the server's, not a model's (the subprocess tests of test_serve.py and
test_serve_hostile.py serve a real export). No fixture is built, so `make mutation` runs these per mutant."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading

import httpx
import pytest

from mtbert.deploy.api import create_app
from mtbert.deploy.engine import ExportedTask
from mtbert.deploy.serve_config import Admission, Batching, Limits, Operations
from tests.conftest import wait_for
from tests.inprocess import InProcess

KEY = "s3cret-token"
SENTENCE = {"kind": "classification", "columns": ["prob_0", "prob_1"], "text": ["sentence"], "encoding": "single",
            "clean": {"replace": []}, "graphs": {"onnx": "sst.onnx"}}
PAIR = {"kind": "binary", "columns": ["prob_1"], "text": ["sentence1", "sentence2"], "encoding": "bi",
        "clean": {"replace": []}, "graphs": {"onnx": "qqp.onnx"}}


class GatedEngine:
    """Two tasks as an export's manifest describes them (a sentence, a pair), and engine calls that wait at a
    gate while it is shut. Records each call's rows; a text "boom" makes its call fail."""

    def __init__(self):
        self.tasks = {"sst": ExportedTask.from_manifest("sst", SENTENCE, "test"),
                      "qqp": ExportedTask.from_manifest("qqp", PAIR, "test")}
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[list[tuple[str, ...]]] = []

    def predict(self, task: str, rows: list[tuple[str, ...]]) -> list[dict]:
        self.calls.append(list(rows))
        assert self.gate.wait(60), "the test never opened the gate"
        if any(text == "boom" for row in rows for text in row):
            raise RuntimeError("a planted engine failure")
        return [{"prob_1": 0.5, "label": len(row[0])} for row in rows]

    def texts_called(self) -> list[str]:
        return [row[0] for call in self.calls for row in call]


@contextlib.contextmanager
def serving(engine: GatedEngine, limits=Limits(), admission=Admission(), operations=Operations(),
            batching=Batching(wait_ms=0)):
    """The app over `engine`, served in this process: its URL, the app (its lifecycle) and the server."""
    app = create_app(engine, limits=limits, batching=batching, admission=admission, operations=operations)
    server = InProcess(app)
    with server as url:
        yield url, app, server


def predict(url: str, texts: list, task: str = "sst", **headers) -> httpx.Response:
    return httpx.post(f"{url}/predict", json={"task": task, "texts": texts}, headers=headers, timeout=60)


def in_background(call) -> tuple[threading.Thread, list]:
    """`call()` in a thread; its answer lands in the list."""
    answers: list = []
    thread = threading.Thread(target=lambda: answers.append(call()), daemon=True)
    thread.start()
    return thread, answers


def counted(url: str, name: str, **labels) -> float:
    """A figure of /metrics (0 if it has no such sample yet)."""
    text = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def submitted(url: str) -> int:
    return httpx.get(f"{url}/health").json()["requests"]


# --- request ids --------------------------------------------------------------------------------------------
def test_a_plain_request_id_is_echoed_and_any_other_is_replaced_by_a_new_one():
    with serving(GatedEngine()) as (url, _, _):
        assert predict(url, ["a film"], **{"x-request-id": "client-7.a:b_c"}).headers["x-request-id"] == \
            "client-7.a:b_c"
        for unsafe in ("two words", "x" * 129, "quote\"d", "new\nline".replace("\n", "%0A")):
            echoed = predict(url, ["a film"], **{"x-request-id": unsafe}).headers["x-request-id"]
            assert re.fullmatch(r"[0-9a-f]{32}", echoed), (unsafe, echoed)
        assert predict(url, ["a film"], **{"x-request-id": "y" * 128}).headers["x-request-id"] == "y" * 128
        first, second = (predict(url, ["a film"]).headers["x-request-id"] for _ in range(2))
        assert first != second and re.fullmatch(r"[0-9a-f]{32}", first)


def test_every_answer_carries_its_request_id_refusals_and_unknown_paths_included():
    with serving(GatedEngine(), operations=Operations(api_key=KEY)) as (url, _, _):
        answers = [httpx.post(f"{url}/predict", json={}, headers={"x-request-id": "r1"}),  # 401
                   httpx.get(f"{url}/nowhere", headers={"x-request-id": "r2"}),  # 404
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
                            {"authorization": f"Basic {KEY}"}, {"authorization": f"Bearer {KEY}x"}):
                answer = httpx.request(method, f"{url}{path}", json={"task": "sst", "texts": ["a"]}, headers=headers)
                assert answer.status_code == 401, (path, headers)
                assert answer.headers["www-authenticate"] == "Bearer"
                assert answer.json() == {"error": "missing or wrong bearer token: send `Authorization: Bearer "
                                                  "<key>` (--api-key)"}
        for written in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER   {KEY}"):
            assert predict(url, ["a film"], authorization=written).status_code == 200, written
        for path in ("/health", "/ready", "/tasks", "/openapi.json"):
            assert httpx.get(f"{url}{path}").status_code == 200, path


def test_without_a_key_nothing_asks_for_a_token():
    with serving(GatedEngine()) as (url, _, _):
        assert predict(url, ["a film"]).status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert "securitySchemes" not in httpx.get(f"{url}/openapi.json").json().get("components", {})


# --- admission ----------------------------------------------------------------------------------------------
def test_past_the_concurrency_bound_a_predict_is_refused_at_once_and_the_others_are_answered():
    engine = GatedEngine()
    engine.gate.clear()
    with serving(engine, admission=Admission(max_concurrent_requests=2)) as (url, _, _):
        held = [in_background(lambda: predict(url, ["a film"])) for _ in range(2)]
        wait_for(lambda: submitted(url) == 2, "both requests in the server")
        refused = predict(url, ["a third"])
        assert refused.status_code == 429
        assert refused.json() == {"error": "overloaded: 2 requests are in the server, its bound "
                                           "(--max-concurrent-requests); send it again after Retry-After"}
        assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
        assert httpx.get(f"{url}/health").status_code == 200  # only /predict is bounded
        engine.gate.set()
        for thread, answers in held:
            thread.join(60)
            assert answers[0].status_code == 200
        assert predict(url, ["a fourth"]).status_code == 200  # the bound counts requests inside, not ever seen
        assert counted(url, "mtbert_shed_requests_total", reason="overloaded") == 1
        assert counted(url, "mtbert_requests_total", endpoint="/predict", status="429") == 1
        assert "a third" not in engine.texts_called()


def test_past_the_queues_bound_of_texts_a_predict_is_refused_naming_the_bound():
    engine = GatedEngine()
    engine.gate.clear()
    with serving(engine, admission=Admission(max_queued_texts=3)) as (url, _, _):
        computing = in_background(lambda: predict(url, ["first"]))  # taken by the engine: no longer queued
        wait_for(lambda: len(engine.calls) == 1, "the first request in the engine")
        queued = in_background(lambda: predict(url, ["a", "b", "c"]))  # the queue's 3 texts
        wait_for(lambda: submitted(url) == 2, "the second request queued")
        refused = predict(url, ["one more"])
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"] == ("overloaded: 3 texts are waiting for the engine; this request's 1 would "
                                           "pass the bound of 3 (--max-queued-texts); send it again after "
                                           "Retry-After")
        engine.gate.set()
        for thread, answers in (computing, queued):
            thread.join(60)
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
        batcher.submit("sst", [("w" * 29,)], "within")  # (20 + 29) / 10 = 4.9 s, under the 5 s allowed
        with pytest.raises(Overloaded):
            batcher.submit("sst", [("v" * 2,)], "over")  # (49 + 2) / 10 = 5.1 s
        assert batcher.requests == 3 and [pending.request_id for pending in batcher.waiting] == \
            ["alone", "first", "within"]
        batcher.executor.shutdown()

    asyncio.run(scenario())


def test_a_text_counts_its_characters_up_to_the_cap():
    from mtbert.deploy.batcher import CHARS_COUNTED, row_chars

    assert row_chars(("abc",)) == 3 and row_chars(("ab", "cde")) == 5
    assert row_chars(("x" * (CHARS_COUNTED + 50), "y")) == CHARS_COUNTED + 1


# --- deadlines, the grace period, clients that hang up ------------------------------------------------------
def test_past_its_deadline_a_request_gets_503_and_a_queued_one_is_never_computed():
    engine = GatedEngine()
    engine.gate.clear()
    with serving(engine, admission=Admission(request_timeout=0.5)) as (url, _, _):
        computing = in_background(lambda: predict(url, ["computing"]))
        wait_for(lambda: len(engine.calls) == 1, "the first request in the engine")
        queued = predict(url, ["queued"])  # waits behind it until its own deadline
        assert queued.status_code == 503 and queued.headers["retry-after"] == "1"
        assert queued.json() == {"error": "not answered within the request timeout of 0.5 s (--request-timeout): "
                                          "the server is busy; send it again later"}
        computing[0].join(60)
        assert computing[1][0].status_code == 503
        engine.gate.set()
        assert predict(url, ["after"]).status_code == 200
        assert engine.texts_called() == ["computing", "after"]  # "queued" left the queue uncomputed
        assert counted(url, "mtbert_shed_requests_total", reason="timeout") == 2
        assert counted(url, "mtbert_requests_total", endpoint="/predict", status="503") == 2
        assert counted(url, "mtbert_queue_depth") == 0


def test_the_end_of_the_grace_period_answers_every_request_in_flight_503():
    engine = GatedEngine()
    engine.gate.clear()
    with serving(engine) as (url, app, server):
        held = [in_background(lambda: predict(url, ["held"])) for _ in range(2)]
        wait_for(lambda: submitted(url) == 2, "both requests in the server")
        lifecycle = app.state.lifecycle
        server.call_soon(lifecycle.begin_drain)  # what a SIGTERM does (mtbert/deploy/lifecycle.py)
        wait_for(lambda: httpx.get(f"{url}/ready").status_code == 503, "the drain begun")
        answer = httpx.get(f"{url}/health")
        assert answer.headers["connection"] == "close" and answer.json()["draining"] is True
        server.call_soon(lambda: [answer_now() for answer_now in lifecycle.on_grace_end])  # the grace period's end
        for thread, answers in held:
            thread.join(60)
            assert answers[0].status_code == 503 and answers[0].headers["retry-after"] == "1"
            assert answers[0].json() == {"error": "the server is shutting down and its grace period ended before "
                                                  "this request was served; send it again (to another server)"}
        engine.gate.set()
        assert counted(url, "mtbert_shed_requests_total", reason="shutdown") == 2
        assert lifecycle.served >= 4  # since the drain began: /ready, /health and the two refused


def test_a_client_that_hangs_up_is_counted_499_and_its_rows_are_dropped():
    engine = GatedEngine()
    engine.gate.clear()
    with serving(engine) as (url, _, _):
        computing = in_background(lambda: predict(url, ["computing"]))
        wait_for(lambda: len(engine.calls) == 1, "the first request in the engine")
        body = json.dumps({"task": "sst", "texts": ["gone"]}).encode()
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                           + f"content-length: {len(body)}\r\n\r\n".encode() + body)
            wait_for(lambda: submitted(url) == 2, "the request queued")
        wait_for(lambda: counted(url, "mtbert_requests_total", endpoint="/predict", status="499") == 1,
                 "the hang-up counted")
        engine.gate.set()
        computing[0].join(60)
        assert predict(url, ["after"]).status_code == 200
        assert engine.texts_called() == ["computing", "after"]
        assert counted(url, "mtbert_shed_requests_total", reason="client_gone") == 1


# --- counting and access logs -------------------------------------------------------------------------------
def test_each_request_is_counted_once_by_endpoint_and_status_and_unknown_paths_as_other():
    with serving(GatedEngine()) as (url, _, _):
        predict(url, ["a film"])
        predict(url, ["a film"], task="nli")
        httpx.get(f"{url}/tasks")
        httpx.get(f"{url}/nowhere")
        httpx.get(f"{url}/nowhere/else")
        assert counted(url, "mtbert_requests_total", endpoint="/predict", status="200") == 1
        assert counted(url, "mtbert_requests_total", endpoint="/predict", status="404") == 1
        assert counted(url, "mtbert_requests_total", endpoint="/tasks", status="200") == 1
        assert counted(url, "mtbert_requests_total", endpoint="other", status="404") == 2
        assert counted(url, "mtbert_request_seconds_count", endpoint="/predict") == 2


def test_a_failing_engine_fails_only_its_own_request_with_a_500_naming_its_id():
    with serving(GatedEngine()) as (url, _, _):
        failed = predict(url, ["boom"], **{"x-request-id": "bad-1"})
        assert failed.status_code == 500
        assert failed.json() == {"error": "internal error: the engine failed on this request; the server's log has "
                                          "the details under its id bad-1"}
        assert predict(url, ["fine"]).json() == {"task": "sst", "results": [{"prob_1": 0.5, "label": 4}]}
        assert counted(url, "mtbert_engine_errors_total") == 1


@pytest.mark.parametrize("style", ["json", "text"])
def test_each_request_is_one_access_log_line(style, capfd):
    with serving(GatedEngine(), operations=Operations(access_log=style)) as (url, _, _):
        predict(url, ["a film", "another"], **{"x-request-id": "log-1"})
        httpx.get(f"{url}/tasks", headers={"x-request-id": "log-2"})
        written: list[str] = []  # the line is written just after the answer's last byte: wait for it

        def logged() -> bool:
            written.append(capfd.readouterr().err)
            return "id=log-2" in written[-1] or '"log-2"' in "".join(written)

        wait_for(logged, "the second request's log line")
    lines = [line for line in "".join(written).splitlines() if "log-" in line]
    assert len(lines) == 2, lines
    if style == "json":
        first, second = map(json.loads, lines)
        assert {key: first[key] for key in ("request_id", "method", "path", "status", "texts")} == \
            {"request_id": "log-1", "method": "POST", "path": "/predict", "status": 200, "texts": 2}
        assert first["queue_seconds"] >= 0 and first["compute_seconds"] >= 0 and first["seconds"] > 0
        assert first["client"].startswith("127.0.0.1:") and isinstance(first["time"], float)
        assert second["path"] == "/tasks" and second["queue_seconds"] is None and second["texts"] is None
    else:
        assert re.fullmatch(r'mtbert serve \[\d+\]: 127\.0\.0\.1:\d+ "POST /predict" 200 \d+\.\d{4} s '
                            r'\(queued \d+\.\d{4} s, computed \d+\.\d{4} s\) id=log-1', lines[0]), lines[0]
        assert re.fullmatch(r'mtbert serve \[\d+\]: 127\.0\.0\.1:\d+ "GET /tasks" 200 \d+\.\d{4} s id=log-2',
                            lines[1]), lines[1]


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
               {"task": "sst", "texts": ["a"], "extra": 1}, {"task": "sst", "texts": [1]}]
    assert [validator.is_valid(case) for case in accepted] == [True] * len(accepted)
    assert [case for case in refused if validator.is_valid(case)] == []
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
