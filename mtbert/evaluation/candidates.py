"""The ensemble's candidates: each variant's prediction dumps (as `predict` made them), and with
`ensemble.snapshots` every other epoch's snapshot dumps that `train` wrote (`<variant>@epoch-<E>`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mtbert import io
from mtbert.data.tasks import Task
from mtbert.evaluation.predictions import dump_path, read_aligned
from mtbert.runtime import MissingInputError, UnreadableInputError


def candidates(predictions_dir: Path, snapshots_dir: Path, variants: list[str], task: Task, split: str,
               ids: np.ndarray, snapshots: bool) -> dict[str, np.ndarray]:
    """Each variant's predictions, and with `snapshots` every other epoch's, in the row order of `ids`."""
    found = {name: read_aligned(predictions_dir / name, task, split, ids) for name in variants}
    if snapshots:
        for name in variants:
            chosen = chosen_epoch(snapshots_dir / name, task)
            for folder in epoch_folders(snapshots_dir / name):
                if folder.name != f"epoch-{chosen}":  # that one is the variant's own dump
                    found[f"{name}@{folder.name}"] = read_aligned(folder, task, split, ids)
    return found


def require_test_snapshots(snapshots_dir: Path, variants: list[str], tasks: list[Task]) -> None:
    """`train` predicts test at an epoch's end only with train.snapshot_test: before any work, say so rather
    than stop at the first missing dump."""
    for name in variants:
        for folder in epoch_folders(snapshots_dir / name):
            for task in tasks:
                path = dump_path(folder, task.name, "test")
                if not path.is_file():
                    raise MissingInputError(f"{path} is missing: ensemble.snapshots: true averages every epoch's "
                                            "test predictions, which train writes with train.snapshot_test: true "
                                            "(set it, `dvc repro`)")


def epoch_folders(directory: Path) -> list[Path]:
    """A variant's per-epoch snapshot folders (`epoch-<E>`), in order."""
    return sorted(path for path in directory.glob("epoch-*") if path.is_dir())


def chosen_epoch(directory: Path, task: Task) -> int:
    path = directory / "chosen.json"
    if not path.is_file():
        raise MissingInputError(f"{path} is missing; run `dvc repro` for the train stage that writes it")
    chosen = io.read_json(path, "expected the epochs `train` chose: run `dvc repro` for that train stage again")
    if not isinstance(chosen, dict) or not isinstance(chosen.get(task.name), int):
        raise UnreadableInputError(f"{path}: names no epoch for task {task.name!r}; run `dvc repro` for the "
                                   "train stage that writes it again")
    return chosen[task.name]
