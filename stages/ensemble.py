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

from mtbert import io, layout
from mtbert.data.batches import load_split
from mtbert.data.tasks import tasks_from_params
from mtbert.evaluation.candidates import candidates, require_test_snapshots
from mtbert.evaluation.ensemble import ensemble_task, method_name
from mtbert.evaluation.metrics import headline, overall
from mtbert.evaluation.plots import write_plot_tables
from mtbert.evaluation.predictions import read_dump, rejected_ids, write_dump, write_submission
from mtbert.model.card import CARD_FILE, ensemble_card
from mtbert.params import as_dict
from mtbert.params_file import load_params, variant_params
from mtbert.runtime import run_app, setup_logging

log = logging.getLogger("ensemble")
app = typer.Typer(add_completion=False)


@app.command()
def main(params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path | None = typer.Option(None, help="the dev labels and rejects [default: "
                                                              "data/tokenized/<the first variant>]"),
         rejects_file: Path | None = typer.Option(None, help="[default: rejects.tsv in the tokenized folder]"),
         predictions_dir: Path = typer.Option(Path("data/predictions")),
         snapshots_dir: Path = typer.Option(Path("data/snapshots")),
         out_dir: Path = typer.Option(Path("data/ensemble")),
         plots_dir: Path = typer.Option(Path("data/plots/ensemble")),
         metrics_file: Path = typer.Option(Path("metrics/ensemble.json"))) -> None:
    setup_logging()
    params = load_params(params_file)
    tasks = tasks_from_params(params.tasks)
    variants = sorted(params.models)
    tokenized_dir = layout.shared_rows(variants, tokenized_dir)
    rejects_file = layout.rejects_of(tokenized_dir, rejects_file)
    if params.ensemble.snapshots:
        require_test_snapshots(snapshots_dir, variants, list(tasks.values()))
    report: dict = {"variants": variants, "method": method_name(params.ensemble)}
    methods: dict[str, dict[str, float]] = {}
    for task in tasks.values():
        dev_split = load_split(tokenized_dir, task, "dev")
        dev = {snapshots: candidates(predictions_dir, snapshots_dir, variants, task, "dev", dev_split.ids, snapshots)
               for snapshots in (False, True)}
        test_ids = read_dump(predictions_dir / variants[0], task, "test")[0]
        test = candidates(predictions_dir, snapshots_dir, variants, task, "test", test_ids, params.ensemble.snapshots)
        chosen = ensemble_task(task, dev, dev_split.labels, dev_split.ids, test, params.ensemble)
        for split, ids, values in (("dev", dev_split.ids, chosen.dev_values), ("test", test_ids, chosen.test_values)):
            write_dump(out_dir, task, split, ids, values)
            write_submission(out_dir, task, split, ids, values, rejected_ids(rejects_file, task.name, split))
        write_plot_tables(plots_dir, task, chosen.dev_values, dev_split.labels)
        report[task.name] = chosen.report
        for name, score in chosen.methods.items():
            methods.setdefault(name, {})[task.name] = score
        log.info("%s: dev %s %.4f with %d member(s) of %d candidates; honest estimate %.4f", task.name,
                 task.headline, headline(task, chosen.dev_values, dev_split.labels), len(chosen.report["order"]),
                 len(dev[params.ensemble.snapshots]), chosen.report["honest"]["score"])
    report["overall"] = overall(report, tasks)
    report["honest_overall"] = float(np.mean([report[name]["honest"]["score"] for name in tasks]))
    for name, scores in methods.items():
        scores["overall"] = float(np.mean(list(scores.values())))
        log.info("honest estimate of %s: overall %.4f", name, scores["overall"])
    report["methods"] = methods
    io.write_metrics(metrics_file, report)
    members = sorted({member for name in tasks for member in report[name]["members"]})
    encoders = list(dict.fromkeys(variant_params(params_file, member).model.name for member in members))
    io.write_text(out_dir / CARD_FILE, ensemble_card(report, as_dict(params), tasks, str(metrics_file), encoders))
    log.info("ensemble (%s) dev overall %.4f (honest estimate %.4f)", report["method"], report["overall"],
             report["honest_overall"])


if __name__ == "__main__":
    run_app(app)
