"""`mtbert serve`: the model behind an HTTP JSON API (FastAPI on uvicorn), started in one process or in
several worker processes that share the port.

The pieces, one job each:
- mtbert/deploy/serve_config.py: the configuration (limits, admission, batching, operations);
- mtbert/deploy/api.py: the routes, and how a request's body is read and checked;
- mtbert/deploy/middleware.py: around every request: its id, the token, admission, its deadline, counting;
- mtbert/deploy/batcher.py: concurrent requests share engine calls, within a bounded queue;
- mtbert/deploy/lifecycle.py and protocol.py: readiness, the drain on SIGTERM or SIGINT, read timeouts;
- mtbert/deploy/supervisor.py: `--workers N`.
This module loads the model with the loader it is given (mtbert/predictors.py's `serving_predictor`: the
runtime imports nothing from above it), checking every graph, and starts the server.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from collections.abc import Callable

from mtbert.deploy.api import ENDPOINTS, create_app
from mtbert.deploy.lifecycle import log, run_worker
from mtbert.deploy.metrics import MULTIPROCESS_VARIABLE
from mtbert.deploy.serve_config import CONFIG_VARIABLE, ServeConfig
from mtbert.deploy.supervisor import supervise
from mtbert.runtime import UserError


def app_of(config: ServeConfig, predictor):
    return create_app(predictor, config.limits, config.batching, config.admission, config.operations)


Load = Callable[[ServeConfig], object]  # the model a configuration names, loaded and checked


def serve_from_environment(sock, started, *, load: Load, host: str, port: int, grace: float) -> None:
    """One worker process of `--workers N`, configured by the parent through CONFIG_VARIABLE; `started` is
    set once it serves. `load` reaches it pickled, by its module and name, as the spawned process's target."""
    config = ServeConfig.from_json(os.environ[CONFIG_VARIABLE])
    try:
        predictor = load(config)
    except (UserError, OSError) as error:  # one line; the supervisor counts the failed start
        log(f"error: {error}")
        sys.exit(1)
    app = app_of(config, predictor)
    app.state.lifecycle.on_ready.append(started.set)
    run_worker(app, host=host, port=port, grace=grace, read_timeout=config.limits.read_timeout, sockets=[sock],
               supervised=True)


def run_server(config: ServeConfig, load: Load, *, host: str, port: int, workers: int, grace: float = 30.0) -> None:
    """Serve `load(config)` until SIGTERM or SIGINT, then drain (mtbert/deploy/lifecycle.py): in this process,
    or in `workers` processes that share the port."""
    predictor = load(config)  # a bad folder or graph fails here, in one line, before any worker starts
    admission = config.admission
    log(f"http://{host}:{port} ({ENDPOINTS}); tasks {', '.join(predictor.tasks)}; {workers} worker(s), "
        f"{config.threads} thread(s) each; at most {admission.max_concurrent_requests} requests and "
        f"{admission.max_queued_texts} queued texts, {admission.request_timeout:g} s each; a shutdown drains "
        f"for at most {grace:g} s" + ("; /predict and /metrics ask for the bearer token" if
                                      config.operations.api_key else ""))
    if workers == 1:
        run_worker(app_of(config, predictor), host=host, port=port, grace=grace,
                   read_timeout=config.limits.read_timeout)
        return
    del predictor  # each worker loads its own
    os.environ[CONFIG_VARIABLE] = config.to_json()
    with tempfile.TemporaryDirectory(prefix="mtbert-metrics-") as metrics_dir:
        os.environ[MULTIPROCESS_VARIABLE] = metrics_dir  # the workers' figures, added up by /metrics
        supervise(functools.partial(serve_from_environment, load=load, host=host, port=port, grace=grace), workers,
                  host=host, port=port, grace=grace)
