"""Peak memory and speed of training under `runtime.onednn_cache` and `runtime.malloc_threshold_mb`.

    python -m bench.probes.memory_knobs [--steps 200] [--rounds 2] [--only "malloc 16 MB" ...]

Each configuration trains the default variant for `--steps` steps in a fresh process
(bench/train_memory.py: steps, a dev evaluation, a checkpoint); the configurations alternate, round
after round, so a drift in the machine's speed hits them alike. Prints each one's peak RSS and seconds
per step (the mean over rounds) against the configuration with neither cap.
"""

from __future__ import annotations

import json
import subprocess
import sys

import typer

app = typer.Typer(add_completion=False)

# name -> (runtime.onednn_cache, runtime.malloc_threshold_mb); 0 leaves the library's default
CONFIGURATIONS = {"neither": (0, 0), "onednn cache 8": (8, 0), "malloc 1 MB": (0, 1), "malloc 16 MB": (0, 16),
                  "both": (8, 1), "malloc 16 MB + onednn cache 8": (8, 16),
                  "malloc 16 MB + onednn cache 64": (64, 16), "malloc 2 MB + onednn cache 64": (64, 2)}


def measure(steps: int, onednn_cache: int, malloc_threshold_mb: int) -> dict:
    child = subprocess.run([sys.executable, "-m", "bench.train_memory", "--steps", str(steps),
                            "--onednn-cache", str(onednn_cache), "--malloc-threshold-mb", str(malloc_threshold_mb)],
                           capture_output=True, text=True, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


@app.command()
def main(steps: int = typer.Option(200), rounds: int = typer.Option(2),
         only: list[str] = typer.Option(list(CONFIGURATIONS), help="configurations to run; `neither` always")) -> None:
    unknown = sorted(set(only) - set(CONFIGURATIONS))
    if unknown:
        raise typer.BadParameter(f"unknown configuration(s) {unknown}; expected some of {list(CONFIGURATIONS)}")
    chosen = {name: knobs for name, knobs in CONFIGURATIONS.items() if name in only or name == "neither"}
    results: dict[str, list[dict]] = {name: [] for name in chosen}
    for round_index in range(rounds):
        for name, knobs in chosen.items():
            results[name].append(measure(steps, *knobs))
            print(f"round {round_index + 1} {name}: {results[name][-1]}", flush=True)
    base = results["neither"]
    base_step = sum(r["seconds_per_step"] for r in base) / rounds
    for name, runs in results.items():
        step = sum(r["seconds_per_step"] for r in runs) / rounds
        peak = max(r["peak_rss_gib"] for r in runs)
        print(f"{name:>30}: peak RSS {peak:.2f} GiB, {step:.3f} s/step = {step / base_step:.3f}x of neither")


if __name__ == "__main__":
    app()
