"""`mtbert serve`'s configuration: what one request may hold, how requests are admitted and batched, and how
the server is operated. The parent process hands it to its worker processes as JSON (CONFIG_VARIABLE)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

CONFIG_VARIABLE = "MTBERT_SERVE_CONFIG"  # how the worker processes get the configuration
API_KEY_VARIABLE = "MTBERT_API_KEY"  # the bearer token, kept out of the process list (`ps` shows arguments)
ACCESS_LOGS = ("none", "text", "json")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may hold, and how long the server waits for a client to send it."""
    max_texts: int = 256  # texts (or pairs) per request
    max_chars: int = 2000  # characters per text
    max_body_bytes: int = 1 << 20  # bytes of a request's body
    read_timeout: float = 10.0  # seconds to receive a request's headers, and again its body


@dataclasses.dataclass(frozen=True)
class Admission:
    """How much work the server takes on; past each bound a request is answered at once, not queued."""
    # /predict requests inside the server (being read, queued or computed); past it 429. With max_body_bytes
    # it bounds the memory that request bodies can take.
    max_concurrent_requests: int = 256
    max_queued_texts: int = 1024  # texts waiting for the engine (16 full batches); past it 429
    request_timeout: float = 30.0  # seconds from a request's headers to its answer; past it 503
    retry_after: int = 1  # seconds, the Retry-After of every 429 and 503


@dataclasses.dataclass(frozen=True)
class Batching:
    max_batch: int = 64  # texts per engine call
    # characters per engine call (a text counts at most 512): 64 sentences of 128 characters fit, long texts
    # go in smaller calls
    max_batch_chars: int = 8192
    wait_ms: float = 2.0  # how long a batch waits for more requests after its first


@dataclasses.dataclass(frozen=True)
class Operations:
    api_key: str | None = None  # the bearer token /predict and /metrics ask for; None: no token
    access_log: str = "none"  # one line per request on stderr: none | text | json


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model: str | None
    ensemble: str | None
    models_dir: str
    engine: str
    threads: int
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

    def predictor(self):
        """The model, every graph loaded and checked (a truncated or foreign graph fails here, in one line)."""
        from mtbert.deploy.predictors import load_predictor  # the engine, imported only by a server

        predictor = load_predictor(model=self.model and Path(self.model),
                                   ensemble=self.ensemble and Path(self.ensemble), models_dir=Path(self.models_dir),
                                   engine=self.engine, batch_size=self.batching.max_batch, threads=self.threads)
        if hasattr(predictor, "warm"):
            predictor.warm()
        return predictor
