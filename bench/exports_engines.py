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

from bench.latency import batched_rates, single_sentence_ms
from mtbert.deploy.engine import load_export


def main() -> None:
    job = json.load(sys.stdin)
    options = {"batch_size": job["batch_size"], "threads": job["threads"]}
    predictors = {name: load_export(folder, **options) for name, folder in job["exports"].items()}
    for predictor in predictors.values():
        predictor.warm()
    texts = {task: [tuple(row) for row in rows] for task, rows in job["texts"].items()}
    sentence, pair = job["sentence_task"], job["pair_task"]
    figures = {"single_sentence_ms": single_sentence_ms(predictors, sentence, texts[sentence], job["calls"]),
               "single_pair_ms": single_sentence_ms(predictors, pair, texts[pair], job["calls"]),
               "texts_per_second": batched_rates(predictors, texts, job["rounds"]),
               "torch_imported": "torch" in sys.modules}
    json.dump(figures, sys.stdout)


if __name__ == "__main__":
    main()
