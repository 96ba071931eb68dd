"""Peak resident memory of training one variant: a few steps, an evaluation on dev, a resume checkpoint.

    python -m bench.train_memory [--steps 20]    # prints {"peak_rss_gib": ..., "seconds_per_step": ...}

`--onednn-cache` and `--malloc-threshold-mb` override `runtime.onednn_cache` and
`runtime.malloc_threshold_mb` (-1 keeps params.yaml's), as bench/memory_knobs.py compares them.

Run as its own process (bench/suite.py does) so the figure is that of training alone.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import tempfile
import time
from pathlib import Path

import typer

from bench.smart_step import scratch_trainer
from stages.core.evaluation.evaluate import evaluate
from stages.core.params import variant_params
from stages.core.runtime import setup_logging

app = typer.Typer(add_completion=False)


@app.command()
def main(steps: int = typer.Option(20), variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized")),
         onednn_cache: int = typer.Option(-1), malloc_threshold_mb: int = typer.Option(-1)) -> None:
    setup_logging("WARNING")
    params = variant_params(params_file, variant)
    runtime = params.runtime
    runtime = dataclasses.replace(runtime, onednn_cache=runtime.onednn_cache if onednn_cache < 0 else onednn_cache,
                                  malloc_threshold_mb=(runtime.malloc_threshold_mb if malloc_threshold_mb < 0
                                                       else malloc_threshold_mb))
    params = dataclasses.replace(params, runtime=runtime)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = scratch_trainer(params, variant, tokenized_dir, Path(scratch))
        trainer.model.train()
        start = time.perf_counter()
        for tasks in trainer.schedule(0)[:steps]:
            trainer.forward_backward(tasks)
            trainer.update()
        seconds_per_step = (time.perf_counter() - start) / steps
        evaluate(trainer.model, trainer.dev_data, trainer.p.eval_batch_size, trainer.device, trainer.bf16)
        trainer.checkpoint()
    print(json.dumps({"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 3),
                      "seconds_per_step": round(seconds_per_step, 4)}))


if __name__ == "__main__":
    app()
