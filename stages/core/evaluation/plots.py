"""Tables behind `dvc plots`: confusion matrices (SST, QQP) and the STS predicted-vs-gold scatter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from stages.core import io
from stages.core.evaluation.predictions import predicted_labels

PLOT_FILES = {"sst": "sst_confusion.csv", "qqp": "qqp_confusion.csv", "sts": "sts_scatter.csv"}


def write_plot_tables(directory: Path | str, task: str, values: np.ndarray, labels: np.ndarray) -> None:
    if task == "sts":
        frame = pd.DataFrame({"gold": labels, "predicted": np.round(values, 4)})
    else:
        frame = pd.DataFrame({"actual": labels.astype(int), "predicted": predicted_labels(task, values)})
    io.write_text(Path(directory) / PLOT_FILES[task], frame.to_csv(index=False))
