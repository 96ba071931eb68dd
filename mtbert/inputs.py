"""What both prediction engines (PyTorch's mtbert/inference.py, ONNX Runtime's mtbert/deploy/engine.py) read
besides a model: the texts, checked and cleaned, and the ensemble's members (metrics/ensemble.json).

Imports nothing heavy, so the ONNX engine's command starts fast. A task here is anything with a `name` and
`text_columns` (a data.tasks.Task, or an exported task).
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path

from mtbert.runtime import UserError

Text = str | Sequence[str]  # one sentence, or a pair


class InputError(UserError, ValueError):
    """A text to predict is empty, a pair lacks a side, or an input file cannot be read."""


class EnsembleFileError(UserError, ValueError):
    """The ensemble's metrics/ensemble.json is missing, unreadable, or names members that cannot be run."""


def check_texts(task, texts: Sequence[Text], where: str = "input") -> list[tuple[str, ...]]:
    """Each text as a tuple of the task's text columns; an empty text or a missing side is an InputError."""
    if not texts:
        raise InputError(f"{where}: no texts to predict")
    width = len(task.text_columns)
    rows = []
    for index, text in enumerate(texts, start=1):
        row = (text,) if isinstance(text, str) else tuple(text)
        if len(row) != width:
            kind = "a pair of sentences" if width == 2 else "one sentence"
            raise InputError(f"{where} row {index}: task {task.name} reads {kind} "
                             f"({', '.join(task.text_columns)}), got {len(row)} text(s)")
        for column, value in zip(task.text_columns, row, strict=True):
            if not isinstance(value, str) or not has_visible_text(value):
                raise InputError(f"{where} row {index}: {column} is empty or invisible; expected a text with "
                                 "at least one visible character")
        rows.append(row)
    return rows


# Unicode categories that show nothing: separators (Z*: spaces, line and paragraph separators) and "other"
# (C*: controls, format characters such as U+200B ZERO WIDTH SPACE and U+FEFF, unassigned, private use).
INVISIBLE_CATEGORIES = ("Z", "C")


def has_visible_text(text: str) -> bool:
    """Whether `text`, NFKC-normalised, holds a character that shows: a text of only spaces, zero-width or
    other format characters is empty to a reader, and the tokenizer would see nothing (or [UNK]) in it."""
    return any(not unicodedata.category(char).startswith(INVISIBLE_CATEGORIES)
               for char in unicodedata.normalize("NFKC", text))


def clean(text: str, replacements: Sequence[Sequence[str]]) -> str:
    """One text as `tokenize` cleaned the training text (rawdata.clean_text): whitespace stripped, then each
    (escape, plain) replacement in order."""
    text = text.strip()
    for escape, plain in replacements:
        text = text.replace(escape, plain)
    return text


def ensemble_members(path: Path | str) -> dict[str, list[str]]:
    """Per task, the ensemble's members in the order the `ensemble` stage averaged them (repeats weigh more)."""
    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        members = {task: list(report[task]["order"]) for task in ensemble_tasks(report)}
    except (OSError, ValueError, KeyError, TypeError):
        raise EnsembleFileError(f"{path}: expected the ensemble stage's metrics/ensemble.json with each task's "
                                "`order` of members (run `dvc repro ensemble`)") from None
    if not members or not all(isinstance(name, str) for order in members.values() for name in order):
        raise EnsembleFileError(f"{path}: expected the ensemble stage's metrics/ensemble.json with each task's "
                                "`order` of members (run `dvc repro ensemble`)")
    snapshots = sorted({name for order in members.values() for name in order if "@" in name})
    if snapshots:
        raise EnsembleFileError(f"{path}: member {snapshots[0]} is an epoch snapshot, whose model is not kept; "
                                "run the ensemble with ensemble.snapshots: false to predict new text")
    return members


def ensemble_tasks(report: dict) -> list[str]:
    """The task sections of metrics/ensemble.json: those with an `order` of members."""
    return [key for key, value in report.items() if isinstance(value, dict) and "order" in value]


class MemberEnsemble:
    """The ensemble stage's choice (metrics/ensemble.json) over member predictors of either engine: per task,
    the average of their predictions in the stage's own order, so the results are the ensemble's dumps.
    A member predictor answers `tasks`, `values(task, texts)` and `describe(task, values)`."""

    def __init__(self, members: dict[str, list[str]], predictors: dict):
        self.members, self.predictors = members, predictors
        self.first = next(iter(predictors.values()))
        self.tasks = self.first.tasks

    @classmethod
    def from_file(cls, ensemble_file: Path | str, load_member: Callable[[str], object]):
        """Every member named in `ensemble_file`, each loaded once by `load_member(name)`."""
        members = ensemble_members(ensemble_file)
        needed = sorted({member for order in members.values() for member in order})
        return cls(members, {name: load_member(name) for name in needed})

    def values(self, task_name: str, texts: Sequence[Text]):
        if task_name not in self.members:
            raise InputError(f"unknown task {task_name!r}; this ensemble predicts {', '.join(self.members)}")
        order = self.members[task_name]
        predictions = {name: self.predictors[name].values(task_name, texts) for name in dict.fromkeys(order)}
        return average_members(predictions, order)

    def predict(self, task_name: str, texts: Sequence[Text]) -> list[dict]:
        return self.first.describe(task_name, self.values(task_name, texts))


def average_members(values: dict[str, object], order: list[str]):
    """The ensemble's average of its members' predictions in `order`, as evaluation.ensemble.average sums it
    (numpy's mean over the members in that order), so the result is the ensemble's dumps."""
    import numpy as np

    return np.mean([values[name] for name in order], axis=0)
