"""Stage `transfer`: the transfer set the ensemble labels for its students (mtbert/data/transfer.py).

Reads the tokenized training splits' text and the encoder the members start from (models/pretrained, for the
neighbour pairs), and writes data/transfer/<task>-transfer.parquet, tokenized as `tokenize` writes a split
(no labels; a `source` column says how each row was made), and metrics/transfer.json (rows by source). The
members' `predict` dumps these rows, and the students learn the ensemble's average of them (stage `distill`).
With distill.enabled false it writes empty tables, in a second.
"""

from __future__ import annotations

import collections
import functools
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import typer

from mtbert import io, layout
from mtbert.data.batches import tokenized_input
from mtbert.data.tasks import tasks_from_params, tokenized_path
from mtbert.data.tokenization import encode_rows
from mtbert.data.transfer import Embed, TrainingText, transfer_rows
from mtbert.model.backbone import load_encoder, load_tokenizer, starting_point
from mtbert.model.pooling import mean_pooled_embeddings
from mtbert.params_file import load_params, variant_params
from mtbert.runtime import run_app, setup_logging, setup_torch, use_bf16

log = logging.getLogger("transfer")
app = typer.Typer(add_completion=False)
SPLIT = "transfer"


def remembered(embed: Embed) -> Embed:
    """embed, run once per pool of sentences: with pairs_from all, every pair task draws from the same pool."""
    done: dict[tuple[str, ...], np.ndarray] = {}

    def cached(texts: list[str]) -> np.ndarray:
        key = tuple(texts)
        if key not in done:
            done[key] = embed(texts)
        return done[key]
    return cached


@app.command()
def main(params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path | None = typer.Option(None, help="[default: data/tokenized/<distill.variant>]"),
         pretrained_dir: Path | None = typer.Option(None, help="the encoder the student starts from "
                                                               "[default: models/pretrained/<distill.variant>]"),
         out_dir: Path = typer.Option(Path("data/transfer")),
         metrics_file: Path = typer.Option(Path("metrics/transfer.json"))) -> None:
    setup_logging()
    distill = load_params(params_file).distill
    params = variant_params(params_file, distill.variant)  # the student's encoder and its tokens
    tokenized_dir = layout.tokenized_of(distill.variant, tokenized_dir)
    pretrained_dir = layout.pretrained_of(distill.variant, pretrained_dir)
    transfer = distill.transfer
    tasks = tasks_from_params(params.tasks)
    device = setup_torch(seed=0, threads=params.runtime.threads)
    start = starting_point(params.model.name, pretrained_dir)
    tokenizer = load_tokenizer(start)
    training = {name: TrainingText.from_table(task, io.read_parquet(
        tokenized_input(tokenized_dir, name, "train"), ("id", *task.text_columns),
        "expected a split `tokenize` writes: run `dvc repro tokenize` again").to_pandas())
        for name, task in tasks.items()}
    needs_neighbours = params.distill.enabled and transfer.neighbours > 0 and any(
        task.is_pair and transfer.rows.get(name, 0) for name, task in tasks.items())
    embed = remembered(functools.partial(mean_pooled_embeddings, load_encoder(start).to(device), tokenizer,
                                         max_length=params.tokenize.max_length,
                                         bf16=use_bf16(params.predict.bf16, device))) if needs_neighbours else None
    report: dict = {"enabled": params.distill.enabled}
    with io.atomic_dir(out_dir) as temp:
        for name, task in tasks.items():
            wanted = transfer.rows.get(name, 0) if params.distill.enabled else 0
            rows = transfer_rows(task, training, transfer, wanted, embed)
            table, _ = encode_rows(tokenizer, rows, task, max_length=params.tokenize.max_length,
                                   batch_size=params.tokenize.batch_size, label=f"{name}-{SPLIT}" if wanted else "")
            table = table.append_column("source", pa.array(rows["source"].tolist(), pa.string()))
            io.write_parquet(tokenized_path(temp, name, SPLIT), table)
            report[name] = {"rows": len(rows), "sources": dict(collections.Counter(rows["source"]))}
            log.info("%s: %d transfer rows %s", name, len(rows), report[name]["sources"])
    io.write_metrics(metrics_file, report)


if __name__ == "__main__":
    run_app(app)
