"""Stage `train@<variant>`: multitask fine-tuning of one variant, keeping each task's best dev epoch.

The loop is mtbert/training/finetune.py: `fine_tune` sets up the process (memory caps, torchrun's
process group, the seed), fingerprints, prepares and resumes the run, and trains it; this stage reads its
options and params and hands over. Resume: a checkpoint (model, optimiser, scheduler, RNG, sampler
position, history) is written every runtime.checkpoint_every.train optimiser steps and at every epoch end
to checkpoints/<variant>/; a killed run started again continues from it and ends as an uninterrupted run
would. The folder is not a DVC output, so `dvc repro` does not wipe it; it is removed when the run
finishes.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer

from mtbert import layout
from mtbert.params_file import variant_params
from mtbert.runtime import run_app, setup_logging
from mtbert.training import finetune
from mtbert.training.distributed import relaunch_with_torchrun, under_torchrun
from mtbert.training.loop import Paths

log = logging.getLogger("train")
app = typer.Typer(add_completion=False)


@app.command()
def main(variant: str = typer.Option(..., "--variant", help="a key of `models:` in params.yaml"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path | None = typer.Option(None, help="[default: data/tokenized/<variant>]"),
         models_dir: Path = typer.Option(Path("models")),
         metrics_dir: Path = typer.Option(Path("metrics/train")),
         checkpoints_dir: Path = typer.Option(Path("checkpoints")),
         snapshots_dir: Path = typer.Option(Path("data/snapshots"), help="per-epoch prediction dumps"),
         pretrained_dir: Path | None = typer.Option(None, help="the encoder to start from "
                                                               "[default: models/pretrained/<variant>]")) -> None:
    setup_logging()
    params = variant_params(params_file, variant)
    if params.train.nproc > 1 and not under_torchrun():
        relaunch_with_torchrun(params.train.nproc, "stages.train", sys.argv[1:])
    paths = Paths(tokenized=layout.tokenized_of(variant, tokenized_dir), model_out=models_dir / variant,
                  metrics_out=metrics_dir / f"{variant}.json", live_dir=metrics_dir / variant,
                  checkpoints=checkpoints_dir / variant, pretrained=layout.pretrained_of(variant, pretrained_dir),
                  snapshots=snapshots_dir / variant)
    _, summary = finetune.fine_tune(params, variant, paths)
    log.info("done: epochs kept %s, dev overall %.4f", summary["task_epochs"], summary["dev"]["overall"])


if __name__ == "__main__":
    run_app(app)
