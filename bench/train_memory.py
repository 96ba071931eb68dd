"""Peak resident memory of training one variant: a few steps, an evaluation on dev, a resume checkpoint.

    python -m bench.train_memory [--steps 20]    # prints {"peak_rss_gib": ..., "seconds_per_step": ...}

`--onednn-cache`, `--malloc-threshold-mb` and `--max-batch-tokens` override `runtime.onednn_cache`,
`runtime.malloc_threshold_mb` and `train.max_batch_tokens` (-1 keeps params.yaml's), as
bench/memory_knobs.py compares them. `--longest-first` makes each task's first batch its longest rows, the
batch that sets a whole epoch's peak, so a few steps show it.

Run as its own process (bench/suite.py does) so the figure is that of training alone.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import typer

from bench.smart_step import scratch_trainer
from stages.core.evaluation.evaluate import evaluate
from stages.core.params import variant_params
from stages.core.runtime import peak_rss_gib, setup_logging

app = typer.Typer(add_completion=False)


class LongestFirst:
    """A task's batch stream whose first batch is the task's `size` longest rows, then the stream's own."""

    def __init__(self, stream, lengths: np.ndarray, size: int):
        self.stream, self.first = stream, np.argsort(lengths, kind="stable")[-size:]

    def next(self) -> np.ndarray:
        first, self.first = self.first, None
        return self.stream.next() if first is None else first


def with_overrides(params, onednn_cache: int, malloc_threshold_mb: int, max_batch_tokens: int):
    """params with each override that is not -1 put in."""
    runtime, train = params.runtime, params.train
    runtime = dataclasses.replace(runtime, onednn_cache=runtime.onednn_cache if onednn_cache < 0 else onednn_cache,
                                  malloc_threshold_mb=(runtime.malloc_threshold_mb if malloc_threshold_mb < 0
                                                       else malloc_threshold_mb))
    train = dataclasses.replace(train, max_batch_tokens=train.max_batch_tokens if max_batch_tokens < 0
                                else max_batch_tokens)
    return dataclasses.replace(params, runtime=runtime, train=train)


@app.command()
def main(steps: int = typer.Option(20), variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized")),
         onednn_cache: int = typer.Option(-1), malloc_threshold_mb: int = typer.Option(-1),
         max_batch_tokens: int = typer.Option(-1), longest_first: bool = typer.Option(False)) -> None:
    setup_logging("WARNING")
    params = with_overrides(variant_params(params_file, variant), onednn_cache, malloc_threshold_mb,
                            max_batch_tokens)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = scratch_trainer(params, variant, tokenized_dir, Path(scratch))
        schedule, streams = trainer.schedule(0)[:steps], trainer.streams
        if longest_first:
            trainer.streams = {name: LongestFirst(stream, trainer.row_lengths[name], trainer.p.batch_size[name])
                               for name, stream in trainer.streams.items()}
        trainer.model.train()
        start = time.perf_counter()
        for tasks in schedule:
            trainer.forward_backward(tasks)
            trainer.update()
        seconds_per_step = (time.perf_counter() - start) / steps
        trainer.streams = streams  # the checkpoint saves their positions
        evaluate(trainer.model, trainer.dev_data, trainer.p.eval_batch_size, trainer.device, trainer.bf16)
        trainer.checkpoint()
    print(json.dumps({"peak_rss_gib": round(peak_rss_gib(), 3),
                      "seconds_per_step": round(seconds_per_step, 4)}))


if __name__ == "__main__":
    app()
