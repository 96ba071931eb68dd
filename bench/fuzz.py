"""`mtbert serve`'s HTTP API fuzzed from its own OpenAPI document, over HTTP, by schemathesis.

    python -m bench.fuzz [--model exports/ensemble] [--examples 200] [--seed N] [--json-out FILE]

A real server (`mtbert serve`, with a bearer token) answers requests that schemathesis generates from its
GET /openapi.json: for every operation, valid requests (positive: any body the document allows) and invalid
ones (negative: wrong types, missing or unknown keys, values out of range), each sent with the token and
without it. Every answer goes through every default check of schemathesis (a documented status, content
type, headers and body; no 5xx; invalid data refused and valid data accepted; the token enforced where the
document asks for it) and ours (`OWN_CHECKS`); the server's log must hold no traceback. It prints its seed
(a new one each run unless --seed replays one), the checks it ran, the requests per operation, mode,
credential and status, and each failure with a curl command that repeats it. `tests/test_fuzz.py` runs a
bounded version of this in `make test`; this is the deep run. Needs the dev extra (schemathesis).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import secrets
import tempfile
from pathlib import Path

import typer

from bench.common import start_server, stop_server

app = typer.Typer(add_completion=False)
# A new token each run: Hypothesis draws strings from the literals of the code it runs, and sent a written-in
# token back as a "generated" one (which ignored_auth then reported as accepted).
API_KEY = secrets.token_urlsafe(16)


@dataclasses.dataclass
class Tally:
    """What came back: requests per (operation, mode, credential, status), the checks that ran, and each
    failed check with a command that repeats it."""
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    checks: list[str] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def statuses(self) -> collections.Counter:
        statuses = collections.Counter()
        for (*_, status), count in self.counts.items():
            statuses[status] += count
        return statuses

    @property
    def requests(self) -> int:
        return sum(self.counts.values())

    def figures(self) -> dict:
        return {"requests": self.requests, "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "server_errors": sum(v for k, v in self.statuses.items() if k >= 500),
                "failures": len(self.failures), "checks": self.checks,
                "per_operation": {" ".join(map(str, key)): count for key, count in sorted(self.counts.items())}}


def answers_every_text(ctx, response, case) -> None:
    """Ours, beside schemathesis' defaults: a 200 from /predict answers the task asked, one result per text
    sent, in order (the document's schema cannot say that the counts match). Judged on valid bodies only: an
    invalid one answered 200 is schemathesis' `negative_data_rejection`'s to report."""
    valid = case.meta is not None and case.meta.generation.mode.is_positive
    if case.operation.path != "/predict" or response.status_code != 200 or not valid:
        return None
    answer = response.json()
    assert answer["task"] == case.body["task"], f"asked {case.body['task']!r}, answered {answer['task']!r}"
    assert len(answer["results"]) == len(case.body["texts"]), (
        f"{len(case.body['texts'])} texts sent, {len(answer['results'])} results")
    return None


OWN_CHECKS = [answers_every_text]


def default_checks(schema) -> list:
    """schemathesis' own checks, every one its configuration enables (what `case.call_and_validate` runs):
    the document's statuses, content types, headers and bodies, no 5xx, invalid bodies refused, valid ones
    accepted, and the token enforced where the document asks for it."""
    from schemathesis.checks import CHECKS, load_all_checks
    load_all_checks()
    config = schema.config.checks_config_for(operation=None, phase=None)
    return [check for check in CHECKS.get_all()
            if callable(check) and not isinstance(check, type) and config.get_by_name(name=check.__name__).enabled]


def fuzz_config():
    """schemathesis' defaults, but for one: an invalid body may also be refused with 413, the status of every
    limit the server enforces (--max-texts, --max-chars, --max-body-bytes)."""
    from schemathesis.config import SchemathesisConfig
    refusals = SchemathesisConfig().projects.default.checks.negative_data_rejection.expected_statuses
    return SchemathesisConfig.from_dict({"checks": {"negative_data_rejection": {
        "expected-statuses": [*refusals, "413"]}}})


def fuzz(url: str, api_key: str, examples: int, seed: int) -> Tally:
    """Every operation of the server at `url`, `examples` generated requests per operation, generation mode
    (positive, negative) and credential (the token, none), each answer put through every default check and
    ours; the same `seed`, the same requests."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed
    from hypothesis import strategies as st
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.errors import FailureGroup

    from mtbert.deploy.schema import VISIBLE_TEXT
    from mtbert.inputs import has_visible_text

    schemathesis.openapi.format(VISIBLE_TEXT, st.text(min_size=1).filter(has_visible_text))
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=fuzz_config())
    run_checks = default_checks(schema) + OWN_CHECKS
    tally = Tally(checks=[check.__name__ for check in run_checks])

    def sender(mode: GenerationMode, credential: str, headers: dict):
        def call(case) -> None:
            response = case.call(base_url=url, headers=headers, timeout=60)
            tally.counts[(case.operation.label, mode.value, credential, response.status_code)] += 1
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
            for credential, headers in (("token", {"Authorization": f"Bearer {api_key}"}), ("none", {})):
                test = settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                                suppress_health_check=list(HealthCheck))(
                    given(operation.as_strategy(generation_mode=mode))(sender(mode, credential, headers)))
                try:
                    fixed_seed(seed)(test)()
                except Unsatisfiable:  # negative mode on an operation without inputs: no invalid request exists
                    assert mode == GenerationMode.NEGATIVE, operation.label
    return tally


def traceback_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if "Traceback" in line]


@app.command()
def main(model: Path = typer.Option(Path("exports/ensemble"), help="an export folder to serve"),
         examples: int = typer.Option(200, help="generated requests per operation, mode and credential"),
         seed: int = typer.Option(None, help="the generator's seed, to replay a run (default: a new one, "
                                             "printed)"),
         json_out: Path = typer.Option(None, help="also write the figures here")) -> None:
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "server.log"
        process, url = start_server(log, "--model", model, env={"MTBERT_API_KEY": API_KEY})
        seed = random.SystemRandom().randrange(2**32) if seed is None else seed
        print(f"seed {seed} (replay: --seed {seed})", flush=True)
        try:
            tally = fuzz(url, API_KEY, examples, seed)
        finally:
            stop_server(process)
        tracebacks = traceback_lines(log)
    figures = {**tally.figures(), "tracebacks": len(tracebacks), "model": str(model), "examples": examples,
               "seed": seed}
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
