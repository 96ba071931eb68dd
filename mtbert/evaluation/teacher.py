"""The teacher of a distilled student: the ensemble the `ensemble` stage chose, on the training rows.

Per task, the average of its members' predictions of the training split, in the order the stage averaged
them (metrics/ensemble.json's `order`; a member picked twice weighs twice), so it is the ensemble's own
prediction of those rows. The members' predictions are their `predict` dumps of the training split, which
`predict` writes when distill.enabled is true: the student's stage then needs no model but its own, and
DVC sees every input it reads. The ensemble was chosen on dev, but the student only ever trains on the
training rows and their labels, and on the transfer set (stage `transfer`), which holds training text only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mtbert.data.batches import TaskSplit, load_split
from mtbert.data.tasks import Task
from mtbert.deploy.members import average, read_members
from mtbert.evaluation.predictions import dump_path, read_aligned, read_dump
from mtbert.runtime import MissingInputError, UserError


def ensemble_members(ensemble_file: Path, tasks: dict[str, Task]) -> dict[str, list[str]]:
    """Per task, the ensemble's members in the order it averaged them, repeats included; every task needs some."""
    members = read_members(ensemble_file)
    missing = [name for name in tasks if name not in members]
    if missing:
        raise UserError(f"{ensemble_file}: no `order` of members for task {missing[0]!r}; run `dvc repro ensemble`")
    return {name: members[name] for name in tasks}


def training_predictions(predictions_dir: Path, task: Task, order: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The ids of the task's training rows and the average of the members' predictions of them."""
    for member in dict.fromkeys(order):
        if not dump_path(predictions_dir / member, task.name, "train").is_file():
            raise MissingInputError(f"{dump_path(predictions_dir / member, task.name, 'train')} is missing: "
                                    "`predict` dumps the training split only with distill.enabled: true; run "
                                    "`dvc repro`")
    ids, _ = read_dump(predictions_dir / order[0], task, "train")
    values = {member: read_aligned(predictions_dir / member, task, "train", ids) for member in dict.fromkeys(order)}
    return ids, average(values, order)


def transfer_teacher(ensemble_file: Path, predictions_dir: Path, transfer_dir: Path,
                     tasks: dict[str, Task]) -> dict[str, tuple[TaskSplit, np.ndarray]]:
    """Per task with transfer rows, the rows (stage `transfer`) and the ensemble's predictions of them: the
    average of its members' `transfer` dumps, in its order."""
    members = ensemble_members(ensemble_file, tasks)
    labelled = {}
    for name, task in tasks.items():
        rows = load_split(transfer_dir, task, "transfer")
        if not len(rows):
            continue
        order = members[name]
        values = {member: read_aligned(predictions_dir / member, task, "transfer", rows.ids)
                  for member in dict.fromkeys(order)}
        labelled[name] = (rows, average(values, order))
    return labelled


def ensemble_teacher(ensemble_file: Path, predictions_dir: Path,
                     tasks: dict[str, Task]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per task, the training rows' ids and the ensemble's predictions of them."""
    members = ensemble_members(ensemble_file, tasks)
    return {name: training_predictions(predictions_dir, task, members[name]) for name, task in tasks.items()}


def teacher_record(distill, seed: int, transfer_rows: dict[str, int], members: dict[str, list[str]]) -> dict:
    """What taught a student, as its model folder's config and its metrics record it: the variant and seed it
    was trained as, the blend of soft and gold labels, the transfer rows per task, and each task's members
    with how many times each is in the ensemble."""
    return {"variant": distill.variant, "seed": seed, "alpha": distill.alpha, "temperature": distill.temperature,
            "transfer": transfer_rows, "transfer_weight": distill.transfer.weight,
            "members": {name: {member: order.count(member) for member in dict.fromkeys(order)}
                        for name, order in members.items()}}
