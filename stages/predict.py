"""Stage `predict@<variant>`: dev and test prediction dumps, dev metrics, CS224N submission files.

Writes data/predictions/<variant>/<task>-<split>.parquet (unrounded predictions), the CS224N CSVs
beside them and metrics/<variant>.json. The tasks are the ones the model was trained on (saved in its
folder); each task runs on the snapshot of the epoch it kept (see mtbert/model/saved.py). With
distill.enabled it dumps the training split too: the ensemble's predictions of it teach the students
(stage `distill`, mtbert/evaluation/teacher.py), and the transfer set (stage `transfer`) as split `transfer`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from mtbert import io
from mtbert.evaluation.evaluate import write_predictions
from mtbert.evaluation.metrics import headline_summary
from mtbert.model.saved import load_model
from mtbert.params_file import load_params
from mtbert.runtime import limit_memory_growth, run_app, setup_logging, setup_torch, use_bf16

log = logging.getLogger("predict")
app = typer.Typer(add_completion=False)


@app.command()
def main(variant: str = typer.Option(..., "--variant", help="a key of `models:` in params.yaml"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized")),
         rejects_file: Path = typer.Option(Path("data/rejects.tsv")),
         models_dir: Path = typer.Option(Path("models")),
         transfer_dir: Path = typer.Option(Path("data/transfer"), help="the transfer set (with distill.enabled)"),
         predictions_dir: Path = typer.Option(Path("data/predictions")),
         metrics_dir: Path = typer.Option(Path("metrics"))) -> None:
    setup_logging()
    all_params = load_params(params_file)
    params = all_params.predict
    limit_memory_growth(all_params.runtime.onednn_cache, all_params.runtime.malloc_threshold_mb)
    device = setup_torch(seed=0, threads=all_params.runtime.threads)
    bf16 = use_bf16(params.bf16, device)
    model, _ = load_model(models_dir / variant)
    model.to(device)
    out_dir = predictions_dir / variant
    splits = ("dev", "test", "train", "transfer") if all_params.distill.enabled else ("dev", "test")
    batching = all_params.runtime.split_batches(device.type, params.batch_size)
    dev_metrics = write_predictions(model, splits, tokenized_dir, rejects_file, out_dir, device=device, bf16=bf16,
                                    transfer_dir=transfer_dir, **batching)
    io.write_metrics(metrics_dir / f"{variant}.json", dev_metrics)
    log.info("%s dev: overall %.4f  %s", variant, dev_metrics["overall"], headline_summary(dev_metrics, model.tasks))


if __name__ == "__main__":
    run_app(app)
