"""Does `torch.compile` pay for training on this machine? Eager against compiled, measured in one run.

    python -m bench.probes.compile_step [--steps 24] [--bf16/--no-bf16]

Both drive the `train` stage's own run (bench/common.py `scratch_run`) on one variant: the same model
and parameters, the same real batches (length-bucketed, so sequence lengths vary: the model is compiled
with dynamic shapes), a step being forward, backward and the optimiser update. The compiled module shares
the eager one's parameters, so the two alternate in blocks over the same batches and drift in the machine's speed hits
both alike. The first compiled steps, which include compilation, are reported apart from the steady
state. Needs data/tokenized/base (`dvc repro tokenize@base`). Not part of `python -m bench`: compiling takes
minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch
import typer

from bench.common import scratch_run, timed_steps
from mtbert import io
from mtbert.params_file import variant_params, with_changes
from mtbert.runtime import setup_logging
from mtbert.training.build import FineTuning, schedule
from mtbert.training.progress import Progress

app = typer.Typer(add_completion=False)


def alternate(run: FineTuning, progress: Progress, models: dict[str, torch.nn.Module],
              steps: list[tuple[str, ...]], block: int) -> dict[str, list[float]]:
    """Seconds per step of each model (sharing the run's parameters), alternating block by block."""
    runs = {name: dataclasses.replace(run, model=model) for name, model in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for start in range(0, len(steps), block):
        for name, variant in runs.items():
            times[name] += timed_steps(variant, progress, steps[start:start + block])
    return times


@app.command()
def main(steps: int = typer.Option(24, help="timed steady-state steps per mode"),
         warmup: int = typer.Option(6, help="untimed-in-the-ratio first steps of each mode (compilation)"),
         block: int = typer.Option(2, help="steps per block; the modes alternate block by block"),
         bf16: bool = typer.Option(None, help="override train.bf16 of the variant"),
         variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized/base")),
         json_out: Path = typer.Option(None, help="also write the figures here")) -> None:
    setup_logging()
    params = variant_params(params_file, variant)
    if bf16 is not None:
        params = params.model_copy(update={"train": with_changes(params.train, bf16=bf16)})
    with tempfile.TemporaryDirectory() as scratch:
        run, progress = scratch_run(params, variant, tokenized_dir, Path(scratch))
        run.model.train()
        models = {"eager": run.model, "compiled": torch.compile(run.model, dynamic=True)}
        steps_run = schedule(run, 0)[: warmup + steps]
        started = time.perf_counter()
        warmup_times = alternate(run, progress, models, steps_run[:warmup], warmup)
        print(f"first {warmup} steps: eager {sum(warmup_times['eager']):.1f} s, compiled "
              f"{sum(warmup_times['compiled']):.1f} s (compilation included); {time.perf_counter() - started:.0f} s",
              flush=True)
        times = alternate(run, progress, models, steps_run[warmup:], block)
    report(times, warmup_times, run.bf16, json_out)


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
        io.write_json(json_out, figures)  # atomic, parent folders made


if __name__ == "__main__":
    app()
