"""`mtbert serve`'s API fuzzed from its own OpenAPI document (bench/fuzz.py, schemathesis), bounded: a real
server on the small export, called over HTTP with generated requests, valid and invalid, with the bearer token
and without it. `python -m bench.fuzz` is the deep run."""

import httpx
import pytest

from bench.common import start_server, stop_server
from bench.fuzz import API_KEY, fuzz, traceback_lines

pytestmark = pytest.mark.slow(reason="a real server, a few hundred generated requests")

EXAMPLES = 12  # per operation, generation mode and credential: 6 operations x 2 x 2 x 12


@pytest.fixture(scope="module")
def guarded(deployed, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "stderr.log"
    process, url = start_server(log, "--model", deployed.exports / "bi", "--engine", "onnx", "--threads", "1",
                                "--batch-wait-ms", 1, timeout=300, env={"MTBERT_API_KEY": API_KEY})
    yield url, log
    stop_server(process)


def test_the_openapi_document_lists_every_route_and_its_errors(guarded):
    url, _ = guarded
    document = httpx.get(f"{url}/openapi.json").json()
    assert set(document["paths"]) == {"/predict", "/tasks", "/health", "/ready", "/metrics"}
    predict = document["paths"]["/predict"]["post"]
    assert {"200", "400", "401", "404", "408", "413", "422", "429", "499", "503"} <= set(predict["responses"])
    tasks = [option["properties"]["task"]["enum"][0]
             for option in predict["requestBody"]["content"]["application/json"]["schema"]["oneOf"]]
    assert tasks == list(httpx.get(f"{url}/tasks").json()["tasks"])


def test_generated_requests_get_documented_answers_and_never_a_server_error(guarded):
    url, log = guarded
    tally = fuzz(url, API_KEY, EXAMPLES, seed=0)
    print(f"\n  {tally.figures()}")
    assert tally.failures == []
    assert not any(status >= 500 for status in tally.statuses)
    assert {200, 401, 422} <= set(tally.statuses)  # answered, refused for the token, refused for the body
    assert traceback_lines(log) == []
