"""Does `torch.compile` pay for training on this machine? Eager against compiled, measured in one run.

    python -m bench.compile_step [--steps 24] [--bf16/--no-bf16]

Both drive the `train` stage's own Trainer on one variant: the same model and parameters, the same real
batches (length-bucketed, so sequence lengths vary: the model is compiled with dynamic shapes), a step
being forward, backward and the optimiser update. The compiled module shares the eager one's
parameters, so the two alternate in blocks over the same batches and drift in the machine's speed hits
both alike. The first compiled steps, which include compilation, are reported apart from the steady
state. Needs data/tokenized (`dvc repro tokenize`). Not part of `python -m bench`: compiling takes
minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import typer

from bench.smart_step import scratch_trainer, timed_steps
from stages.core.params import variant_params
from stages.core.runtime import setup_logging

app = typer.Typer(add_completion=False)


def alternate(trainer, models: dict[str, torch.nn.Module], schedule: list[tuple[str, ...]],
              block: int) -> dict[str, list[float]]:
    """Seconds per step of each model, alternating block by block over `schedule`."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for start in range(0, len(schedule), block):
        for name, model in models.items():
            trainer.model = model
            times[name] += timed_steps(trainer, trainer.objective, schedule[start:start + block])
    return times


@app.command()
def main(steps: int = typer.Option(24, help="timed steady-state steps per mode"),
         warmup: int = typer.Option(6, help="untimed-in-the-ratio first steps of each mode (compilation)"),
         block: int = typer.Option(2, help="steps per block; the modes alternate block by block"),
         bf16: bool = typer.Option(None, help="override train.bf16 of the variant"),
         variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized")),
         json_out: Path = typer.Option(None, help="also write the figures here")) -> None:
    setup_logging()
    params = variant_params(params_file, variant)
    if bf16 is not None:
        params = dataclasses.replace(params, train=dataclasses.replace(params.train, bf16=bf16))
    with tempfile.TemporaryDirectory() as scratch:
        trainer = scratch_trainer(params, variant, tokenized_dir, Path(scratch))
        trainer.model.train()
        eager = trainer.model
        compiled = torch.compile(eager, dynamic=True)
        schedule = trainer.schedule(0)[: warmup + steps]
        started = time.perf_counter()
        warmup_times = alternate(trainer, {"eager": eager, "compiled": compiled}, schedule[:warmup], warmup)
        print(f"first {warmup} steps: eager {sum(warmup_times['eager']):.1f} s, compiled "
              f"{sum(warmup_times['compiled']):.1f} s (compilation included); {time.perf_counter() - started:.0f} s",
              flush=True)
        times = alternate(trainer, {"eager": eager, "compiled": compiled}, schedule[warmup:], block)
    report(times, warmup_times, trainer.bf16, json_out)


def report(times: dict[str, list[float]], warmup_times: dict[str, list[float]], bf16: bool,
           json_out: Path | None) -> None:
    speedup = sum(times["eager"]) / sum(times["compiled"])
    extra_first = sum(warmup_times["compiled"]) - sum(warmup_times["eager"])
    figures = {name: {"mean_step_seconds": round(statistics.fmean(t), 4),
                      "median_step_seconds": round(statistics.median(t), 4)} for name, t in times.items()}
    figures.update(speedup=round(speedup, 3), bf16=bf16, timed_steps=len(times["eager"]),
                   compile_overhead_seconds=round(extra_first, 1))
    print(f"eager step {figures['eager']['mean_step_seconds']:.3f} s, compiled step "
          f"{figures['compiled']['mean_step_seconds']:.3f} s (means over the same {len(times['eager'])} batches, "
          f"bf16 {bf16})")
    print(f"compiled/eager speed-up {speedup:.2f}x after {extra_first:.0f} s of extra first-step time")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    app()
