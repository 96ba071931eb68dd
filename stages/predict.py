"""Stage `predict@<variant>`: dev and test prediction dumps, dev metrics, CS224N submission files.

Writes data/predictions/<variant>/<task>-<split>.parquet (unrounded predictions), the CS224N CSVs
beside them and metrics/<variant>.json. The tasks are the ones the model was trained on (saved in its
folder); each task runs on the snapshot of the epoch it kept (see mtbert/model/saved.py). With
distill.enabled it dumps the training split too: the ensemble's predictions of it teach the students
(stage `distill`, mtbert/evaluation/teacher.py), and the transfer set (stage `transfer`) as split `transfer`,
tokenized again with the variant's own tokenizer (`transfer` tokenized it for the student's encoder).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import typer

from mtbert import io, layout
from mtbert.data.batches import tokenized_input
from mtbert.data.tasks import Task, tokenized_path
from mtbert.data.tokenization import retokenized
from mtbert.evaluation.evaluate import write_predictions
from mtbert.evaluation.metrics import headline_summary
from mtbert.model.backbone import load_tokenizer
from mtbert.model.saved import load_model, tokenizer_dir
from mtbert.params_file import load_params
from mtbert.runtime import limit_memory_growth, run_app, setup_logging, setup_torch, use_bf16

log = logging.getLogger("predict")
app = typer.Typer(add_completion=False)


@app.command()
def main(variant: str = typer.Option(..., "--variant", help="a key of `models:` in params.yaml"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path | None = typer.Option(None, help="[default: data/tokenized/<variant>]"),
         rejects_file: Path | None = typer.Option(None, help="[default: rejects.tsv in the tokenized folder]"),
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
    model, config = load_model(models_dir / variant)
    model.to(device)
    out_dir = predictions_dir / variant
    splits = ("dev", "test", "train", "transfer") if all_params.distill.enabled else ("dev", "test")
    batching = all_params.runtime.split_batches(device.type, params.batch_size)
    tokenized_dir = layout.tokenized_of(variant, tokenized_dir)
    rejects_file = layout.rejects_of(tokenized_dir, rejects_file)
    with tempfile.TemporaryDirectory() as scratch:
        if "transfer" in splits:
            transfer_dir = in_own_tokens(transfer_dir, Path(scratch), models_dir / variant, config, model.tasks,
                                         all_params.tokenize.batch_size)
        dev_metrics = write_predictions(model, splits, tokenized_dir, rejects_file, out_dir, device=device,
                                        bf16=bf16, transfer_dir=transfer_dir, **batching)
    io.write_metrics(metrics_dir / f"{variant}.json", dev_metrics)
    log.info("%s dev: overall %.4f  %s", variant, dev_metrics["overall"], headline_summary(dev_metrics, model.tasks))


def in_own_tokens(transfer_dir: Path, out_dir: Path, model_dir: Path, config: dict, tasks: dict[str, Task],
                  batch_size: int) -> Path:
    """The transfer set in the model's own tokens, written to out_dir: a member may have another encoder
    than the student's, whose tokens `transfer` wrote."""
    tokenizer = load_tokenizer(str(tokenizer_dir(model_dir, config)))
    for name, task in tasks.items():
        table = io.read_parquet(tokenized_input(transfer_dir, name, "transfer"), ("id", *task.text_columns),
                                "expected the transfer set `transfer` writes: run `dvc repro transfer` again")
        io.write_parquet(tokenized_path(out_dir, name, "transfer"),
                         retokenized(table, tokenizer, task, max_length=config["params"]["tokenize"]["max_length"],
                                     batch_size=batch_size))
    return out_dir


if __name__ == "__main__":
    run_app(app)
