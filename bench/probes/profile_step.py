"""Where a training step's time goes: torch.profiler over real steps of the `train` stage's own run.

    python -m bench.probes.profile_step [--steps 24] [--warmup 4] [--json-out FILE]

The run is set up as the stage sets it up (bench/common.py `scratch_run`) and each step is what the
stage runs: training/step.py's `step` (batch collation, forward, backward, clipping, AdamW, the moving
average, the LR schedule). The operators' self CPU time is grouped into categories (matmuls, attention,
LayerNorm, GELU, dropout, the embedding's gradient, the optimiser, the moving average, casts, ...); the
rest of the wall time, outside any operator, is Python and collation overhead. Needs data/tokenized/base.

`--epoch-end` (on by default) also times what the stage does once per epoch after its steps, the evaluation
passes, as `epoch_end.evaluate_and_dump` and the raw weights' dev pass run them: the dev pass of the model kept
(with its dev dumps: the defaults' epoch end), the test predictions `train.snapshot_test` adds, and the raw
weights' dev pass `train.dev_raw` adds (with a moving average); each as a share of an epoch (its steps at
the profiled rate). `--no-epoch-end` leaves them out.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import torch
import typer
from torch.profiler import ProfilerActivity, profile, record_function

from bench.common import scratch_run
from mtbert import io
from mtbert.data.batches import load_split
from mtbert.evaluation.evaluate import evaluate, predict_split
from mtbert.params_file import variant_params, with_changes
from mtbert.runtime import setup_logging
from mtbert.training import build, epoch_end
from mtbert.training.step import step

app = typer.Typer(add_completion=False)

# Operator name fragments per category, first match wins (aten names as the profiler reports them).
CATEGORIES = {
    "optimizer (AdamW)": ("adamw", "optimizer.step"),
    "moving average": ("lerp", "_foreach"),
    "embedding gradient": ("embedding_dense_backward", "embedding_backward"),
    "attention": ("scaled_dot_product", "_softmax", "softmax", "bmm", "baddbmm"),
    "matmul": ("addmm", "aten::mm", "matmul", "linear"),
    "layernorm": ("layer_norm",),
    "gelu": ("gelu",),
    "dropout": ("dropout", "bernoulli", "native_dropout"),
    "casts and copies": ("aten::to", "_to_copy", "copy_", "clone", "contiguous"),
    "gradient clipping": ("norm", "clip"),
    "loss": ("cross_entropy", "nll_loss", "log_softmax", "mse_loss", "binary_cross_entropy"),
    "zeroing and filling": ("zero_", "fill_", "zeros", "empty"),
    "elementwise": ("aten::add", "aten::mul", "aten::div", "aten::sub", "aten::where", "aten::sum", "aten::mean"),
}


def category(name: str) -> str:
    lowered = name.lower()
    for label, fragments in CATEGORIES.items():
        if any(fragment.lower() in lowered for fragment in fragments):
            return label
    return "other operators"


def profiled_steps(run, progress, steps: list[tuple[str, ...]]) -> tuple[profile, float]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for tasks in steps:
            with record_function("mtbert.step"):
                step(run, progress, tasks, ends_update=True)
        wall = time.perf_counter() - started
    return prof, wall


def breakdown(prof: profile, wall: float) -> dict:
    """Self CPU seconds per category and per top operator, with shares of the wall time."""
    per_category: dict[str, float] = {}
    operators = []
    for event in prof.key_averages():
        if event.key.startswith("mtbert."):
            continue
        seconds = event.self_cpu_time_total / 1e6
        per_category[category(event.key)] = per_category.get(category(event.key), 0.0) + seconds
        operators.append((event.key, seconds, event.count))
    # Self time is the calling thread's: an operator's intra-op threads are inside it, so the shares add up
    # to at most the wall time; what is left is Python, collation and the profiler's own bookkeeping.
    operators.sort(key=lambda item: -item[1])
    return {"wall_seconds": round(wall, 3), "threads": torch.get_num_threads(),
            "categories": {name: {"seconds": round(s, 3), "share": round(s / wall, 3)}
                           for name, s in sorted(per_category.items(), key=lambda item: -item[1])},
            "outside_operators_share": round(max(0.0, 1 - sum(per_category.values()) / wall), 3),
            "top_operators": [{"name": name, "seconds": round(s, 3), "calls": calls,
                               "share": round(s / wall, 3)} for name, s, calls in operators[:15]]}


def epoch_end_seconds(run: build.FineTuning) -> dict[str, float]:
    """Seconds of one epoch end's evaluation passes, each timed once after an untimed pass over every split
    (oneDNN builds its kernels for the evaluation's batch shapes): the defaults' epoch end
    (`evaluate_and_dump`: the dev pass, its metrics and dumps), the test predictions train.snapshot_test adds,
    and with a moving average the raw weights' dev pass train.dev_raw adds."""
    def timed(work) -> float:
        started = time.perf_counter()
        work()
        return time.perf_counter() - started

    def predict_every(splits) -> None:
        for split in splits:
            predict_split(run.average.model, split, run.train.eval_batch_size, run.device, run.bf16)

    dev_only = with_changes(run.train, snapshot_test=False)
    run = dataclasses.replace(run, snapshot_data={
        name: build.snapshot_splits(dev_only, run.paths.tokenized, task, run.dev_data[name])
        for name, task in run.tasks.items()})
    test = [load_split(run.paths.tokenized, task, "test") for task in run.tasks.values()]
    predict_every([*run.dev_data.values(), *test])  # warm-up
    seconds = {"dev pass and dumps": timed(lambda: epoch_end.evaluate_and_dump(run, 1)),
               "test predictions (train.snapshot_test)": timed(lambda: predict_every(test))}
    if run.average.separate:
        seconds["raw weights' dev pass (train.dev_raw)"] = timed(
            lambda: evaluate(run.model, run.dev_data, run.train.eval_batch_size, run.device, run.bf16))
    return seconds


def epoch_end_figures(seconds: dict[str, float], step_seconds: float, steps_per_epoch: int) -> dict:
    """Each part's seconds and its share of an epoch whose steps ran at `step_seconds`, with every part on."""
    steps = step_seconds * steps_per_epoch
    epoch = steps + sum(seconds.values())
    return {"steps_per_epoch": steps_per_epoch, "epoch_steps_seconds": round(steps, 1),
            "parts": {name: {"seconds": round(value, 2), "share_of_epoch": round(value / epoch, 4)}
                      for name, value in seconds.items()}}


@app.command()
def main(steps: int = typer.Option(24, help="profiled steps"),
         warmup: int = typer.Option(4, help="steps run before profiling (oneDNN builds its kernels)"),
         variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized/base")),
         epoch_end: bool = typer.Option(True, help="also time an epoch end's evaluation passes"),
         json_out: Path = typer.Option(None, help="also write the breakdown here")) -> None:
    setup_logging("WARNING")
    params = variant_params(params_file, variant)
    with tempfile.TemporaryDirectory() as scratch:
        run, progress = scratch_run(params, variant, tokenized_dir, Path(scratch))
        run.model.train()
        schedule = build.schedule(run, 0)[: warmup + steps]
        for tasks in schedule[:warmup]:
            step(run, progress, tasks, ends_update=True)
        prof, wall = profiled_steps(run, progress, schedule[warmup:])
        figures = breakdown(prof, wall)
        figures.update(steps=steps, bf16=run.bf16)
        if epoch_end:
            figures["epoch_end"] = epoch_end_figures(epoch_end_seconds(run), wall / steps, run.steps_per_epoch)
    print(f"{steps} steps in {wall:.2f} s ({wall / steps:.3f} s/step, bf16 {run.bf16}, "
          f"{figures['threads']} threads); share of the wall time:")
    for name, entry in figures["categories"].items():
        print(f"  {name:22s} {entry['share']:6.1%}")
    print(f"  {'outside operators':22s} {figures['outside_operators_share']:6.1%}  (Python, collation)")
    print("top operators (self CPU):")
    for entry in figures["top_operators"]:
        print(f"  {entry['share']:6.1%}  {entry['calls']:6d} calls  {entry['name']}")
    if epoch_end:
        end = figures["epoch_end"]
        print(f"an epoch end's evaluation, beside an epoch's {end['steps_per_epoch']} steps "
              f"({end['epoch_steps_seconds']:.0f} s at the profiled rate):")
        for name, entry in end["parts"].items():
            print(f"  {name:40s} {entry['seconds']:7.1f} s  {entry['share_of_epoch']:6.1%} of the epoch")
    if json_out is not None:
        io.write_json(json_out, figures)  # atomic, parent folders made


if __name__ == "__main__":
    app()
