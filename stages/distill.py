"""Stage `distill@<student>`: one student of the ensemble, trained on its predictions of the training rows.

The student has the configuration of variant `distill.variant` with its own seed (`distill.students`), and runs
`train`'s fine-tuning loop, each training row's loss blended from the ensemble's prediction of it and its gold label
(mtbert/training/distillation.py). The teacher is the ensemble of metrics/ensemble.json: its members' dumps of the
training split and of the transfer set (stage `transfer`). Writes models/<student>/ (with its card),
data/distilled/<student>/ (dev and test dumps and CS224N files; not in data/predictions/, which the ensemble reads),
data/distilled_snapshots/<student>/ (every epoch's dev dumps, for `stats`' honest estimate), metrics/<student>.json
and metrics/train/<student>.json. Resumes like `train`; with distill.enabled false, writes its outputs saying so.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import sys
from pathlib import Path

import typer

from mtbert import io, layout
from mtbert.data.tasks import tasks_from_params
from mtbert.evaluation.evaluate import write_predictions
from mtbert.evaluation.metrics import headline_summary
from mtbert.evaluation.teacher import ensemble_members, ensemble_teacher, teacher_record, transfer_teacher
from mtbert.model.card import CARD_FILE
from mtbert.model.saved import describe_student, load_model
from mtbert.params_file import load_params, require_student, student_params
from mtbert.runtime import run_app, setup_logging, use_bf16
from mtbert.training import finetune
from mtbert.training.distillation import Distillation
from mtbert.training.distributed import relaunch_with_torchrun, under_torchrun
from mtbert.training.loop import Paths

log = logging.getLogger("distill")
app = typer.Typer(add_completion=False)


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What the stage writes for one student."""
    model: Path  # models/<student>/
    dumps: Path  # data/distilled/<student>/
    snapshots: Path  # data/distilled_snapshots/<student>/: every epoch's dev dumps, as train's data/snapshots/
    metrics: Path  # metrics/<student>.json: dev metrics, as predict's metrics/<variant>.json
    summary: Path  # metrics/train/<student>.json: the training summary, as train's


def skip(outputs: Outputs, student: str) -> None:
    """distill.enabled is false: every output, saying so."""
    log.info("distill.enabled is false: student %s is not trained", student)
    note = (f"# `{student}`: not trained\n\n`distill.enabled` is false in params.yaml, so the `distill` stage "
            "trained no student here (docs/ensembling.md, Distillation).\n")
    for folder in (outputs.model, outputs.dumps, outputs.snapshots):
        with io.atomic_dir(folder) as temp:
            (temp / CARD_FILE).write_text(note, encoding="utf-8")
    for path in (outputs.metrics, outputs.summary):
        io.write_metrics(path, {"enabled": False})


@app.command()
def main(student: str = typer.Option(..., "--student", help="a key of distill.students in params.yaml"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path | None = typer.Option(None, help="[default: data/tokenized/<distill.variant>]"),
         rejects_file: Path | None = typer.Option(None, help="[default: rejects.tsv in the tokenized folder]"),
         predictions_dir: Path = typer.Option(Path("data/predictions"), help="the members' training-split dumps"),
         ensemble_file: Path = typer.Option(Path("metrics/ensemble.json"), help="each task's members"),
         transfer_dir: Path = typer.Option(Path("data/transfer"), help="the transfer set (stage `transfer`)"),
         pretrained_dir: Path | None = typer.Option(None, help="the encoder to start from "
                                                               "[default: models/pretrained/<distill.variant>]"),
         models_dir: Path = typer.Option(Path("models")),
         dumps_dir: Path = typer.Option(Path("data/distilled")),
         snapshots_dir: Path = typer.Option(Path("data/distilled_snapshots"), help="every epoch's dev dumps"),
         metrics_dir: Path = typer.Option(Path("metrics")),
         train_metrics_dir: Path = typer.Option(Path("metrics/train")),
         checkpoints_dir: Path = typer.Option(Path("checkpoints"))) -> None:
    setup_logging()
    distill = load_params(params_file).distill
    require_student(distill, student, params_file)
    outputs = Outputs(model=models_dir / student, dumps=dumps_dir / student, snapshots=snapshots_dir / student,
                      metrics=metrics_dir / f"{student}.json", summary=train_metrics_dir / f"{student}.json")
    if not distill.enabled:
        skip(outputs, student)
        return
    own = student_params(params_file, student)
    tokenized_dir = layout.tokenized_of(distill.variant, tokenized_dir)
    rejects_file = layout.rejects_of(tokenized_dir, rejects_file)
    if own.train.nproc > 1 and not under_torchrun():
        relaunch_with_torchrun(own.train.nproc, "stages.distill", sys.argv[1:])
    tasks = tasks_from_params(own.tasks)
    distillation = Distillation(ensemble_teacher(ensemble_file, predictions_dir, tasks), distill.alpha,
                                distill.temperature,
                                transfer_teacher(ensemble_file, predictions_dir, transfer_dir, tasks),
                                distill.transfer.weight)
    paths = Paths(tokenized=tokenized_dir, model_out=outputs.model, metrics_out=outputs.summary,
                  live_dir=checkpoints_dir / student / "live", checkpoints=checkpoints_dir / student,
                  pretrained=layout.pretrained_of(distill.variant, pretrained_dir), snapshots=outputs.snapshots)
    run, summary = finetune.fine_tune(own, student, paths, labels=distillation)
    if not run.ranks.is_main:
        return
    device, transfer_rows = run.device, {name: len(rows) for name, (rows, _) in distillation.transfer.items()}
    # The training's weights, optimiser state, data and teacher go before the model is loaded again for its
    # dumps: held beside it, they made this process the run's memory peak.
    del run, distillation
    gc.collect()
    record = teacher_record(distill, own.train.seed, transfer_rows, ensemble_members(ensemble_file, tasks))
    describe_student(outputs.model, summary, own, record)
    model, _ = load_model(outputs.model)
    model.to(device)
    with io.atomic_dir(outputs.dumps) as temp:  # as predict's dumps of a variant
        dev = write_predictions(model, ("dev", "test"), tokenized_dir, rejects_file, temp, device=device,
                                bf16=use_bf16(own.predict.bf16, device),
                                **own.runtime.split_batches(device.type, own.predict.batch_size))
    io.write_metrics(outputs.metrics, {**dev, "distill": record})
    log.info("%s dev: overall %.4f  %s", student, dev["overall"], headline_summary(dev, tasks))


if __name__ == "__main__":
    run_app(app)
