"""Timing loops over prediction engines (anything with `predict(task, texts)` and `values(task, texts)`).

Imports nothing heavy, so bench/onnx_engines.py times the ONNX engines in a process without torch.
"""

from __future__ import annotations

import sys
import time

import numpy as np


def single_sentence_ms(predictors: dict, task: str, sentences: list[tuple[str, ...]], calls: int) -> dict:
    """p50 and p95 of one sentence's predict() per engine, the engines taking turns call by call."""
    latencies: dict[str, list[float]] = {name: [] for name in predictors}
    for index in range(calls + 1):  # the first call of each is a warm-up
        for name, predictor in predictors.items():
            started = time.perf_counter()
            predictor.predict(task, [sentences[index % len(sentences)]])
            if index:
                latencies[name].append(1000 * (time.perf_counter() - started))
    return {name: {"p50": round(float(np.percentile(values, 50)), 3), "p95": round(float(np.percentile(values, 95)), 3)}
            for name, values in latencies.items()}


def batched_rates(predictors: dict, texts: dict[str, list], rounds: int) -> dict:
    """Sentences (or pairs) per second from raw text over every task's dev rows, per engine, alternating."""
    seconds = dict.fromkeys(predictors, 0.0)
    for _ in range(rounds):
        for name, predictor in predictors.items():
            started = time.perf_counter()
            for task, rows in texts.items():
                predictor.values(task, rows)
            seconds[name] += time.perf_counter() - started
    count = rounds * sum(len(rows) for rows in texts.values())
    return {name: round(count / elapsed, 1) for name, elapsed in seconds.items()}


def sentence_and_pair_figures(predictors: dict, texts: dict[str, list], sentence: str, pair: str, calls: int,
                              rounds: int) -> dict:
    """One sentence's and one pair's p50/p95 and batched texts/s of each predictor, warmed first, taking turns."""
    for predictor in predictors.values():
        predictor.warm()
    return {"single_sentence_ms": single_sentence_ms(predictors, sentence, texts[sentence], calls),
            "single_pair_ms": single_sentence_ms(predictors, pair, texts[pair], calls),
            "texts_per_second": batched_rates(predictors, texts, rounds),
            "torch_imported": "torch" in sys.modules}
