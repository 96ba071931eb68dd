"""Several exports timed in one process of their own, as deployed (bench/side_by_side.py starts it): no torch
imported, each export with the engine its manifest chose.

Reads a job as JSON on stdin (exports: name -> folder, texts per task, the sentence and pair tasks, threads,
batch_size, calls, rounds) and prints JSON: per export, one sentence's and one pair's p50/p95 and batched
texts/s, the exports taking turns call by call and round by round, so a change in the machine's speed hits
them alike.
"""

from __future__ import annotations

import json
import sys

from bench.latency import sentence_and_pair_figures
from mtbert.deploy.engine import load_export


def main() -> None:
    job = json.load(sys.stdin)
    options = {"batch_size": job["batch_size"], "threads": job["threads"]}
    predictors = {name: load_export(folder, **options) for name, folder in job["exports"].items()}
    texts = {task: [tuple(row) for row in rows] for task, rows in job["texts"].items()}
    figures = sentence_and_pair_figures(predictors, texts, job["sentence_task"], job["pair_task"], job["calls"],
                                        job["rounds"])
    json.dump(figures, sys.stdout)


if __name__ == "__main__":
    main()
