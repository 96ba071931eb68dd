"""`mtbert serve`'s configuration: what one request may hold, how requests are admitted and batched, and how
the server is operated. The parent process hands it to its worker processes as JSON (CONFIG_VARIABLE).

Each option is described once, where its field is (`option`: default, bounds, help, environment variable);
the command line is made from these descriptions (`serve_options`, mtbert/cli.py's `serve`)."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

CONFIG_VARIABLE = "MTBERT_SERVE_CONFIG"  # how the worker processes get the configuration
API_KEY_VARIABLE = "MTBERT_API_KEY"  # the bearer token, kept out of the process list (`ps` shows arguments)
ACCESS_LOGS = ("none", "text", "json")


def option(default: Any, help: str, *, min: float | None = None, max: float | None = None, flag: str = "",
           envvar: str = "", choices: tuple[str, ...] = ()) -> Any:
    """One option of `mtbert serve`, described once: its default, bounds, help and environment variable.
    The command's flag is `--<field name>` with '-' for '_', unless `flag` names another."""
    return dataclasses.field(default=default, metadata={"option": {
        "help": help, "min": min, "max": max, "flag": flag, "envvar": envvar, "choices": choices}})


@dataclasses.dataclass(frozen=True)
class Listening:
    """Where the server listens, how many processes serve, and how a shutdown drains (not the workers')."""
    host: str = option("127.0.0.1", "the address to listen on (0.0.0.0: every interface)")
    port: int = option(8000, "the port", min=0, max=65535)
    workers: int = option(1, "server processes, each with its own copy of the model", min=1)
    grace: float = option(30.0, "seconds a shutdown (SIGTERM, SIGINT) waits for the requests in flight before "
                                "it refuses them (503)", min=0.0)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may hold, and how long the server waits for a client to send it."""
    max_texts: int = option(256, "texts (or pairs) per request", min=1)
    max_chars: int = option(2000, "characters per text", min=1)
    max_body_bytes: int = option(1 << 20, "bytes of a request's body", min=64)
    read_timeout: float = option(10.0, "seconds to receive a request's headers, and again its body (408)", min=0.1)


@dataclasses.dataclass(frozen=True)
class Admission:
    """How much work the server takes on; past each bound a request is answered at once, not queued."""
    # With max_body_bytes it bounds the memory that request bodies can take.
    max_concurrent_requests: int = option(256, "/predict requests inside a worker (read, queued or computed); "
                                               "past it 429 at once", min=1)
    max_queued_texts: int = option(1024, "texts waiting for the engine in a worker (16 full batches); past it "
                                         "429 at once", min=1)
    request_timeout: float = option(30.0, "seconds to answer a /predict request; past it 503, and it is dropped "
                                          "from the queue", min=0.1)
    retry_after: int = 1  # seconds, the Retry-After of every 429 and 503 (not an option)


@dataclasses.dataclass(frozen=True)
class Batching:
    max_batch: int = option(64, "texts per engine call, across concurrent requests", min=1)
    # a text counts at most 512: 64 sentences of 128 characters fit
    max_batch_chars: int = option(8192, "characters per engine call: long texts go in smaller calls", min=1)
    wait_ms: float = option(2.0, "how long a batch waits for more requests after its first", min=0.0,
                            flag="batch-wait-ms")


@dataclasses.dataclass(frozen=True)
class Operations:
    api_key: str | None = option(None, "a bearer token that /predict and /metrics ask for (401 without it); "
                                       "better given in the environment, which `ps` does not show",
                                 envvar=API_KEY_VARIABLE)
    access_log: str = option("none", "one line per request on stderr: none | text | json", choices=ACCESS_LOGS)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What every worker process serves, and how."""
    model: str | None = option(None, "an export (exports/base) or a trained folder")
    ensemble: str | None = option(None, "the ensemble's metrics/ensemble.json")
    models_dir: str = option("models", "with --ensemble: where its members' folders are")
    engine: str = option("auto", "auto | onnx | int8 | torch, as for `mtbert predict`",
                         choices=("auto", "onnx", "int8", "torch"))
    threads: int = option(0, "CPU threads per worker; 0 = the cores shared among the workers", min=0)
    limits: Limits = Limits()
    admission: Admission = Admission()
    batching: Batching = Batching()
    operations: Operations = Operations()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        raw = json.loads(text)
        return cls(**{**raw, "limits": Limits(**raw["limits"]), "admission": Admission(**raw["admission"]),
                      "batching": Batching(**raw["batching"]), "operations": Operations(**raw["operations"])})


@dataclasses.dataclass(frozen=True)
class ServeOption:
    """One flag of `mtbert serve`, read off the dataclasses above."""
    section: str  # "" for ServeConfig's own fields, "listening", or a ServeConfig section ("limits", …)
    field: str
    type: Any
    default: Any
    help: str
    min: float | None
    max: float | None
    flag: str
    envvar: str
    choices: tuple[str, ...]

    @property
    def keyword(self) -> str:
        """The command function's parameter for the flag."""
        return self.flag.replace("-", "_")


SECTIONS = {"": ServeConfig, "listening": Listening, "limits": Limits, "admission": Admission,
            "batching": Batching, "operations": Operations}


def serve_options() -> list[ServeOption]:
    """Every option of `mtbert serve`, in the order of SECTIONS and of each one's fields."""
    found = []
    for section, cls in SECTIONS.items():
        types = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            described = field.metadata.get("option")
            if described is None:  # a section, or a constant that is not an option
                continue
            found.append(ServeOption(section, field.name, types[field.name], field.default, described["help"],
                                     described["min"], described["max"],
                                     described["flag"] or field.name.replace("_", "-"), described["envvar"],
                                     described["choices"]))
    return found


def from_options(values: dict[str, Any]) -> tuple[ServeConfig, Listening]:
    """The configuration and the listening options from the command's values, keyed by `ServeOption.keyword`."""
    fields: dict[str, dict] = {section: {} for section in SECTIONS}
    for described in serve_options():
        fields[described.section][described.field] = values[described.keyword]
    sections = {name: SECTIONS[name](**fields[name]) for name in ("limits", "admission", "batching", "operations")}
    return ServeConfig(**fields[""], **sections), Listening(**fields["listening"])
