"""What a refactoring of the training step must leave unchanged, to the bit: the weights after N steps.

    python -m bench.probes.step_hashes [--steps 30] [--json-out hashes.json]

For each of three runs of the default variant, the `train` stage's own run (bench/common.py's
`scratch_run`) takes the first N steps of its first epoch through the loop's step, then every weight of the
model and of its moving average is hashed (sha256 of the raw bytes, in state-dict order):
- default: params.yaml as it is;
- pcgrad: `train.sampler: joint`, `train.gradient: pcgrad`;
- smart: `smart.lambda: 1`, `smart.mu: 1` (the adversarial term and the Bregman teacher).
Run it before and after a change that should compute the same thing, on the same machine and data: the
hashes must be equal. Needs data/tokenized/base (`dvc repro tokenize@base`).
"""

from __future__ import annotations

import copy
import hashlib
import tempfile
from pathlib import Path

import torch
import typer

from bench.common import cpu_name, scratch_run
from mtbert import io
from mtbert.params_file import read_yaml, variant_params
from mtbert.runtime import setup_logging
from mtbert.training.build import schedule
from mtbert.training.step import step

app = typer.Typer(add_completion=False)

CHANGES = {"default": {},
           "pcgrad": {"train": {"sampler": "joint", "gradient": "pcgrad"}},
           "smart": {"smart": {"lambda": 1.0, "mu": 1.0}}}


def changed(raw: dict, changes: dict) -> dict:
    raw = copy.deepcopy(raw)
    for section, values in changes.items():
        raw[section].update(values)
    return raw


def weights_hash(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def hashes_after(params, variant: str, tokenized: Path, steps: int) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as scratch:
        run, progress = scratch_run(params, variant, tokenized, Path(scratch))
        run.model.train()
        for tasks in schedule(run, 0)[:steps]:
            step(run, progress, tasks, ends_update=(progress.step_in_epoch + 1) % run.train.grad_accum == 0)
            progress.step_in_epoch += 1
        run.finite.check()
        return {"model": weights_hash(run.model), "average": weights_hash(run.average.model)}


@app.command()
def main(steps: int = typer.Option(30), variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized/base")),
         json_out: Path = typer.Option(None, help="also write the hashes here")) -> None:
    setup_logging()
    raw = read_yaml(params_file)
    result = {"cpu": cpu_name(), "steps": steps}
    for name, changes in CHANGES.items():
        result[name] = hashes_after(variant_params(changed(raw, changes), variant), variant, tokenized_dir, steps)
        print(f"{name}: model {result[name]['model']}, average {result[name]['average']}", flush=True)
    if json_out is not None:
        io.write_json(json_out, result)


if __name__ == "__main__":
    app()
