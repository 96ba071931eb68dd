"""Step time of SMART (K ascent steps, default 1) against plain training, measured in the same run.

    python -m bench.smart_step [--steps 40]

Both objectives drive the `train` stage's own Trainer on the default variant: the same model, the same
real batches (the first steps of its first epoch), a step being forward, backward and the optimiser
update. They alternate in blocks, so drift in the machine's speed hits both alike. Needs data/tokenized
(`dvc repro tokenize`).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import typer

from stages.core.params import variant_params
from stages.core.runtime import setup_logging
from stages.core.training.finetune import Trainer
from stages.core.training.objective import Objective
from stages.core.training.run import Paths

TARGETS = {"smart": 2.5, "random": 2.0}  # step time over plain: SMART (K ascent steps) and random mode
app = typer.Typer(add_completion=False)


def smart_objective(trainer: Trainer, steps: int, mode: str = "adversarial") -> Objective:
    """SMART on every task (lambda 1, K = steps, or random mode), no teacher; the rest of smart.* as in
    params.yaml."""
    params = trainer.params.smart
    every_task = {task: None for task in params.task_lambda}  # every task inherits lambda
    smart = dataclasses.replace(params, lambda_=1.0, task_lambda=every_task, steps=steps, mode=mode, mu=0.0)
    return Objective(trainer.model, smart, trainer.device, trainer.bf16, trainer.p.seed)


def plain_objective(trainer: Trainer) -> Objective:
    plain = dataclasses.replace(trainer.params.smart, lambda_=0.0, mu=0.0)
    return Objective(trainer.model, plain, trainer.device, trainer.bf16, trainer.p.seed)


def timed_steps(trainer: Trainer, objective: Objective, schedule: list[tuple[str, ...]]) -> list[float]:
    trainer.objective = objective
    seconds = []
    for tasks in schedule:
        started = time.perf_counter()
        trainer.forward_backward(tasks)
        trainer.update()
        seconds.append(time.perf_counter() - started)
    return seconds


def scratch_trainer(params, variant: str, tokenized_dir: Path, scratch: Path) -> Trainer:
    """The `train` stage's Trainer for one variant, writing (if at all) only under `scratch`."""
    paths = Paths(tokenized=tokenized_dir, model_out=scratch / "model", metrics_out=scratch / "metrics.json",
                  live_dir=scratch / "live", checkpoints=scratch / "checkpoints")
    return Trainer(params, variant, paths)


def alternating_step_times(trainer: Trainer, steps: int, block: int, smart_steps: int) -> dict[str, list[float]]:
    """Seconds per step of plain, SMART(K = smart_steps) and random-mode training, alternating block by
    block over the same batches, so a slow spell of the machine hits all three alike."""
    objectives = {"plain": plain_objective(trainer), "smart": smart_objective(trainer, smart_steps),
                  "random": smart_objective(trainer, smart_steps, mode="random")}
    schedule = trainer.schedule(0)[: block + steps]
    for objective in objectives.values():  # warm-up, untimed
        timed_steps(trainer, objective, schedule[:block])
    times: dict[str, list[float]] = {name: [] for name in objectives}
    for start in range(block, len(schedule), block):
        for name, objective in objectives.items():
            times[name] += timed_steps(trainer, objective, schedule[start:start + block])
    return times


@app.command()
def main(steps: int = typer.Option(40, help="timed steps per objective"),
         block: int = typer.Option(2, help="steps per block; the objectives alternate block by block"),
         smart_steps: int = typer.Option(1, help="K, the ascent steps of SMART"),
         variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized")),
         json_out: Path = typer.Option(None, help="also write the figures here")) -> None:
    setup_logging()
    params = variant_params(params_file, variant)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = scratch_trainer(params, variant, tokenized_dir, Path(scratch))
        trainer.model.train()
        times = alternating_step_times(trainer, steps, block, smart_steps)
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
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    app()
