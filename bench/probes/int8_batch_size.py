"""Does int8's dev quality depend on the batch size? Dynamic int8 gives a batch's activations one scale, taken
from the whole batch, so the export's choice (made at `export.batch_size`) may not hold for the batches a
server runs (one text alone, or up to `--max-batch` texts of different requests).

    python -m bench.probes.int8_batch_size --export exports/ensemble --tokenized-root data/tokenized \
        [--batch-size 1 --batch-size 8 ...] [--threads 2]

For each member of an ensemble's export (or a single export, `--tokenized-root` then its own tokenized
folder's parent and `--name` its variant), each task it serves and each batch size: the dev headline of its
fp32 graph and of its int8 graph (the one the export wrote: fully quantized, or with its outlier-prone
products in fp32), and int8's drop. The engine's own batching (length-sorted rows, each batch padded to its
longest) at each size. Prints one JSON line per member and task, then the table.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from mtbert.data.batches import load_split
from mtbert.data.tasks import tasks_from_params
from mtbert.deploy.engine import OnnxPredictor
from mtbert.evaluation.metrics import task_metrics
from mtbert.export.variant import token_lists
from mtbert.integrity import read_manifest
from mtbert.params_file import load_params

app = typer.Typer(add_completion=False)


def members_of(export: Path, name: str | None) -> dict[str, Path]:
    """member name -> its export folder: an ensemble's members, or the single export itself as `name`."""
    manifest = read_manifest(export)
    if "members" in manifest:
        return {member: export / member for member in sorted({m for order in manifest["members"].values()
                                                              for m in order})}
    return {name or export.name: export}


def headline_by_batch(folder: Path, task, split, batch_sizes: list[int], threads: int) -> dict:
    """{engine: {batch size: the task's dev headline}} for the member's fp32 and int8 graphs."""
    figures: dict = {}
    for engine in ("onnx", "int8"):
        figures[engine] = {}
        for batch_size in batch_sizes:
            predictor = OnnxPredictor.load(folder, engine=engine, batch_size=batch_size, threads=threads)
            values = predictor.values_of_tokens(task.name, token_lists(split, predictor.tasks[task.name].encoding))
            figures[engine][batch_size] = round(task_metrics(task, values, split.labels)[task.headline], 6)
            predictor.release(task.name)
    return figures


@app.command()
def main(export: Path = typer.Option(Path("exports/ensemble")),
         tokenized_root: Path = typer.Option(Path("data/tokenized"), help="holds <member>/ tokenized dev splits"),
         name: str | None = typer.Option(None, help="a single export's variant (default: the folder's name)"),
         params_file: Path = typer.Option(Path("params.yaml")),
         batch_size: list[int] = typer.Option([1, 8, 32, 128]),
         threads: int = typer.Option(2)) -> None:
    tasks = tasks_from_params(load_params(params_file).tasks)
    rows = []
    for member, folder in members_of(export, name).items():
        for task_name in read_manifest(folder)["tasks"]:
            task = tasks[task_name]
            split = load_split(tokenized_root / member, task, "dev")
            figures = headline_by_batch(folder, task, split, batch_size, threads)
            drops = {size: round(figures["onnx"][size] - figures["int8"][size], 6) for size in batch_size}
            row = {"member": member, "task": task_name, "headline": task.headline, **figures, "int8_drop": drops}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| member | task | " + " | ".join(f"int8 drop at {size}" for size in batch_size) + " |")
    print("|---|---|" + "---|" * len(batch_size))
    for row in rows:
        print(f"| {row['member']} | {row['task']} | "
              + " | ".join(f"{row['int8_drop'][size]:+.4f}" for size in batch_size) + " |")


if __name__ == "__main__":
    app()
