"""`mtbert serve`'s API fuzzed from its own OpenAPI document (bench/fuzz.py, schemathesis), bounded: a real
server on the small export, called over HTTP with generated requests, valid and invalid, with the bearer token
and without it, each answer put through every one of schemathesis' default checks and ours. `python -m
bench.fuzz` is the deep run. The same fuzz against the app with a handler broken on purpose (a 200 for an
invalid body, a 200 without the token, a 500) must fail."""

import pytest

from bench.common import start_server, stop_server
from bench.fuzz import API_KEY, fuzz, traceback_lines
from mtbert.deploy.engine import OnnxPredictor
from tests.inprocess import InProcess
from tests.loopback import HTTP

pytestmark = pytest.mark.slow(reason="a real server, a few hundred generated requests")

EXAMPLES = 60  # per operation, generation mode and credential; an operation without inputs has one request
SEED = 0  # the bounded run sends the same requests every time; the deep run draws a new seed
# every default check of schemathesis 4 that can judge this API (it has no stateful links or object ids)
MUST_RUN = {"not_a_server_error", "status_code_conformance", "content_type_conformance",
            "response_schema_conformance", "response_headers_conformance", "positive_data_acceptance",
            "negative_data_rejection", "ignored_auth", "missing_required_header", "unsupported_method"}


@pytest.fixture(scope="module")
def guarded(deployed, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "stderr.log"
    process, url = start_server(log, "--model", deployed.exports / "bi", "--engine", "onnx", "--threads", "1",
                                "--batch-wait-ms", 1, timeout=300, env={"MTBERT_API_KEY": API_KEY})
    yield url, log
    stop_server(process)


def test_the_openapi_document_lists_every_route_its_errors_and_its_token(guarded):
    url, _ = guarded
    document = HTTP.get(f"{url}/openapi.json").json()
    assert set(document["paths"]) == {"/predict", "/tasks", "/health", "/ready", "/metrics"}
    predict = document["paths"]["/predict"]["post"]
    assert {"200", "400", "401", "404", "408", "413", "422", "429", "499", "503"} <= set(predict["responses"])
    tasks = [option["properties"]["task"]["enum"][0]
             for option in predict["requestBody"]["content"]["application/json"]["schema"]["oneOf"]]
    assert tasks == list(HTTP.get(f"{url}/tasks").json()["tasks"])
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "the server's --api-key"}
    assert {path for path, operations in document["paths"].items()
            if any("security" in operation for operation in operations.values())} == {"/predict", "/metrics"}


def test_generated_requests_get_documented_answers_and_never_a_server_error(guarded):
    url, log = guarded
    tally = fuzz(url, API_KEY, EXAMPLES, SEED)
    print(f"\n  {tally.figures()}")
    assert tally.failures == []
    assert MUST_RUN <= set(tally.checks) and "answers_every_text" in tally.checks
    assert not any(status >= 500 for status in tally.statuses)
    assert {200, 401, 422} <= set(tally.statuses)  # answered, refused for the token, refused for the body
    predicted = {credential: count for (operation, mode, credential, status), count in tally.counts.items()
                 if operation == "POST /predict" and mode == "positive" and status == 200}
    assert predicted.get("token", 0) >= EXAMPLES // 2 and "none" not in predicted
    assert traceback_lines(log) == []


# --- the fuzz fails on a server broken on purpose ---------------------------------------------------------
class Constant:
    """The small export's tasks, and the same result for every text: the planted breakages below are in the
    server, not in a model."""

    def __init__(self, tasks: dict):
        self.tasks = tasks

    def predict(self, task, rows):
        return [{"label": 1.0} for _ in rows]


class FailsOnLongTexts(Constant):
    def predict(self, task, rows):
        if any(len(text) > 3 for row in rows for text in row):
            raise RuntimeError("a planted engine failure")
        return super().predict(task, rows)


@pytest.fixture(scope="module")
def export_tasks(deployed) -> dict:
    return OnnxPredictor.load(deployed.exports / "bi").tasks


def fuzzed(predictor) -> list[str]:
    """The failures of a bounded fuzz of the API over `predictor`, with the token asked for."""
    from mtbert.deploy.api import create_app
    from mtbert.deploy.serve_config import Batching, Operations

    app = create_app(predictor, batching=Batching(wait_ms=0), operations=Operations(api_key=API_KEY))
    with InProcess(app) as url:
        return fuzz(url, API_KEY, 20, SEED).failures


def test_the_unbroken_app_passes_the_fuzz_the_planted_breakages_fail(export_tasks):
    assert fuzzed(Constant(export_tasks)) == []  # the control: what fails below fails for its breakage


def test_the_fuzz_fails_on_a_200_for_an_invalid_body(export_tasks, monkeypatch):
    from mtbert.deploy import api

    parse = api.parse_request

    def lenient(body, tasks, limits):
        try:
            return parse(body, tasks, limits)
        except api.ApiError:
            return next(iter(tasks)), ["a text"]

    monkeypatch.setattr(api, "parse_request", lenient)
    failures = fuzzed(Constant(export_tasks))
    assert any(failure.startswith("POST /predict -> 200") and "schema-violating request accepted" in failure.lower()
               for failure in failures), failures


def test_the_fuzz_fails_on_a_200_without_the_token(export_tasks, monkeypatch):
    from mtbert.deploy import middleware

    monkeypatch.setattr(middleware, "GUARDED", ())  # the token is asked for nowhere, the document still says so
    failures = fuzzed(Constant(export_tasks))
    assert any("-> 200" in failure and "authentication" in failure.lower() for failure in failures), failures


def test_the_fuzz_fails_on_a_server_error(export_tasks):
    failures = fuzzed(FailsOnLongTexts(export_tasks))
    assert any(failure.startswith("POST /predict -> 500") and "server error" in failure.lower()
               for failure in failures), failures
