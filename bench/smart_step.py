"""Step time of SMART (K ascent steps, default 1) against plain training, measured in the same run.

    python -m bench.smart_step [--steps 40]

Both objectives drive the `train` stage's own run (mtbert/training/finetune.py's `start`, then
training/step.py's `step`) on the default variant: the same model, the same
real batches (the first steps of its first epoch), a step being forward, backward and the optimiser
update. They alternate in blocks, so drift in the machine's speed hits both alike. Needs data/tokenized/base
(`dvc repro tokenize@base`).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import tempfile
from pathlib import Path

import typer

from bench.common import alternate_blocks, scratch_run, timed_steps
from mtbert import io
from mtbert.params import SmartParams
from mtbert.params_file import variant_params, with_changes
from mtbert.runtime import setup_logging
from mtbert.training.build import FineTuning, make_objective, schedule
from mtbert.training.progress import Progress

TARGETS = {"smart": 2.5, "random": 2.0}  # step time over plain: SMART (K ascent steps) and random mode
app = typer.Typer(add_completion=False)


def with_smart(run: FineTuning, smart: SmartParams) -> FineTuning:
    """The same run (model, data, optimiser) with the objective these smart.* settings choose (with
    smart.mu > 0, its teacher follows the weights after each update)."""
    objective = make_objective(run.model, smart, run.device, run.bf16, run.train.seed)
    return dataclasses.replace(run, objective=objective)


def smart_run(run: FineTuning, steps: int, mode: str = "adversarial") -> FineTuning:
    """SMART on every task (lambda 1, K = steps, or random mode), no teacher; the rest of smart.* as in
    params.yaml."""
    every_task = {task: None for task in run.tasks}  # every task inherits lambda
    return with_smart(run, with_changes(run.params.smart, lambda_=1.0, task_lambda=every_task, steps=steps,
                                               mode=mode, mu=0.0))


def plain_run(run: FineTuning) -> FineTuning:
    return with_smart(run, with_changes(run.params.smart, lambda_=0.0, mu=0.0))


def alternating_step_times(run: FineTuning, progress: Progress, steps: int, block: int,
                           smart_steps: int) -> dict[str, list[float]]:
    """Seconds per step of plain, SMART(K = smart_steps) and random-mode training over the same batches."""
    runs = {"plain": plain_run(run), "smart": smart_run(run, smart_steps),
            "random": smart_run(run, smart_steps, mode="random")}
    arms = {name: functools.partial(timed_steps, variant, progress) for name, variant in runs.items()}
    return alternate_blocks(arms, schedule(run, 0)[: block + steps], block)


@app.command()
def main(steps: int = typer.Option(40, help="timed steps per objective"),
         block: int = typer.Option(2, help="steps per block; the objectives alternate block by block"),
         smart_steps: int = typer.Option(1, help="K, the ascent steps of SMART"),
         variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized/base")),
         json_out: Path = typer.Option(None, help="also write the figures here")) -> None:
    setup_logging()
    params = variant_params(params_file, variant)
    with tempfile.TemporaryDirectory() as scratch:
        run, progress = scratch_run(params, variant, tokenized_dir, Path(scratch))
        run.model.train()
        times = alternating_step_times(run, progress, steps, block, smart_steps)
    report(times, smart_steps, json_out)


def ratios(times: dict[str, list[float]]) -> dict[str, float]:
    """Each regularised objective's total step time over plain's, on the same batches."""
    return {name: round(sum(t) / sum(times["plain"]), 3) for name, t in times.items() if name != "plain"}


def report(times: dict[str, list[float]], smart_steps: int, json_out: Path | None) -> None:
    figures = {name: {"mean_step_seconds": round(statistics.fmean(t), 4),
                      "median_step_seconds": round(statistics.median(t), 4)} for name, t in times.items()}
    figures.update(ratio=ratios(times), target=TARGETS, smart_steps=smart_steps, timed_steps=len(times["plain"]))
    steps = {name: f"{figure['mean_step_seconds']:.3f} s" for name, figure in figures.items() if name in times}
    print(f"plain step {steps['plain']}, SMART(K={smart_steps}) step {steps['smart']}, random mode step "
          f"{steps['random']} (means over the same {len(times['plain'])} batches)")
    for name, ratio in figures["ratio"].items():
        print(f"{name}/plain step time: {ratio:.2f}x (target <= {TARGETS[name]}x: "
              f"{'met' if ratio <= TARGETS[name] else 'NOT met'})")
    if json_out is not None:
        io.write_json(json_out, figures)  # atomic, parent folders made


if __name__ == "__main__":
    app()
