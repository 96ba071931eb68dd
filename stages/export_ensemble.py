"""Stage `export_ensemble`: the ensemble as one deployable model (mtbert/export/ensemble.py).

Reads metrics/ensemble.json (each task's members, in the ensemble stage's order), the members' trained
folders and the ensemble's dev dumps (data/ensemble/). Writes exports/ensemble/: each member's export
(its graphs for the tasks the ensemble uses it for, fp32 and int8, its tokenizer), a manifest and a model
card, which `mtbert predict --model exports/ensemble` and `mtbert serve --model exports/ensemble` load as
one model; and metrics/export/ensemble.json: the check against the ensemble's dumps, the dev metrics of
the fp32 graphs and of the graphs deployed, each member's engine per task and why, and the latency and
throughput against the first member alone.
"""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from mtbert import io
from mtbert.data.tasks import tasks_from_params
from mtbert.deploy.members import read_members
from mtbert.export.ensemble import export_ensemble
from mtbert.params_file import load_params
from mtbert.runtime import graph_heap_mb, limit_memory_growth, run_app, setup_logging, setup_torch

log = logging.getLogger("export")
app = typer.Typer(add_completion=False)


@app.command()
def main(params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_root: Path = typer.Option(Path("data/tokenized"), help="each member's dev splits: "
                                                                         "<root>/<member>"),
         models_dir: Path = typer.Option(Path("models")),
         ensemble_file: Path = typer.Option(Path("metrics/ensemble.json")),
         dumps_dir: Path = typer.Option(Path("data/ensemble"), help="the ensemble stage's dumps"),
         out_dir: Path = typer.Option(Path("exports/ensemble")),
         metrics_file: Path = typer.Option(Path("metrics/export/ensemble.json"))) -> None:
    setup_logging()
    params = load_params(params_file)
    members = {name for order in read_members(ensemble_file).values() for name in order}
    heap_mb = graph_heap_mb([models_dir / name for name in members], params.runtime.malloc_threshold_mb)
    limit_memory_growth(params.runtime.onednn_cache, heap_mb)
    setup_torch(seed=0, threads=params.runtime.threads)
    report = export_ensemble(ensemble_file, models_dir, dumps_dir, out_dir, tasks_from_params(params.tasks),
                             params.export, tokenized_root, params.runtime.threads)
    io.write_metrics(metrics_file, report)
    log.info("exports/ensemble: dev overall %.4f as deployed (fp32 graphs %.4f)",
             report["dev"]["deployed"]["overall"], report["dev"]["onnx"]["overall"])


if __name__ == "__main__":
    run_app(app)
