"""Stage `ensemble`: per task, greedy forward selection over the variants' dev dumps.

Reads prediction dumps only (never checkpoints). Writes data/ensemble/ (dumps, CS224N CSVs),
data/plots/ensemble/ (plot tables) and metrics/ensemble.json: dev metrics, the chosen members with
their counts, and the honest estimate (select on one half of dev, score on the other, both ways).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import typer

from stages.core import io
from stages.core.data.batches import load_split
from stages.core.data.tasks import Task, tasks_from_params
from stages.core.evaluation.ensemble import average, greedy_select, honest_estimate
from stages.core.evaluation.metrics import headline, overall, task_metrics
from stages.core.evaluation.plots import write_plot_tables
from stages.core.evaluation.predictions import read_dump, rejected_ids, write_dump, write_submission
from stages.core.params import load_params
from stages.core.runtime import UserError, run_app, setup_logging

log = logging.getLogger("ensemble")
app = typer.Typer(add_completion=False)


@app.command()
def main(params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized")),
         rejects_file: Path = typer.Option(Path("data/rejects.tsv")),
         predictions_dir: Path = typer.Option(Path("data/predictions")),
         out_dir: Path = typer.Option(Path("data/ensemble")),
         plots_dir: Path = typer.Option(Path("data/plots/ensemble")),
         metrics_file: Path = typer.Option(Path("metrics/ensemble.json"))) -> None:
    setup_logging()
    params = load_params(params_file)
    tasks = tasks_from_params(params.tasks)
    variants = sorted(params.models)
    options = {"max_members": params.ensemble.max_members, "with_replacement": params.ensemble.with_replacement}
    report: dict = {"variants": variants}
    for task in tasks.values():
        dev_ids, labels = dev_labels(tokenized_dir, task)
        dev = aligned_dumps(predictions_dir, variants, task, "dev", dev_ids)
        selection = greedy_select(task, dev, labels, **options)
        honest = honest_estimate(task, dev, labels, dev_ids, **options)
        dev_values = average(dev, selection.members)
        test_ids = read_dump(predictions_dir / variants[0], task, "test")[0]
        test_values = average(aligned_dumps(predictions_dir, variants, task, "test", test_ids), selection.members)
        for split, ids, values in (("dev", dev_ids, dev_values), ("test", test_ids, test_values)):
            write_dump(out_dir, task, split, ids, values)
            write_submission(out_dir, task, split, ids, values, rejected_ids(rejects_file, task.name, split))
        write_plot_tables(plots_dir, task, dev_values, labels)
        report[task.name] = {**task_metrics(task, dev_values, labels), "members": selection.counts(),
                             "single_best": {name: headline(task, dev[name], labels) for name in variants},
                             "honest": honest}
        log.info("%s: dev %s %.4f with %s; honest estimate %.4f", task.name, task.headline, selection.score,
                 selection.counts(), honest["score"])
    report["overall"] = overall(report, tasks)
    report["honest_overall"] = float(np.mean([report[name]["honest"]["score"] for name in tasks]))
    io.write_json(metrics_file, report)
    log.info("ensemble dev overall %.4f (honest estimate %.4f)", report["overall"], report["honest_overall"])


def dev_labels(tokenized_dir: Path, task: Task) -> tuple[np.ndarray, np.ndarray]:
    split = load_split(tokenized_dir, task, "dev")
    return split.ids, split.labels


def aligned_dumps(predictions_dir: Path, variants: list[str], task: Task, split: str,
                  ids: np.ndarray) -> dict[str, np.ndarray]:
    """Each variant's predictions in the row order of `ids`; a dump with other ids is an error."""
    aligned = {}
    for name in variants:
        dump_ids, values = read_dump(predictions_dir / name, task, split)
        position = {value: index for index, value in enumerate(dump_ids)}
        missing = [i for i in ids if i not in position]
        if missing or len(dump_ids) != len(ids):
            raise UserError(f"{predictions_dir / name}: {task.name}-{split} dump has {len(dump_ids)} ids, expected "
                             f"{len(ids)} matching the dev/test split (missing e.g. {missing[:3]})")
        aligned[name] = values[[position[i] for i in ids]]
    return aligned


if __name__ == "__main__":
    run_app(app)
