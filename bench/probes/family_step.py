"""A training step of another backbone (by default all-mpnet-base-v2) against the default's, in the same run.

    python -m bench.probes.family_step [--other sentence-transformers/all-mpnet-base-v2] [--steps 16]

Both drive the `train` stage's own run of the default variant (bench/common.py's `scratch_run`), one with
`model.name` changed: the same params, the same sampler's steps over the same rows, each encoder reading
its own tokenization of them (the other backbone's is written to a temporary folder by `tokenize`). A step
is forward, backward and the optimiser update; the two alternate in blocks, so drift in the machine's speed
hits both alike. Needs data/raw and data/tokenized/base (`dvc repro tokenize@base`), and the other backbone
(all-mpnet-base-v2: `make mpnet`).
"""

from __future__ import annotations

import functools
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import typer
import yaml

from bench.common import alternate_blocks, cpu_name, scratch_run, timed_steps
from mtbert import io
from mtbert.params_file import read_yaml, variant_params
from mtbert.runtime import setup_logging
from mtbert.training.build import schedule

app = typer.Typer(add_completion=False)


def tokenize_for(other: str, params_file: Path, scratch: Path) -> Path:
    """The tasks tokenized by `other`'s tokenizer, by the `tokenize` stage, under `scratch`."""
    params = read_yaml(params_file)
    params["model"]["name"] = other
    changed = scratch / "params.yaml"
    changed.write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run([sys.executable, "-m", "stages.tokenize", "--params-file", str(changed),
                    "--out-dir", str(scratch / "tokenized"), "--rejects-file", str(scratch / "rejects.tsv"),
                    "--metrics-file", str(scratch / "data.json")], check=True)
    return changed


@app.command()
def main(other: str = typer.Option("sentence-transformers/all-mpnet-base-v2", help="the backbone to compare"),
         steps: int = typer.Option(16, help="timed steps per backbone"),
         block: int = typer.Option(2, help="steps per block; the backbones alternate block by block"),
         variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized/base")),
         json_out: Path = typer.Option(None, help="also write the figures here")) -> None:
    setup_logging()
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        other_params_file = tokenize_for(other, params_file, scratch)
        runs = {"default": scratch_run(variant_params(params_file, variant), variant, tokenized_dir,
                                       scratch / "default"),
                "other": scratch_run(variant_params(other_params_file, variant), variant, scratch / "tokenized",
                                     scratch / "other")}
        for run, _ in runs.values():
            run.model.train()
        arms = {name: functools.partial(timed_steps, run, progress) for name, (run, progress) in runs.items()}
        times = alternate_blocks(arms, schedule(runs["default"][0], 0)[: block + steps], block)
        names = {name: run.params.model.name for name, (run, _) in runs.items()}
        precision = {name: "bf16" if run.bf16 else "fp32" for name, (run, _) in runs.items()}
    report(times, names, precision, json_out)


def report(times: dict[str, list[float]], names: dict[str, str], precision: dict[str, str],
           json_out: Path | None) -> None:
    means = {name: statistics.fmean(t) for name, t in times.items()}
    figures = {"cpu": cpu_name(), "timed_steps": len(times["default"]),
               **{name: {"backbone": names[name], "precision": precision[name],
                         "mean_step_seconds": round(means[name], 4),
                         "median_step_seconds": round(statistics.median(times[name]), 4)} for name in times},
               "other_over_default": round(means["other"] / means["default"], 3)}
    print(f"{names['default']} ({precision['default']}): {means['default']:.3f} s a step; {names['other']} "
          f"({precision['other']}): {means['other']:.3f} s a step; {figures['other_over_default']:.2f}x "
          f"(means over the same {len(times['default'])} steps' rows, on {figures['cpu']})")
    if json_out is not None:
        io.write_json(json_out, figures)


if __name__ == "__main__":
    app()
