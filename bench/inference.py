"""Speed of `mtbert predict`'s engine (mtbert/inference.py) against the `predict` stage's path.

- latency of one sentence (tokenize, batch, forward, softmax), p50 and p95 over many single calls;
- batched sentences/s of the engine on raw dev texts (tokenizing included) against `predict_split` on the
  already tokenized dev splits (what the `predict` stage runs), alternating so drift hits both alike.
"""

from __future__ import annotations

import time

import numpy as np

from mtbert import io
from mtbert.data.batches import TaskSplit
from mtbert.data.tasks import tokenized_path
from mtbert.evaluation.evaluate import predict_split
from mtbert.inference import Predictor
from mtbert.params import as_dict
from mtbert.runtime import use_bf16


def dev_texts(tokenized_dir, split: TaskSplit) -> list[tuple[str, ...]]:
    """The texts of the first len(split) rows of a tokenized dev split (stored beside the token ids)."""
    table = io.read_parquet(tokenized_path(tokenized_dir, split.task.name, "dev"), split.task.text_columns,
                            "run `dvc repro tokenize` again").slice(0, len(split))
    return list(zip(*(table.column(c).to_pylist() for c in split.task.text_columns), strict=True))


def engine_figures(run, params, tokenized_dir, dev: dict[str, TaskSplit], single_calls: int = 100,
                   rounds: int = 2) -> dict:
    bf16 = use_bf16(params.predict.bf16, run.device)
    predictor = Predictor(run.model, as_dict(params), run.tokenizer, batch_size=params.predict.batch_size,
                          bf16=bf16, device=run.device)
    texts = {name: dev_texts(tokenized_dir, split) for name, split in dev.items()}
    single_task = next(name for name, split in dev.items() if not split.task.is_pair)
    sentences = texts[single_task]
    latencies = []
    for index in range(single_calls):
        started = time.perf_counter()
        predictor.predict(single_task, [sentences[index % len(sentences)]])
        latencies.append(time.perf_counter() - started)
    engine_s = stage_s = 0.0
    for _ in range(rounds):
        started = time.perf_counter()
        for name in dev:
            predictor.values(name, texts[name])
        engine_s += time.perf_counter() - started
        started = time.perf_counter()
        for split in dev.values():
            predict_split(run.model, split, params.predict.batch_size, run.device, bf16)
        stage_s += time.perf_counter() - started
    count = rounds * sum(len(split) for split in dev.values())
    return {"single_sentence_ms": {"p50": round(1000 * float(np.percentile(latencies, 50)), 2),
                                   "p95": round(1000 * float(np.percentile(latencies, 95)), 2)},
            "engine_sentences_per_second": round(count / engine_s, 1),
            "predict_stage_sentences_per_second": round(count / stage_s, 1),
            "engine_over_predict_stage": round(stage_s / engine_s, 3)}
