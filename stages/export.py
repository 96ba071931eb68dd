"""Stage `export@<variant>`: the trained variant as deployable ONNX graphs (mtbert/deploy/export.py).

Writes exports/<variant>/ (per task an fp32 graph and, with `export.int8`, an int8 one, `tokenizer.json`
and `manifest.json`: tasks, kinds, truncation, cleaning, the default engine, each file's sha256), which
`mtbert predict --model exports/<variant>` and `mtbert serve` run without torch; and
metrics/export/<variant>.json: the largest difference from PyTorch on the checked dev rows, the dev metrics
of the fp32 and int8 graphs, their speed on this machine, and the default engine with the reason.
"""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from mtbert import io
from mtbert.deploy.export import export_variant
from mtbert.params import variant_params
from mtbert.runtime import limit_memory_growth, run_app, setup_logging, setup_torch

log = logging.getLogger("export")
app = typer.Typer(add_completion=False)


@app.command()
def main(variant: str = typer.Option(..., "--variant", help="a key of `models:` in params.yaml"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized")),
         models_dir: Path = typer.Option(Path("models")),
         exports_dir: Path = typer.Option(Path("exports")),
         metrics_dir: Path = typer.Option(Path("metrics/export"))) -> None:
    setup_logging()
    params = variant_params(params_file, variant)
    limit_memory_growth(params.runtime.onednn_cache, params.runtime.malloc_threshold_mb)
    setup_torch(seed=0, threads=params.runtime.threads)
    report = export_variant(models_dir / variant, exports_dir / variant, params.export, tokenized_dir,
                            params.runtime.threads)
    io.write_metrics(metrics_dir / f"{variant}.json", report)
    log.info("%s: default engine %s; dev overall fp32 %.4f%s", variant, report["engine"],
             report["dev"]["onnx"]["overall"],
             f", int8 {report['dev']['int8']['overall']:.4f}" if "int8" in report["dev"] else "")


if __name__ == "__main__":
    run_app(app)
