"""Prediction dumps (one Parquet file per task and split) and CS224N submission files.

A dump holds `id`, the unrounded prediction and the predicted label: SST `prob_0`..`prob_4` and
`label` (argmax), QQP `prob` and `label` (prob >= 0.5), STS `score` (0-5) and `label` (the score).
The ensemble reads nothing else.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from stages.core import io

log = logging.getLogger(__name__)

SST_CLASSES = 5
# Column names the CS224N grader expects (its STS header really is spelt "Similiarity").
SUBMISSION_COLUMNS = {"sst": "Predicted_Sentiment", "qqp": "Predicted_Is_Paraphrase", "sts": "Predicted_Similiarity"}
SUBMISSION_NAMES = {"sst": "sst", "qqp": "para", "sts": "sts"}


def dump_path(directory: Path | str, task: str, split: str) -> Path:
    return Path(directory) / f"{task}-{split}.parquet"


def submission_path(directory: Path | str, task: str, split: str) -> Path:
    return Path(directory) / f"{SUBMISSION_NAMES[task]}-{split}-output.csv"


def predicted_labels(task: str, values: np.ndarray) -> np.ndarray:
    if task == "sst":
        return values.argmax(-1)
    if task == "qqp":
        return (values >= 0.5).astype(np.int64)
    return values


def to_table(task: str, ids, values: np.ndarray) -> pa.Table:
    columns = {"id": pa.array(list(ids), pa.string())}
    if task == "sst":
        for c in range(SST_CLASSES):
            columns[f"prob_{c}"] = pa.array(values[:, c], pa.float64())
    else:
        columns["prob" if task == "qqp" else "score"] = pa.array(values, pa.float64())
    columns["label"] = pa.array(predicted_labels(task, values))
    return pa.table(columns)


def values_of(task: str, table: pa.Table) -> np.ndarray:
    """The unrounded predictions of a dump: (N, 5) for SST, (N,) otherwise."""
    if task == "sst":
        return np.stack([table.column(f"prob_{c}").to_numpy() for c in range(SST_CLASSES)], axis=1)
    return table.column("prob" if task == "qqp" else "score").to_numpy()


def write_dump(directory: Path | str, task: str, split: str, ids, values: np.ndarray) -> None:
    io.write_parquet(dump_path(directory, task, split), to_table(task, ids, values))


def read_dump(directory: Path | str, task: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    path = dump_path(directory, task, split)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; run `dvc repro` for the predict stage that writes it")
    table = pq.read_table(path)
    return np.asarray(table.column("id").to_pylist(), dtype=object), values_of(task, table)


def write_submission(directory: Path | str, task: str, split: str, ids, values: np.ndarray,
                     rejected_ids=()) -> None:
    """The CS224N CSV. A grader wants every id of the raw file, so rows the tokenize stage rejected
    (listed in data/rejects.tsv) get the mean prediction over the split, and are logged."""
    rejected_ids = [i for i in rejected_ids if i not in set(ids)]
    if rejected_ids:
        log.warning("%s-%s: %d rejected row(s) get the split's mean prediction in the submission: %s",
                    task, split, len(rejected_ids), ", ".join(rejected_ids))
        values = np.concatenate([values, np.repeat(values.mean(0, keepdims=True), len(rejected_ids), axis=0)])
        ids = [*ids, *rejected_ids]
    labels = predicted_labels(task, values)
    frame = pd.DataFrame({"id": list(ids), SUBMISSION_COLUMNS[task]: labels})
    io.write_text(submission_path(directory, task, split), frame.to_csv(index=False, float_format="%.4f"))


def rejected_ids(rejects_file: Path | str, task: str, split: str) -> list[str]:
    """Ids that tokenize rejected for one task and split (rows with no id cannot be listed)."""
    path = Path(rejects_file)
    if not path.is_file():
        return []
    rejects = pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False)
    chosen = rejects[(rejects["task"] == task) & (rejects["split"] == split) & (rejects["id"] != "")]
    return chosen["id"].drop_duplicates().tolist()
