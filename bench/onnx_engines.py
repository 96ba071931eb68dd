"""The export's engines timed in a process of their own, as deployed (figure 8; bench/deploy.py starts it).

Reads a job as JSON on stdin (export_dir, task, texts per task, threads, batch_size, calls, rounds) and
prints the figures as JSON: one sentence's p50/p95 and batched sentences/s of ONNX fp32 and int8, the two
alternating, and whether torch was imported (it must not be: bench/deploy.py says why).
"""

from __future__ import annotations

import json
import sys

from bench.latency import batched_rates, single_sentence_ms
from mtbert.deploy.engine import OnnxPredictor


def main() -> None:
    job = json.load(sys.stdin)
    options = {"batch_size": job["batch_size"], "threads": job["threads"]}
    predictors = {"onnx": OnnxPredictor.load(job["export_dir"], engine="onnx", **options)}
    if all("int8" in task.graphs for task in predictors["onnx"].tasks.values()):
        predictors["int8"] = OnnxPredictor.load(job["export_dir"], engine="int8", **options)
    for predictor in predictors.values():
        predictor.warm()
    texts = {task: [tuple(row) for row in rows] for task, rows in job["texts"].items()}
    figures = {"engines": list(predictors),
               "single_sentence_ms": single_sentence_ms(predictors, job["task"], texts[job["task"]], job["calls"]),
               "sentences_per_second": batched_rates(predictors, texts, job["rounds"]),
               "torch_imported": "torch" in sys.modules}
    json.dump(figures, sys.stdout)


if __name__ == "__main__":
    main()
