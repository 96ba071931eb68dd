"""Tasks as declared in params.yaml (`tasks:`): raw files, columns, kind, headline metric, submission file.

A `Task` is built from its declaration by `tasks_from_params`; everything task-specific the pipeline
does goes through `task.kind` (mtbert/data/kinds.py), so a new task is a params entry and its files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mtbert.data.kinds import Binary, Classification, Kind, Regression

SPLITS = ("train", "dev", "test")


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    file_prefix: str
    split_files: dict[str, str]  # split -> the file name's suffix: <prefix>-<suffix>.csv
    text_columns: tuple[str, ...]
    label_column: str
    kind: Kind
    headline: str  # the metric that ranks models and enters the overall score
    submission_file: str  # <submission_file>-<split>-output.csv
    submission_column: str

    @property
    def is_pair(self) -> bool:
        return len(self.text_columns) == 2

    def raw_path(self, raw_dir: Path | str, split: str) -> Path:
        return Path(raw_dir) / f"{self.file_prefix}-{self.split_files[split]}.csv"

    def is_labeled(self, split: str) -> bool:
        return split != "test"


def make_kind(declaration) -> Kind:
    """The Kind instance of one `tasks.<name>` declaration (a TaskParams)."""
    if declaration.kind == "classification":
        return Classification(declaration.classes)
    if declaration.kind == "binary":
        return Binary()
    low, high = declaration.range
    return Regression(low, high)


def tasks_from_params(declarations: dict) -> dict[str, Task]:
    """{name: Task} in the order params.yaml declares them."""
    return {name: Task(name=name, file_prefix=d.files.prefix,
                       split_files={"train": d.files.train, "dev": d.files.dev, "test": d.files.test},
                       text_columns=tuple(d.text), label_column=d.label, kind=make_kind(d), headline=d.metric,
                       submission_file=d.submission.file, submission_column=d.submission.column)
            for name, d in declarations.items()}


def tokenized_path(tokenized_dir: Path | str, task: str, split: str) -> Path:
    return Path(tokenized_dir) / f"{task}-{split}.parquet"

