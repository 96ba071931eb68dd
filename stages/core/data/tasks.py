"""The three tasks: their raw files, columns and label domains."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

LabelKind = Literal["class", "binary", "score"]

SPLITS = ("train", "dev", "test")
# CS224N names the unlabeled test files "<prefix>-test-student.csv".
SPLIT_FILE_SUFFIX = {"train": "train", "dev": "dev", "test": "test-student"}


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    file_prefix: str
    text_columns: tuple[str, ...]
    label_column: str
    label_kind: LabelKind
    num_classes: int  # 0 for the regression task
    label_min: float
    label_max: float

    @property
    def is_pair(self) -> bool:
        return len(self.text_columns) == 2

    def raw_path(self, raw_dir: Path | str, split: str) -> Path:
        return Path(raw_dir) / f"{self.file_prefix}-{SPLIT_FILE_SUFFIX[split]}.csv"

    def is_labeled(self, split: str) -> bool:
        return split != "test"


TASKS: dict[str, Task] = {
    "sst": Task("sst", "ids-sst", ("sentence",), "sentiment", "class", 5, 0, 4),
    "qqp": Task("qqp", "quora", ("sentence1", "sentence2"), "is_duplicate", "binary", 2, 0, 1),
    "sts": Task("sts", "sts", ("sentence1", "sentence2"), "similarity", "score", 0, 0.0, 5.0),
}
TASK_NAMES = tuple(TASKS)


def tokenized_path(tokenized_dir: Path | str, task: str, split: str) -> Path:
    return Path(tokenized_dir) / f"{task}-{split}.parquet"
