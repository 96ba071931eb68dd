"""`mtbert`, the command installed with the package: predictions of a trained model (or the ensemble) on
new text, as JSON lines; the export of a trained variant to ONNX; and an HTTP server.

    mtbert predict --model models/base --task sst "A gorgeous, witty film." "Dull."
    mtbert predict --model exports/ensemble --task qqp --task sts "How do I cook rice?" "How to cook rice?"
    mtbert predict --ensemble metrics/ensemble.json --task sts --input pairs.tsv --output scores.jsonl
    cat pairs.jsonl | mtbert predict --model models/base --task sts --input -
    mtbert export --model models/base --out exports/base
    mtbert serve --model exports/ensemble --port 8000 --workers 2

Texts come as arguments (for pair tasks, consecutive arguments form a pair), or with `--input` as a TSV
file (a header naming the task's text columns, e.g. `sentence` or `sentence1` and `sentence2`, and an
optional `id`) or a JSON-lines file (objects with those keys), `-` for standard input. Each output line
holds the row's id, its texts and every requested task's result (see mtbert/inference.py). An export
(`--model exports/<variant>`, or an ensemble whose members are exports) runs on ONNX Runtime without
importing torch (mtbert/predictors.py); a trained folder on PyTorch. A bad input or model folder is
one line on stderr (`error: ...`) and exit status 1; the output file is written whole or not at all.
"""

from __future__ import annotations

import csv
import dataclasses
import inspect
import io as text_io
import json
import sys
from pathlib import Path

import typer

from mtbert.deploy.serve_config import ServeOption, serve_options
from mtbert.runtime import UserError, run_app

app = typer.Typer(add_completion=False, help="Use the models mtbert trained.")


@app.callback()
def main() -> None:
    """mtbert: use the trained models (`mtbert predict --help`)."""


@app.command()
def predict(texts: list[str] = typer.Argument(None, help="texts; for pair tasks two consecutive ones make a pair"),
            model: Path = typer.Option(None, "--model", help="a trained variant's folder (models/base) or an "
                                                             "export (exports/<model>, for a model in export.models)"),
            ensemble: Path = typer.Option(None, "--ensemble", help="the ensemble's metrics/ensemble.json"),
            models_dir: Path = typer.Option(Path("models"), help="with --ensemble: where its members' folders are "
                                                                 "(exports: their exports)"),
            task: list[str] = typer.Option(..., "--task", help="a task to predict; repeat for several"),
            input_file: str = typer.Option(None, "--input", help="a TSV or JSON-lines file of texts; - for stdin"),
            output: Path = typer.Option(None, "--output", help="write the JSON lines here (default: stdout)"),
            engine: str = typer.Option("auto", help="auto (an export's default graphs, else PyTorch) | onnx "
                                                     "(fp32 graphs) | int8 | torch"),
            batch_size: int = typer.Option(128, min=1, help="texts per forward pass"),
            bf16: bool = typer.Option(False, help="PyTorch only: bf16 autocast, faster on CPUs with bf16 units"),
            threads: int = typer.Option(0, min=0, help="CPU threads; 0 = the engine's default"),
            skip_bad_rows: bool = typer.Option(False, "--skip-bad-rows", help="with --input: predict the rows "
                                               "that pass validation, and list each one skipped (its row number "
                                               "and why) on stderr; default: a bad row refuses the file")) -> None:
    """Predict the requested tasks for every text, one JSON line per input row."""
    from mtbert.predictors import load_predictor

    if (model is None) == (ensemble is None):
        raise CommandInputError("give exactly one of --model (a variant's folder or its export) or --ensemble "
                                "(metrics/ensemble.json)")
    if bool(texts) == (input_file is not None):
        raise CommandInputError("give the texts either as arguments or with --input, not both and not neither")
    if skip_bad_rows and input_file is None:
        raise CommandInputError("--skip-bad-rows is for an --input file; texts given as arguments are all checked")
    predictor = load_predictor(model=model, ensemble=ensemble, models_dir=models_dir, engine=engine,
                               batch_size=batch_size, threads=threads, bf16=bf16)
    columns = text_columns(predictor, task)
    if texts:
        rows = rows_from_arguments(texts, columns)
    else:
        rows = rows_from_file(input_file, columns, skip_bad_rows)
        check = valid_rows if skip_bad_rows else checked_rows
        rows = check(rows, predictor, task, "stdin" if input_file == "-" else input_file)
    results = [{"id": row["id"], **{column: row[column] for column in columns}} for row in rows]
    for name in task:
        values = predictor.predict(name, [tuple(row[c] for c in predictor.tasks[name].text_columns) for row in rows])
        for result, value in zip(results, values, strict=True):
            result[name] = value
    lines = "".join(json.dumps(result, ensure_ascii=False) + "\n" for result in results)
    if output is None:
        sys.stdout.write(lines)
    else:
        from mtbert import io  # here: it imports pyarrow, which printing to stdout does not need

        try:
            io.write_text(output, lines)
        except OSError as error:  # the temporary file beside it, or the folder: name what the user gave
            raise CommandInputError(f"--output {output}: cannot write it ({error.strerror or error})") from None


@app.command()
def export(model: Path = typer.Option(..., "--model", help="a trained variant's folder, e.g. models/base"),
           out: Path = typer.Option(..., "--out", help="the export folder to write, e.g. exports/base"),
           params_file: Path = typer.Option(Path("params.yaml"), help="its `export` section sets the export"),
           tokenized_dir: Path = typer.Option(None, help="the dev splits, tokenized for this model: the check "
                                                         "against PyTorch, the dev metrics [default: "
                                                         "data/tokenized/<the model folder's name>]"),
           metrics: Path = typer.Option(None, "--metrics", help="also write the export's report (JSON) here"),
           int8: bool = typer.Option(None, "--int8/--no-int8", help="int8 graphs too (default: export.int8)"),
           threads: int = typer.Option(None, min=0, help="CPU threads (default: runtime.threads)")) -> None:
    """Export a trained variant to ONNX: per task an fp32 graph (and int8), the tokenizer, a manifest."""
    from mtbert import io, layout
    from mtbert.export.variant import export_variant
    from mtbert.params_file import load_params, with_changes
    from mtbert.predictors import quiet_transformers
    from mtbert.runtime import setup_logging, setup_torch

    setup_logging()
    quiet_transformers()
    params = load_params(params_file)
    options = params.export if int8 is None else with_changes(params.export, int8=int8)
    threads = params.runtime.threads if threads is None else threads
    setup_torch(seed=0, threads=threads)
    report = export_variant(model, out, options, tokenized_dir or layout.tokenized_of(model.name), threads)
    if metrics is not None:
        io.write_metrics(metrics, report)
    print(f"{out}: default engine {report['engine']} ({report['reason']}); `auto` runs "
          + ", ".join(f"{task} on {choice['engine']}" for task, choice in report["task_engines"].items()))


def serve(**values) -> None:
    """Serve the model over HTTP: POST /predict, GET /tasks, /health, /ready, /metrics (docs/inference.md)."""
    from mtbert.deploy.serve_config import from_options
    from mtbert.deploy.server import run_server
    from mtbert.predictors import serving_predictor

    for described in serve_options():
        if described.choices and values[described.keyword] not in described.choices:
            raise CommandInputError(f"--{described.flag} {values[described.keyword]!r}: expected one of "
                                    f"{', '.join(described.choices)}")
    config, listening = from_options(values)
    if (config.model is None) == (config.ensemble is None):
        raise CommandInputError("give exactly one of --model (an export or a trained folder) or --ensemble "
                                "(metrics/ensemble.json)")
    threads = config.threads or worker_threads(listening.workers)
    warning = oversubscription(listening.workers, threads, cpu_count())
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    config = dataclasses.replace(config, threads=threads,
                                 operations=dataclasses.replace(config.operations,
                                                                api_key=config.operations.api_key or None))
    run_server(config, serving_predictor, host=listening.host, port=listening.port, workers=listening.workers,
               grace=listening.grace)


def command_parameters(options: list[ServeOption]) -> inspect.Signature:
    """The command's parameters, one typer option per ServeOption: `mtbert serve --help` is the description."""
    return inspect.Signature([
        inspect.Parameter(described.keyword, inspect.Parameter.KEYWORD_ONLY, annotation=described.type,
                          default=typer.Option(described.default, f"--{described.flag}", help=described.help,
                                               min=described.min, max=described.max,
                                               envvar=described.envvar or None, show_envvar=bool(described.envvar)))
        for described in options])


serve.__signature__ = command_parameters(serve_options())
app.command()(serve)


def cpu_count() -> int:
    """The cores this process may run on."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_threads(workers: int) -> int:
    """The machine's cores shared among the server's workers, at least one each."""
    return max(1, cpu_count() // workers)


def oversubscription(workers: int, threads: int, cores: int) -> str | None:
    """What is wrong with a layout that asks for more threads than there are cores, or None."""
    if workers * threads <= cores:
        return None
    return (f"{workers} worker(s) x {threads} thread(s) = {workers * threads} threads on {cores} core(s): they "
            f"slow each other down; use --workers 1 --threads {cores} (docs/serving.md, Workers and threads)")


class CommandInputError(UserError, ValueError):
    """A command line or input file the command cannot read (the texts themselves: inference.InputError)."""


def text_columns(predictor, tasks: list[str]) -> list[str]:
    """The text columns the requested tasks read; they must all read the same shape of input."""
    unknown = [name for name in tasks if name not in predictor.tasks]
    if unknown:
        raise CommandInputError(f"unknown task {unknown[0]!r}; the model predicts {', '.join(predictor.tasks)}")
    shapes = {len(predictor.tasks[name].text_columns) for name in tasks}
    if len(shapes) > 1:
        raise CommandInputError(f"tasks {', '.join(tasks)} mix single sentences and pairs; "
                                "predict them in separate calls")
    return list(dict.fromkeys(c for name in tasks for c in predictor.tasks[name].text_columns))


def rows_from_arguments(texts: list[str], columns: list[str]) -> list[dict]:
    if len(texts) % len(columns):
        raise CommandInputError(f"{len(texts)} text arguments do not make pairs; "
                                f"give {' and '.join(columns)} for each row")
    width = len(columns)
    return [{"id": str(index), **dict(zip(columns, texts[start:start + width], strict=True))}
            for index, start in enumerate(range(0, len(texts), width))]


def rows_from_file(name: str, columns: list[str], keep_bad: bool = False) -> list[dict]:
    """Rows of a TSV or JSON-lines file (JSON lines when its first character is `{`), each with an id and its
    row number. A row without a column is an error, or with `keep_bad` left for `valid_rows` to report."""
    label = "stdin" if name == "-" else name
    data = sys.stdin.buffer.read() if name == "-" else read_bytes(Path(name))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CommandInputError(f"{label}: not UTF-8 text (byte 0x{data[error.start]:02x} "
                                f"at offset {error.start})") from None
    rows = json_rows(text, label) if text.lstrip().startswith("{") else tsv_rows(text, label)
    if not rows:
        raise CommandInputError(f"{label}: no rows; expected {' and '.join(columns)} per row")
    for index, row in enumerate(rows, start=1):
        missing = [column for column in columns if column not in row or row[column] is None]
        if missing and not keep_bad:
            raise CommandInputError(f"{label} row {index}: no {missing[0]!r}; expected {' and '.join(columns)}")
        row["id"], row[ROW_NUMBER] = str(row.get("id") or index), index
    return rows


ROW_NUMBER = "_row"  # a file row's number, for the report of a skipped row; not an output column


def row_problem(row: dict, predictor, tasks: list[str]) -> str | None:
    """Why a file's row cannot be predicted for every requested task (a column missing, not text, empty or
    invisible), or None."""
    from mtbert.inputs import InputError, check_texts

    for name in tasks:
        columns = predictor.tasks[name].text_columns
        missing = [column for column in columns if row.get(column) is None]
        if missing:
            return f"no {missing[0]!r}"
        try:
            check_texts(predictor.tasks[name], [tuple(row[column] for column in columns)], "")
        except InputError as error:
            return str(error).split(": ", 1)[1]  # without check_texts' own "row 1" prefix
    return None


def checked_rows(rows: list[dict], predictor, tasks: list[str], label: str) -> list[dict]:
    """The rows, if every requested task can read each; else the first bad one, refused in one line naming
    the file and the row."""
    for row in rows:
        reason = row_problem(row, predictor, tasks)
        if reason is not None:
            raise CommandInputError(f"{label} row {row[ROW_NUMBER]} (id {row['id']}): {reason}; or pass "
                                    "--skip-bad-rows to predict the others")
    return rows


def valid_rows(rows: list[dict], predictor, tasks: list[str], label: str) -> list[dict]:
    """The rows every requested task can read; each other one reported on stderr in one line (its row
    number, id and why), as `tokenize` reports the raw files' rejects, then how many were skipped."""
    kept = []
    for row in rows:
        reason = row_problem(row, predictor, tasks)
        if reason is None:
            kept.append(row)
        else:
            print(f"{label} row {row[ROW_NUMBER]} (id {row['id']}): skipped: {reason}", file=sys.stderr)
    if len(kept) < len(rows):
        print(f"{label}: skipped {len(rows) - len(kept)} of {len(rows)} rows", file=sys.stderr)
    if not kept:
        raise CommandInputError(f"{label}: every row was skipped; nothing to predict")
    return kept


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise CommandInputError(f"{path}: cannot read it ({error.strerror})") from None


def json_rows(text: str, label: str) -> list[dict]:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise CommandInputError(f"{label} line {number}: not a JSON object")
        rows.append(row)
    return rows


def tsv_rows(text: str, label: str) -> list[dict]:
    reader = csv.DictReader(text_io.StringIO(text), delimiter="\t")
    rows = []
    for row in reader:
        if None in row:
            raise CommandInputError(f"{label} line {reader.line_num}: more fields than the header has")
        rows.append(row)
    return rows


def entry() -> None:
    """The console script."""
    run_app(app)


if __name__ == "__main__":
    entry()
