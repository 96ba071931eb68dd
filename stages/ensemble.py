"""Stage `ensemble`: per task, an ensemble over the variants' dev dumps (and, with `ensemble.snapshots`,
every epoch's snapshot dumps that `train` wrote).

Reads prediction dumps only (never checkpoints). Writes data/ensemble/ (dumps, CS224N CSVs, a model card),
data/plots/ensemble/ (plot tables) and metrics/ensemble.json: dev metrics, the chosen members with
their counts, the honest estimate (choose on one half of dev, score on the other, both ways) and, under
`methods`, the honest estimate of every method with and without snapshots, to choose the default by.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import typer

from mtbert import io
from mtbert.data.batches import load_split
from mtbert.data.tasks import Task, tasks_from_params
from mtbert.evaluation.ensemble import average, every_method, honest_estimate, method_name, select
from mtbert.evaluation.metrics import headline, overall, task_metrics
from mtbert.evaluation.plots import write_plot_tables
from mtbert.evaluation.predictions import (
    dump_path,
    read_aligned,
    read_dump,
    rejected_ids,
    write_dump,
    write_submission,
)
from mtbert.model.card import CARD_FILE, ensemble_card
from mtbert.params import as_dict, load_params
from mtbert.runtime import MissingInputError, UnreadableInputError, run_app, setup_logging

log = logging.getLogger("ensemble")
app = typer.Typer(add_completion=False)


@app.command()
def main(params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized")),
         rejects_file: Path = typer.Option(Path("data/rejects.tsv")),
         predictions_dir: Path = typer.Option(Path("data/predictions")),
         snapshots_dir: Path = typer.Option(Path("data/snapshots")),
         out_dir: Path = typer.Option(Path("data/ensemble")),
         plots_dir: Path = typer.Option(Path("data/plots/ensemble")),
         metrics_file: Path = typer.Option(Path("metrics/ensemble.json"))) -> None:
    setup_logging()
    params = load_params(params_file)
    options = params.ensemble
    tasks = tasks_from_params(params.tasks)
    variants = sorted(params.models)
    report: dict = {"variants": variants, "method": method_name(options)}
    methods = {method_name(method): {} for method in every_method(options)}
    if options.snapshots:
        require_test_snapshots(snapshots_dir, variants, list(tasks.values()))
    for task in tasks.values():
        dev_ids, labels = dev_labels(tokenized_dir, task)
        dev = {snapshots: candidates(predictions_dir, snapshots_dir, variants, task, "dev", dev_ids, snapshots)
               for snapshots in (False, True)}
        for method in every_method(options):
            methods[method_name(method)][task.name] = honest_estimate(task, dev[method.snapshots], labels, dev_ids,
                                                                      method)["score"]
        selection = select(task, dev[options.snapshots], labels, options)
        dev_values = average(dev[options.snapshots], selection.members)
        test_ids = read_dump(predictions_dir / variants[0], task, "test")[0]
        test = candidates(predictions_dir, snapshots_dir, variants, task, "test", test_ids, options.snapshots)
        test_values = average(test, selection.members)
        for split, ids, values in (("dev", dev_ids, dev_values), ("test", test_ids, test_values)):
            write_dump(out_dir, task, split, ids, values)
            write_submission(out_dir, task, split, ids, values, rejected_ids(rejects_file, task.name, split))
        write_plot_tables(plots_dir, task, dev_values, labels)
        honest = honest_estimate(task, dev[options.snapshots], labels, dev_ids, options)  # with its halves
        report[task.name] = {**task_metrics(task, dev_values, labels), "members": selection.counts(),
                             "order": selection.members,  # the average's summation order, to redo it exactly
                             "single_best": {name: headline(task, dev[False][name], labels) for name in variants},
                             "honest": honest}
        log.info("%s: dev %s %.4f with %d member(s) of %d candidates; honest estimate %.4f", task.name,
                 task.headline, headline(task, dev_values, labels), len(selection.members),
                 len(dev[options.snapshots]), honest["score"])
    report["overall"] = overall(report, tasks)
    report["honest_overall"] = float(np.mean([report[name]["honest"]["score"] for name in tasks]))
    for name, scores in methods.items():
        scores["overall"] = float(np.mean(list(scores.values())))
        log.info("honest estimate of %s: overall %.4f", name, scores["overall"])
    report["methods"] = methods
    io.write_metrics(metrics_file, report)
    io.write_text(out_dir / CARD_FILE, ensemble_card(report, as_dict(params), tasks, str(metrics_file)))
    log.info("ensemble (%s) dev overall %.4f (honest estimate %.4f)", report["method"], report["overall"],
             report["honest_overall"])


def candidates(predictions_dir: Path, snapshots_dir: Path, variants: list[str], task: Task, split: str,
               ids: np.ndarray, snapshots: bool) -> dict[str, np.ndarray]:
    """Each variant's predictions (as `predict` made them), and with `snapshots` every other epoch's
    (`<variant>@epoch-<E>`), in the row order of `ids`."""
    found = {name: read_aligned(predictions_dir / name, task, split, ids) for name in variants}
    if snapshots:
        for name in variants:
            chosen = chosen_epoch(snapshots_dir / name, task)
            for folder in epoch_folders(snapshots_dir / name):
                if folder.name != f"epoch-{chosen}":  # that one is the variant's own dump
                    found[f"{name}@{folder.name}"] = read_aligned(folder, task, split, ids)
    return found


def require_test_snapshots(snapshots_dir: Path, variants: list[str], tasks: list[Task]) -> None:
    """`train` predicts test at an epoch's end only with train.snapshot_test: before any work, say so rather
    than stop at the first missing dump."""
    for name in variants:
        for folder in epoch_folders(snapshots_dir / name):
            for task in tasks:
                path = dump_path(folder, task.name, "test")
                if not path.is_file():
                    raise MissingInputError(f"{path} is missing: ensemble.snapshots: true averages every epoch's "
                                            "test predictions, which train writes with train.snapshot_test: true "
                                            "(set it, `dvc repro`)")


def epoch_folders(directory: Path) -> list[Path]:
    """A variant's per-epoch snapshot folders (`epoch-<E>`), in order."""
    return sorted(path for path in directory.glob("epoch-*") if path.is_dir())


def chosen_epoch(directory: Path, task: Task) -> int:
    path = directory / "chosen.json"
    if not path.is_file():
        raise MissingInputError(f"{path} is missing; run `dvc repro` for the train stage that writes it")
    chosen = io.read_json(path, "expected the epochs `train` chose: run `dvc repro` for that train stage again")
    if not isinstance(chosen, dict) or not isinstance(chosen.get(task.name), int):
        raise UnreadableInputError(f"{path}: names no epoch for task {task.name!r}; run `dvc repro` for the "
                                   "train stage that writes it again")
    return chosen[task.name]


def dev_labels(tokenized_dir: Path, task: Task) -> tuple[np.ndarray, np.ndarray]:
    split = load_split(tokenized_dir, task, "dev")
    return split.ids, split.labels


if __name__ == "__main__":
    run_app(app)
