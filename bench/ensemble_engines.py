"""The exported ensemble timed in a process of its own, as deployed (bench/deploy.py `ensemble_figures`
starts it): no torch imported.

Reads a job as JSON on stdin (ensemble_dir, ensemble_file, texts per task, the sentence and pair tasks,
threads, batch_size, calls, rounds) and prints JSON: one sentence's and one pair's p50/p95 and batched
texts/s of `ensemble` (exports/ensemble loaded as one model), `members_apart` (the same members assembled
from metrics/ensemble.json, each tokenizing for itself: `mtbert predict --ensemble ... --models-dir`) and
`one_member` (its first member alone, where it serves every task), taking turns call by call and round by round.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.latency import sentence_and_pair_figures
from mtbert.deploy.engine import ExportedEnsemble, OnnxEnsemblePredictor


def main() -> None:
    job = json.load(sys.stdin)
    options = {"batch_size": job["batch_size"], "threads": job["threads"]}
    ensemble = ExportedEnsemble.load(job["ensemble_dir"], **options)
    first = next(name for name, predictor in ensemble.predictors.items() if predictor is ensemble.first)
    predictors = {"ensemble": ensemble,
                  "members_apart": OnnxEnsemblePredictor.load(job["ensemble_file"], job["ensemble_dir"], **options)}
    if all(task in ensemble.first.tasks for task in job["texts"]):  # one member that serves every task
        predictors["one_member"] = ensemble.first
    texts = {task: [tuple(row) for row in rows] for task, rows in job["texts"].items()}
    figures = {"first_member": first, "member_folder": str(Path(job["ensemble_dir"]) / first),
               **sentence_and_pair_figures(predictors, texts, job["sentence_task"], job["pair_task"], job["calls"],
                                           job["rounds"])}
    json.dump(figures, sys.stdout)


if __name__ == "__main__":
    main()
