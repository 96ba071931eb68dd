"""Stage `tokenize`: validate the raw TSV files and write one token-id Parquet file per task and split.

`tokenize@<variant>` tokenizes with the variant's encoder (`model.name`) into data/tokenized/<variant>/.
Rejected rows go to rejects.tsv there, with their reasons; counts go to metrics/data/<variant>.json. The
stage fails if any file rejects more than data.max_reject_fraction of its rows.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import typer

from mtbert import io, layout
from mtbert.data.rawdata import REJECT_COLUMNS, REJECT_REASONS, ParsedSplit, RawDataError, read_split
from mtbert.data.tasks import SPLITS, tasks_from_params, tokenized_path
from mtbert.data.tokenization import encode_rows
from mtbert.model.backbone import check_max_length, load_tokenizer
from mtbert.params_file import load_params, variant_params
from mtbert.runtime import run_app, setup_logging

log = logging.getLogger("tokenize")
app = typer.Typer(add_completion=False)


@app.command()
def main(variant: str | None = typer.Option(None, "--variant", help="a key of `models:`: its encoder's tokens "
                                                                     "[default: every variant; with --out-dir: "
                                                                     "the shared sections]"),
         params_file: Path = typer.Option(Path("params.yaml"), help="params file to read"),
         out_dir: Path | None = typer.Option(None, help="Parquet output folder [default: data/tokenized/<variant>]"),
         rejects_file: Path | None = typer.Option(None, help="rejected rows with reasons [default: rejects.tsv "
                                                             "in the output folder]"),
         metrics_file: Path | None = typer.Option(None, help="data statistics [default: metrics/data/<variant>.json]"),
         ) -> None:
    setup_logging()
    if variant is None and out_dir is None:  # by hand, or a runner without DVC: every variant's folder
        for name in load_params(params_file).models:
            tokenize(params_file, name, None, None, None)
        return
    tokenize(params_file, variant, out_dir, rejects_file, metrics_file)


def tokenize(params_file: Path, variant: str | None, out_dir: Path | None, rejects_file: Path | None,
             metrics_file: Path | None) -> None:
    """One variant's tokenized folder (or, with no variant, the shared sections' in `out_dir`)."""
    params = variant_params(params_file, variant) if variant else load_params(params_file)
    out_dir = layout.tokenized_of(variant, out_dir)
    rejects_file = layout.rejects_of(out_dir, rejects_file)
    metrics_file = layout.of_variant(layout.DATA_METRICS, variant, metrics_file)
    tasks = tasks_from_params(params.tasks)
    check_max_length(params.model.name, "tokenize.max_length", params.tokenize.max_length)
    tokenizer = load_tokenizer(params.model.name)
    report: dict = {"tokenizer": params.model.name, "max_length": params.tokenize.max_length}
    all_rejects = []
    for task in tasks.values():
        report[task.name] = {}
        for split in SPLITS:
            parsed = read_split(task.raw_path(params.data.raw_dir, split), task, split,
                                unescape_ptb=task.name in params.data.unescape_ptb)
            table, stats = encode_rows(tokenizer, parsed.kept, task,
                                       max_length=params.tokenize.max_length,
                                       batch_size=params.tokenize.batch_size,
                                       label=f"{task.name}-{split}")
            io.write_parquet(tokenized_path(out_dir, task.name, split), table)
            report[task.name][split] = split_report(parsed, stats)
            all_rejects.append(parsed.rejects)
            log.info("%s-%s: %d rows read, %d kept, %d rejected, %d truncated", task.name, split,
                     parsed.rows_read, len(parsed.kept), len(parsed.rejects), stats.truncated)
    rejects = pd.concat(all_rejects, ignore_index=True)[REJECT_COLUMNS]
    io.write_text(rejects_file, rejects.to_csv(sep="\t", index=False))
    io.write_metrics(metrics_file, report)
    check_reject_fractions(report, list(tasks), params.data.max_reject_fraction, rejects_file)


def split_report(parsed: ParsedSplit, stats) -> dict:
    counts = parsed.rejects["reason"].value_counts()
    report = {
        "rows_read": parsed.rows_read,
        "rows_kept": len(parsed.kept),
        "rejected": {reason: int(counts.get(reason, 0)) for reason in REJECT_REASONS},
        "truncated": stats.truncated,
    }
    if parsed.task.is_pair:
        report["truncated_sentences"] = stats.truncated_sentences
    if "label" in parsed.kept:
        report["labels"] = parsed.task.kind.label_distribution(parsed.kept["label"])
    return report


def check_reject_fractions(report: dict, task_names: list[str], max_fraction: float, rejects_file: Path) -> None:
    for task in task_names:
        for split in SPLITS:
            entry = report[task][split]
            rejected = entry["rows_read"] - entry["rows_kept"]
            if entry["rows_read"] and rejected / entry["rows_read"] > max_fraction:
                raise RawDataError(
                    f"{task}-{split}: {rejected} of {entry['rows_read']} rows rejected, more than "
                    f"data.max_reject_fraction={max_fraction}; see {rejects_file}")


if __name__ == "__main__":
    run_app(app)
