"""Fine-tuning runs for tests: set up in-process as the `train` stage sets them up (to look inside the loop),
or run as the stage itself in a subprocess (to kill it, or break its files between runs)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from mtbert.params import Params
from mtbert.training import finetune
from mtbert.training.build import FineTuning
from mtbert.training.loop import Paths
from mtbert.training.progress import Progress
from tests.conftest import REPO_ROOT, saved_heads


@dataclasses.dataclass
class Run:
    """A prepared run with its progress; `train()` takes it to the end."""
    run: FineTuning
    progress: Progress

    def train(self) -> dict:
        return finetune.train(self.run, self.progress)


def prepared(params: Params, paths: Paths, variant: str = "base") -> Run:
    return Run(*finetune.start(params, variant, paths))


def train_summary(params: Params, variant: str, paths: Paths) -> dict:
    """The `train` stage's training of `variant` in this process, to the end: its summary."""
    return finetune.fine_tune(params, variant, paths)[1]


# --- the stage as a subprocess ----------------------------------------------------------------------------
def train_command(params: Path, out: Path, tokenized: Path) -> list[str]:
    """`python -m stages.train` for variant `base`, its outputs and checkpoints under `out`."""
    backbone = yaml.safe_load(params.read_text())["model"]["name"]
    return [sys.executable, "-m", "stages.train", "--variant", "base", "--params-file", str(params),
            "--pretrained-dir", backbone, "--tokenized-dir", str(tokenized), "--models-dir", str(out / "models"),
            "--metrics-dir", str(out / "metrics"), "--checkpoints-dir", str(out / "ck"),
            "--snapshots-dir", str(out / "snapshots")]


def run_training(params: Path, tokenized: Path, out: Path) -> dict:
    """A whole run of the stage; its result (see `result_of`)."""
    subprocess.run(train_command(params, out, tokenized), cwd=REPO_ROOT, check=True, capture_output=True)
    return result_of(out)


def result_of(out: Path) -> dict:
    """What a run under `out` ended with: its summary less `speed`, and every saved head weight."""
    summary = json.loads((out / "metrics" / "base.json").read_text())
    summary.pop("speed")
    return {"summary": summary, "heads": saved_heads(out / "models" / "base")}


def kill_when(command: list[str], ready: Callable[[], bool], timeout: float = 180, **popen) -> None:
    """Start `command`, and SIGKILL it and every process it started at a moment when `ready()` holds. The
    process is stopped (SIGSTOP) while `ready` is checked again, so the files it looks at cannot change
    between the check and the kill."""
    # its own session, so a launcher (torchrun) and its workers die together, as under a kill of the job
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True, **popen)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            assert process.poll() is None, "the run finished before it could be killed"
            if ready():
                os.killpg(process.pid, signal.SIGSTOP)
                if ready():
                    return
                os.killpg(process.pid, signal.SIGCONT)
            time.sleep(0.02)
        raise AssertionError(f"no moment to kill it came within {timeout} s")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
