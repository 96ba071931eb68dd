"""Tables behind `dvc plots`, by task kind: a confusion matrix (classification, binary) or a
predicted-vs-gold scatter (regression), as data/plots/<model>/<plot>/<task>.csv."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mtbert import io
from mtbert.data.tasks import Task


def plot_path(directory: Path | str, task: Task) -> Path:
    return Path(directory) / task.kind.plot / f"{task.name}.csv"


def write_plot_tables(directory: Path | str, task: Task, values: np.ndarray, labels: np.ndarray) -> None:
    io.write_text(plot_path(directory, task), task.kind.plot_table(values, labels).to_csv(index=False))
