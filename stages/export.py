"""Stage `export@<model>`: a trained model as deployable ONNX graphs (mtbert/export/variant.py), for each
name in export.models: a variant (a key of `models:`) or a distilled student (a key of distill.students).

Writes exports/<model>/ (per task an fp32 graph and, with `export.int8`, an int8 one, `tokenizer.json`
and `manifest.json`: tasks, kinds, truncation, cleaning, each task's engine, each file's sha256), which
`mtbert predict --model exports/<model>` and `mtbert serve` run without torch; and
metrics/export/<model>.json: the largest difference from PyTorch on the checked dev rows, the dev metrics
of the fp32 and int8 graphs, their speed on this machine, and each task's engine with the reason.
A student that distill.enabled false left untrained gets outputs saying so.
"""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from mtbert import io, layout
from mtbert.export.variant import export_variant
from mtbert.params_file import load_params, student_params, variant_params
from mtbert.runtime import graph_heap_mb, limit_memory_growth, run_app, setup_logging, setup_torch

log = logging.getLogger("export")
app = typer.Typer(add_completion=False)


def skip(out_dir: Path, metrics_file: Path, name: str) -> None:
    log.info("distill.enabled is false: student %s was not trained, so it is not exported", name)
    with io.atomic_dir(out_dir) as temp:
        (temp / "README.md").write_text(f"# `{name}`: not exported\n\n`distill.enabled` is false in params.yaml, "
                                        "so no student was trained to export (docs/ensembling.md).\n",
                                        encoding="utf-8")
    io.write_metrics(metrics_file, {"enabled": False})


@app.command()
def main(name: str = typer.Option(..., "--model", help="a key of `models:` or of distill.students in params.yaml"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path | None = typer.Option(None, help="its dev splits [default: data/tokenized/<its "
                                                              "variant> (a student's: distill.variant)]"),
         models_dir: Path = typer.Option(Path("models")),
         exports_dir: Path = typer.Option(Path("exports")),
         metrics_dir: Path = typer.Option(Path("metrics/export"))) -> None:
    setup_logging()
    distill = load_params(params_file).distill
    is_student = name in distill.students
    if is_student and not distill.enabled:
        skip(exports_dir / name, metrics_dir / f"{name}.json", name)
        return
    # a student has its variant's params; a variant may override export's keys
    params = student_params(params_file, name) if is_student else variant_params(params_file, name)
    heap_mb = graph_heap_mb([models_dir / name], params.runtime.malloc_threshold_mb)
    limit_memory_growth(params.runtime.onednn_cache, heap_mb)
    setup_torch(seed=0, threads=params.runtime.threads)
    tokenized_dir = layout.tokenized_of(distill.variant if is_student else name, tokenized_dir)
    report = export_variant(models_dir / name, exports_dir / name, params.export, tokenized_dir,
                            params.runtime.threads)
    io.write_metrics(metrics_dir / f"{name}.json", report)
    log.info("%s: default engine %s; dev overall fp32 %.4f%s", name, report["engine"],
             report["dev"]["onnx"]["overall"],
             f", int8 {report['dev']['int8']['overall']:.4f}" if "int8" in report["dev"] else "")


if __name__ == "__main__":
    run_app(app)
