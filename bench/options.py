"""The command-line options the deployment figures share (bench/deploy.py, bench/side_by_side.py)."""

from pathlib import Path

import typer

TOKENIZED_DIR = typer.Option(Path("data/tokenized/base"), help="dev texts from this variant's folder")
TEXTS_PER_TASK = typer.Option(1000, min=1, help="dev rows per task for the batched figure")
SINGLE_CALLS = typer.Option(200, min=1, help="one-text calls per engine")
ROUNDS = typer.Option(2, min=1, help="batched rounds per engine")
