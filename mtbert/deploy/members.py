"""The ensemble's members as the `ensemble` stage chose them, and their average: the one reader of
metrics/ensemble.json and the one averager, for the stage itself, the students' teacher and both
prediction engines (`mtbert predict --ensemble`, `mtbert serve`, through `MemberEnsemble`).

Imports nothing heavy, so the ONNX engine's command starts fast.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from mtbert.inputs import InputError, Text
from mtbert.runtime import UserError


class EnsembleFileError(UserError, ValueError):
    """The ensemble's metrics/ensemble.json is missing, unreadable, or names members that cannot be run."""


def read_members(path: Path | str) -> dict[str, list[str]]:
    """Per task, the ensemble's members in the order the `ensemble` stage averaged them (a member picked
    twice weighs twice). Epoch snapshots are refused: neither their model nor their training-split and
    transfer dumps are kept."""
    path = Path(path)
    if not path.is_file():
        raise EnsembleFileError(f"{path} is missing; run `dvc repro ensemble`")
    expected = (f"{path}: expected the ensemble stage's metrics/ensemble.json with each task's `order` of "
                "members (run `dvc repro ensemble`)")
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        members = {task: list(section["order"]) for task, section in report.items()
                   if isinstance(section, dict) and "order" in section}
    except (OSError, ValueError, TypeError, AttributeError):
        raise EnsembleFileError(expected) from None
    if not members or not all(order and all(isinstance(name, str) for name in order) for order in members.values()):
        raise EnsembleFileError(expected)
    snapshots = sorted({name for order in members.values() for name in order if "@" in name})
    if snapshots:
        raise EnsembleFileError(f"{path}: member {snapshots[0]} is an epoch snapshot, whose model and dumps are "
                                "not kept; use an ensemble of ensemble.snapshots: false")
    return members


def average(values: dict[str, np.ndarray], order: list[str]) -> np.ndarray:
    """The members' predictions averaged in `order` (numpy's mean over them, in that order), so every
    reader of the ensemble reproduces the stage's dumps exactly."""
    return np.mean([values[name] for name in order], axis=0)


class MemberEnsemble:
    """The ensemble stage's choice (metrics/ensemble.json) over member predictors of either engine: per task,
    the average of their predictions in the stage's own order, so the results are the ensemble's dumps.
    A member predictor answers `tasks`, `values(task, texts)` and `describe(task, values)`."""

    def __init__(self, members: dict[str, list[str]], predictors: dict):
        self.members, self.predictors = members, predictors
        self.first = max(predictors.values(), key=lambda predictor: len(predictor.tasks))  # the widest member
        # a member may serve some tasks only (greedy selection; an ensemble's export keeps only those)
        self.tasks = {task: predictors[order[0]].tasks[task] for task, order in members.items()}

    @classmethod
    def from_file(cls, ensemble_file: Path | str, load_member: Callable[[str], object]):
        """Every member named in `ensemble_file`, each loaded once by `load_member(name)`."""
        members = read_members(ensemble_file)
        needed = sorted({member for order in members.values() for member in order})
        return cls(members, {name: load_member(name) for name in needed})

    def values(self, task_name: str, texts: Sequence[Text]):
        if task_name not in self.members:
            raise InputError(f"unknown task {task_name!r}; this ensemble predicts {', '.join(self.members)}")
        order = self.members[task_name]
        predictions = {name: self.predictors[name].values(task_name, texts) for name in dict.fromkeys(order)}
        return average(predictions, order)

    def predict(self, task_name: str, texts: Sequence[Text]) -> list[dict]:
        return self.describe(task_name, self.values(task_name, texts))

    def describe(self, task_name: str, values) -> list[dict]:
        return self.predictors[self.members[task_name][0]].describe(task_name, values)
