"""Every ensemble member's training at once, for a GPU: `make members`, then `make repro` goes on from them.

`dvc repro` runs the `train@<variant>` stages one after another, and one small model leaves most of a GPU
idle, so on one card several trainings take about the time of one (docs/distributed.md). This brings the
members' inputs up to date (`dvc repro pretrain`: the tokenized data and the starting encoder), runs the
command of every `train@<variant>` stage that is not up to date in its own process, all at once, and
records their outputs in dvc.lock with `dvc commit`, as DVC does for a stage whose command ran by hand.
A failed or killed training resumes from its own checkpoint on the next run (the members that finished
are recorded first). Each process uses runtime.threads CPU threads and the first GPU. On a CPU the
processes would only share its cores: there `dvc repro` alone is as fast.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import typer

from mtbert.params_file import load_params
from mtbert.runtime import UserError, run_app, setup_logging

log = logging.getLogger("members")
app = typer.Typer(add_completion=False)


def dvc(*args: str, capture: bool = False) -> str:
    # this interpreter first on PATH: the stages DVC runs (`python -m stages...`) are then this environment's
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run([sys.executable, "-m", "dvc", *args], capture_output=capture, text=True, env=env)
    if result.returncode != 0:
        raise UserError(f"dvc {' '.join(args)} failed" + (f": {' '.join(result.stderr.split())}" if capture else ""))
    return result.stdout or ""


def stale(stages: list[str]) -> list[str]:
    """The stages whose outputs are not those of their current code, params and inputs."""
    changed = json.loads(dvc("status", "--json", *stages, capture=True) or "{}")
    return [stage for stage in stages if stage in changed]


def train_at_once(variants: list[str]) -> list[str]:
    """Each variant's `train` stage command in its own process, all at once; the variants whose process
    failed (each prints its own error)."""
    processes = {variant: subprocess.Popen([sys.executable, "-m", "stages.train", "--variant", variant])
                 for variant in variants}
    return [variant for variant, process in processes.items() if process.wait() != 0]


@app.command()
def main() -> None:
    setup_logging()
    stages = [f"train@{variant}" for variant in load_params().models]  # params.yaml, as the stages read it
    dvc("repro", "pretrain")
    todo = stale(stages)
    if not todo:
        log.info("every member is up to date")
        return
    variants = [stage.removeprefix("train@") for stage in todo]
    log.info("training %s at once", ", ".join(variants))
    failed = train_at_once(variants)
    done = [stage for stage in todo if stage.removeprefix("train@") not in failed]
    if done:  # a finished run has removed its checkpoint: record it now, or it would train again
        dvc("commit", "--force", *done)
        log.info("%s recorded in dvc.lock; `dvc repro` goes on from them", ", ".join(done))
    if failed:
        raise UserError(f"the training of {', '.join(failed)} failed; run `make members` again: each resumes "
                        "from its last checkpoint")


if __name__ == "__main__":
    run_app(app)
