"""Prediction dumps (one Parquet file per task and split) and CS224N submission files.

A dump holds `id`, the unrounded prediction and the predicted label, by task kind: classification
`prob_0`..`prob_<C-1>` and `label` (argmax), binary `prob` and `label` (prob >= 0.5), regression `score`
and `label` (the score). The ensemble reads nothing else.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from mtbert import io
from mtbert.data.tasks import Task
from mtbert.runtime import MissingInputError, UnreadableInputError, UserError

log = logging.getLogger(__name__)


def dump_path(directory: Path | str, task: str, split: str) -> Path:
    return Path(directory) / f"{task}-{split}.parquet"


def submission_path(directory: Path | str, task: Task, split: str) -> Path:
    return Path(directory) / f"{task.submission_file}-{split}-output.csv"


def to_table(task: Task, ids, values: np.ndarray) -> pa.Table:
    columns = {"id": pa.array(list(ids), pa.string())}
    names = task.kind.value_columns()
    for index, name in enumerate(names):
        columns[name] = pa.array(values[:, index] if len(names) > 1 else values, pa.float64())
    columns["label"] = pa.array(task.kind.predicted_labels(values))
    return pa.table(columns)


def values_of(task: Task, table: pa.Table) -> np.ndarray:
    """The unrounded predictions of a dump: (N, C) for classification, (N,) otherwise."""
    names = task.kind.value_columns()
    if len(names) == 1:
        return table.column(names[0]).to_numpy()
    return np.stack([table.column(name).to_numpy() for name in names], axis=1)


def write_dump(directory: Path | str, task: Task, split: str, ids, values: np.ndarray) -> None:
    io.write_parquet(dump_path(directory, task.name, split), to_table(task, ids, values))


def read_dump(directory: Path | str, task: Task, split: str) -> tuple[np.ndarray, np.ndarray]:
    path = dump_path(directory, task.name, split)
    if not path.is_file():
        raise MissingInputError(f"{path} is missing; run `dvc repro` for the predict stage that writes it")
    table = io.read_parquet(path, ("id", *task.kind.value_columns()), "expected a dump `predict` or `train` writes: "
                            "run the stage that writes it again")
    return np.asarray(table.column("id").to_pylist(), dtype=object), values_of(task, table)


def read_aligned(directory: Path, task: Task, split: str, ids: np.ndarray) -> np.ndarray:
    """A dump's predictions in the row order of `ids`; a dump with other ids is an error."""
    dump_ids, values = read_dump(directory, task, split)
    position = {value: index for index, value in enumerate(dump_ids)}
    missing = [i for i in ids if i not in position]
    if missing or len(dump_ids) != len(ids):
        raise UserError(f"{directory}: {task.name}-{split} dump has {len(dump_ids)} ids, expected "
                        f"{len(ids)} matching the dev/test split (missing e.g. {missing[:3]})")
    return values[[position[i] for i in ids]]


def write_submission(directory: Path | str, task: Task, split: str, ids, values: np.ndarray,
                     rejected_ids=()) -> None:
    """The CS224N CSV. A grader wants every id of the raw file, so rows the tokenize stage rejected
    (listed in data/rejects.tsv) get the mean prediction over the split, and are logged."""
    rejected_ids = [i for i in rejected_ids if i not in set(ids)]
    if rejected_ids:
        log.warning("%s-%s: %d rejected row(s) get the split's mean prediction in the submission: %s",
                    task.name, split, len(rejected_ids), ", ".join(rejected_ids))
        values = np.concatenate([values, np.repeat(values.mean(0, keepdims=True), len(rejected_ids), axis=0)])
        ids = [*ids, *rejected_ids]
    frame = pd.DataFrame({"id": list(ids), task.submission_column: task.kind.predicted_labels(values)})
    io.write_text(submission_path(directory, task, split), frame.to_csv(index=False, float_format="%.4f"))


def rejected_ids(rejects_file: Path | str, task: str, split: str) -> list[str]:
    """Ids that tokenize rejected for one task and split (rows with no id cannot be listed)."""
    path = Path(rejects_file)
    if not path.is_file():
        return []
    remedy = "expected the rejects table `tokenize` writes: run `dvc repro tokenize` again"
    try:
        rejects = pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise UnreadableInputError(f"{path}: not a readable TSV table ({' '.join(str(error).split())}); "
                                   f"{remedy}") from error
    missing = [column for column in ("task", "split", "id") if column not in rejects.columns]
    if missing:
        raise UnreadableInputError(f"{path}: has no column {missing[0]!r}; {remedy}")
    chosen = rejects[(rejects["task"] == task) & (rejects["split"] == split) & (rejects["id"] != "")]
    return chosen["id"].drop_duplicates().tolist()
