"""Stage `stats`: seed statistics of the variants, and their per-epoch curves.

Variants whose params differ only in `train.seed` form a group, and so do the distilled students of stage
`distill` (with distill.enabled; their dumps are in data/distilled/). Writes metrics/stats.json: per group and
task the mean, std, min and max over seeds of each dev metric and of the epoch kept, and for each pair of
groups the difference of their seed-averaged headline metrics with a paired bootstrap interval (see
mtbert/evaluation/seeds.py); per group, the honest estimate of its per-task epoch choice (the epoch chosen
on one half of dev from data/snapshots/, or data/distilled_snapshots/ for the students, scored on the other, as
the ensemble's is); and metrics/curves.tsv, every variant's dev metrics and training loss per epoch, which
`dvc plots show` draws one panel per metric with a line per variant.
"""

from __future__ import annotations

import logging
from itertools import combinations
from pathlib import Path

import typer

from mtbert import io, layout
from mtbert.data.batches import load_split
from mtbert.data.tasks import tasks_from_params
from mtbert.evaluation.metrics import overall, task_metrics
from mtbert.evaluation.predictions import read_aligned
from mtbert.evaluation.report import curve_rows, curves_table
from mtbert.evaluation.seeds import (
    compare_groups,
    group_statistics,
    honest_group,
    seed_groups,
    seed_of,
    spread,
    student_groups,
)
from mtbert.params_file import load_params, read_yaml
from mtbert.runtime import MissingInputError, run_app, setup_logging

log = logging.getLogger("stats")
app = typer.Typer(add_completion=False)


@app.command()
def main(params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path | None = typer.Option(None, help="the dev labels [default: data/tokenized/<the first "
                                                              "variant>]"),
         predictions_dir: Path = typer.Option(Path("data/predictions")),
         distilled_dir: Path = typer.Option(Path("data/distilled"), help="the distilled students' dumps"),
         snapshots_dir: Path = typer.Option(Path("data/snapshots"), help="every epoch's dev dumps of each variant"),
         distilled_snapshots_dir: Path = typer.Option(Path("data/distilled_snapshots"),
                                                      help="every epoch's dev dumps of each student"),
         train_metrics_dir: Path = typer.Option(Path("metrics/train")),
         stats_file: Path = typer.Option(Path("metrics/stats.json")),
         curves_file: Path = typer.Option(Path("metrics/curves.tsv"))) -> None:
    setup_logging()
    params = load_params(params_file)
    tasks = tasks_from_params(params.tasks)
    groups = seed_groups(read_yaml(params_file))
    students = student_groups(params)
    folders = {variant: predictions_dir / variant for variants in groups.values() for variant in variants}
    folders.update({student: distilled_dir / student for group in students.values() for student in group})
    groups = {**groups, **students}
    tokenized_dir = layout.shared_rows(params.models, tokenized_dir)
    dev_splits = {name: load_split(tokenized_dir, task, "dev") for name, task in tasks.items()}
    labels = {name: split.labels for name, split in dev_splits.items()}
    dev = {variant: {name: read_aligned(folder, task, "dev", dev_splits[name].ids) for name, task in tasks.items()}
           for variant, folder in folders.items()}
    summaries = {variant: read_summary(train_metrics_dir / f"{variant}.json") for variant in dev}
    report: dict = {"tasks": {name: task.headline for name, task in tasks.items()}, "groups": {},
                    "comparisons": {}, "bootstrap": {"resamples": params.stats.resamples,
                                                     "confidence": params.stats.confidence}}
    curves = []
    for group, variants in groups.items():
        per_variant = []
        for variant in variants:
            metrics = {name: task_metrics(task, dev[variant][name], labels[name]) for name, task in tasks.items()}
            per_variant.append({**metrics, "overall": overall(metrics, tasks)})
            curves += curve_rows(variant, group, summaries[variant], tasks)
        report["groups"][group] = {
            "variants": variants, "seeds": [seed_of(params_file, params, v) for v in variants],
            "dev": group_statistics(per_variant, tasks),
            "epochs": {name: spread([summaries[v]["task_epochs"][name] for v in variants]) for name in tasks},
            "honest": honest_group(variants, distilled_snapshots_dir if group in students else snapshots_dir,
                                   dev_splits, tasks),
            **({"student_of": params.distill.variant} if group in students else {})}
        log.info("%s (%d seeds): dev overall %.4f ± %.4f", group, len(variants),
                 report["groups"][group]["dev"]["overall"]["mean"], report["groups"][group]["dev"]["overall"]["std"])
    for first, second in combinations(groups, 2):
        result = compare_groups(tasks, {name: [dev[v][name] for v in groups[second]] for name in tasks},
                                {name: [dev[v][name] for v in groups[first]] for name in tasks}, labels,
                                resamples=params.stats.resamples, confidence=params.stats.confidence)
        report["comparisons"][f"{second} - {first}"] = result
        log.info("%s - %s: overall %+.4f [%+.4f, %+.4f]", second, first, result["overall"]["difference"],
                 result["overall"]["low"], result["overall"]["high"])
    io.write_metrics(stats_file, report)
    io.write_text(curves_file, curves_table(curves))


def read_summary(path: Path) -> dict:
    if not path.is_file():
        raise MissingInputError(f"{path} is missing; run `dvc repro` for the train stage that writes it")
    return io.read_json(path, "expected the summary `train` writes: run `dvc repro` for that train stage again")


if __name__ == "__main__":
    run_app(app)
