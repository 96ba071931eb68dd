"""`mtbert serve`'s HTTP API fuzzed from its own OpenAPI document, over HTTP, by schemathesis.

    python -m bench.fuzz [--model exports/ensemble] [--examples 200] [--json-out FILE]

A real server (`mtbert serve`, with a bearer token) answers requests that schemathesis generates from its
GET /openapi.json: for every operation, valid requests (positive: any body the document allows) and invalid
ones (negative: wrong types, missing or unknown keys, values out of range), each sent with the token and
without it. Every answer must be a status the document lists for its operation, with the documented content
type, headers and body schema, and never a 5xx; and the server's log must hold no traceback. It reports how
many requests it sent, how many came back with each status, and each failure with a curl command that
repeats it. `tests/test_fuzz.py` runs a bounded version of this in `make test`; this is the deep run.
Needs the dev extra (schemathesis).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import tempfile
from pathlib import Path

import typer

from bench.common import start_server, stop_server

app = typer.Typer(add_completion=False)
API_KEY = "fuzz-key"


@dataclasses.dataclass
class Tally:
    """What came back: requests per status, and each failed check with a command that repeats it."""
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    def figures(self) -> dict:
        return {"requests": self.requests, "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "server_errors": sum(v for k, v in self.statuses.items() if k >= 500),
                "failures": len(self.failures)}


def checks() -> list:
    """What every answer is checked for: a documented status, content type, headers and body; no 5xx."""
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )
    return [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
            response_schema_conformance]


def fuzz(url: str, api_key: str, examples: int, seed: int | None = 0) -> Tally:
    """Every operation of the server at `url`, `examples` generated requests per operation, generation mode
    (positive, negative) and credential (the token, none); with `seed`, the same requests every run."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.errors import FailureGroup

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    tally, run_checks = Tally(), checks()

    def sender(headers: dict):
        def call(case) -> None:
            response = case.call(base_url=url, headers=headers, timeout=60)
            tally.statuses[response.status_code] += 1
            try:
                case.validate_response(response, checks=run_checks, headers=headers)
            except (FailureGroup, AssertionError) as failure:  # every failed check of the answer
                tally.failures.append(f"{case.operation.label} -> {response.status_code}: "
                                      f"{' '.join(str(failure).split())[:300]}; repeat: "
                                      f"{case.as_curl_command(headers=headers)}")
        return call

    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for headers in ({"Authorization": f"Bearer {api_key}"}, {}):
                test = settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                                suppress_health_check=list(HealthCheck))(
                    given(operation.as_strategy(generation_mode=mode))(sender(headers)))
                if seed is not None:
                    test = fixed_seed(seed)(test)
                try:
                    test()
                except Unsatisfiable:  # negative mode on an operation without inputs: no invalid request exists
                    assert mode == GenerationMode.NEGATIVE, operation.label
    return tally


def traceback_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if "Traceback" in line]


@app.command()
def main(model: Path = typer.Option(Path("exports/ensemble"), help="an export folder to serve"),
         examples: int = typer.Option(200, help="generated requests per operation, mode and credential"),
         seed: int = typer.Option(0, help="the generator's seed (-1: a new one each run)"),
         json_out: Path = typer.Option(None, help="also write the figures here")) -> None:
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "server.log"
        process, url = start_server(log, "--model", model, env={"MTBERT_API_KEY": API_KEY})
        try:
            tally = fuzz(url, API_KEY, examples, None if seed < 0 else seed)
        finally:
            stop_server(process)
        tracebacks = traceback_lines(log)
    figures = {**tally.figures(), "tracebacks": len(tracebacks), "model": str(model), "examples": examples}
    print(json.dumps(figures, indent=2))
    for failure in tally.failures[:20]:
        print("FAILED", failure)
    if json_out is not None:
        from mtbert import io
        io.write_json(json_out, {**figures, "failure_list": tally.failures})
    if tally.failures or tracebacks or figures["server_errors"]:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
