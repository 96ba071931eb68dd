"""Peak resident memory of training one variant: a few steps, an evaluation on dev, a resume checkpoint.

    python -m bench.train_memory [--steps 20]    # prints {"peak_rss_gib": ..., "seconds_per_step": ...}

`--onednn-cache`, `--malloc-threshold-mb`, `--max-batch-tokens` and `--frozen-states` (0 or 1) override
`runtime.onednn_cache`, `runtime.malloc_threshold_mb`, `train.max_batch_tokens` and `runtime.frozen_states.cpu`
(-1 keeps params.yaml's), as
bench/probes/memory_knobs.py compares them. `--longest-first` makes each task's first batch its longest rows, the
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

from bench.common import scratch_run
from mtbert.evaluation.evaluate import evaluate
from mtbert.params_file import variant_params, with_changes
from mtbert.runtime import peak_rss_gib, setup_logging
from mtbert.training import build
from mtbert.training import progress as progress_state
from mtbert.training.step import step

app = typer.Typer(add_completion=False)


class LongestFirst:
    """A task's batch stream whose first batch is the task's `size` longest rows, then the stream's own."""

    def __init__(self, stream, lengths: np.ndarray, size: int):
        self.stream, self.first = stream, np.argsort(lengths, kind="stable")[-size:]

    def next(self) -> np.ndarray:
        first, self.first = self.first, None
        return self.stream.next() if first is None else first


def with_overrides(params, onednn_cache: int, malloc_threshold_mb: int, max_batch_tokens: int,
                   frozen_states: int = -1):
    """params with each override that is not -1 put in (frozen_states: on a CPU)."""
    runtime, train = params.runtime, params.train
    states = runtime.frozen_states if frozen_states < 0 else with_changes(runtime.frozen_states,
                                                                           cpu=bool(frozen_states))
    runtime = with_changes(runtime, onednn_cache=runtime.onednn_cache if onednn_cache < 0 else onednn_cache,
                                  malloc_threshold_mb=(runtime.malloc_threshold_mb if malloc_threshold_mb < 0
                                                       else malloc_threshold_mb), frozen_states=states)
    train = with_changes(train, max_batch_tokens=train.max_batch_tokens if max_batch_tokens < 0
                                else max_batch_tokens)
    return params.model_copy(update={"runtime": runtime, "train": train})


@app.command()
def main(steps: int = typer.Option(20), variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized/base")),
         onednn_cache: int = typer.Option(-1), malloc_threshold_mb: int = typer.Option(-1),
         max_batch_tokens: int = typer.Option(-1), frozen_states: int = typer.Option(-1),
         longest_first: bool = typer.Option(False)) -> None:
    setup_logging("WARNING")
    params = with_overrides(variant_params(params_file, variant), onednn_cache, malloc_threshold_mb,
                            max_batch_tokens, frozen_states)
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        run, progress = scratch_run(params, variant, tokenized_dir, Path(scratch))
        prepare_seconds = time.perf_counter() - start  # with the frozen states, their computation
        schedule = build.schedule(run, 0)[:steps]
        fed = run  # with longest_first, the same run fed each task's longest batch first
        if longest_first:
            fed = dataclasses.replace(run, streams={
                name: LongestFirst(stream, run.row_lengths[name], run.train.batch_size[name])
                for name, stream in run.streams.items()})
        run.model.train()
        start = time.perf_counter()
        for tasks in schedule:
            step(fed, progress, tasks, ends_update=True)
        fed.finite.check()  # reads the steps' losses: on a GPU, waits for the last step to finish
        seconds_per_step = (time.perf_counter() - start) / steps
        start = time.perf_counter()
        evaluate(run.model, run.dev_data, run.train.eval_batch_size, run.device, run.bf16)
        dev_seconds = time.perf_counter() - start
        progress_state.checkpoint(run, progress)  # the checkpoint saves the streams' positions
    print(json.dumps({"peak_rss_gib": round(peak_rss_gib(), 3), "seconds_per_step": round(seconds_per_step, 4),
                      "prepare_seconds": round(prepare_seconds, 1), "dev_pass_seconds": round(dev_seconds, 1)}))


if __name__ == "__main__":
    app()
