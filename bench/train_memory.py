"""Peak resident memory of training one variant: a few steps, an evaluation on dev, a resume checkpoint.

    python -m bench.train_memory [--steps 20]    # prints {"peak_rss_gib": ...} as its last line

Run as its own process (bench/suite.py does) so the figure is that of training alone.
"""

from __future__ import annotations

import json
import resource
import tempfile
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
         tokenized_dir: Path = typer.Option(Path("data/tokenized"))) -> None:
    setup_logging("WARNING")
    params = variant_params(params_file, variant)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = scratch_trainer(params, variant, tokenized_dir, Path(scratch))
        trainer.model.train()
        for tasks in trainer.schedule(0)[:steps]:
            trainer.forward_backward(tasks)
            trainer.update()
        evaluate(trainer.model, trainer.dev_data, trainer.p.eval_batch_size, trainer.device, trainer.p.bf16)
        trainer.checkpoint()
    print(json.dumps({"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 3)}))


if __name__ == "__main__":
    app()
