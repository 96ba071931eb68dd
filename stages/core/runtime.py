"""Process-wide setup shared by the stage commands."""

from __future__ import annotations

import logging
import os
import sys


class UserError(Exception):
    """Bad params, data or model folder: the message names the file, row or key and what was expected.

    A stage run through `run_app` prints it as one line and exits 1; MTBERT_DEBUG=1 shows the traceback.
    """


class MissingInputError(UserError, FileNotFoundError):
    """A stage's input file is not there (an earlier stage has not run)."""


def run_app(app) -> None:
    """Run a stage's typer app, turning a UserError into one line on stderr and exit status 1."""
    try:
        app()
    except UserError as error:
        if os.environ.get("MTBERT_DEBUG"):
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


def setup_logging(level: str | None = None) -> None:
    """Timestamped log lines on stderr, so a long stage always says what it is doing."""
    logging.basicConfig(level=level or os.environ.get("MTBERT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


def setup_torch(seed: int, threads: int):
    """Seed torch, set CPU threads (0 keeps torch's default) and pick the device."""
    import torch

    torch.manual_seed(seed)
    if threads:
        torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def open_live(live_dir, history: list[dict], log_record) -> object:
    """A fresh DVCLive folder with `history` replayed through `log_record`, so a resumed run logs each
    point once (DVCLive's own resume would append to what a killed run already wrote)."""
    import shutil

    from dvclive import Live

    shutil.rmtree(live_dir, ignore_errors=True)
    live = Live(dir=str(live_dir), resume=False, report=None, save_dvc_exp=False, dvcyaml=None)
    for record in history:
        log_record(live, record)
    return live
