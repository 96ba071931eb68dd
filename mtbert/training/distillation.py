"""Knowledge distillation: a student fine-tuned on targets blended from the gold labels and a teacher's
predictions of the training rows (Hinton et al. 2015; for multitask models Liu et al. 2019, "Improving
Multi-Task Deep Neural Networks via Knowledge Distillation for Natural Language Understanding").

The student runs the fine-tuning loop (mtbert/training/finetune.py, `fine_tune(..., labels=distillation)`)
as it is; `prepare` (training/build.py) asks its `labels` (`GoldLabels` by default, a `Distillation` for a
student) for two things: each training row carries the teacher's prediction (`TaughtSplit`), and each task's
loss is its kind's unit blended with the teacher's (`Distilled`, beside the units in
mtbert/training/losses.py, whose docstring gives the formulas).
With a transfer set (mtbert/data/transfer.py), its rows join the training split with the teacher's
prediction and no gold label. Where the teacher's predictions come from: mtbert/evaluation/teacher.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import torch

from mtbert.data.batches import TaskSplit, TokenColumn
from mtbert.runtime import UserError
from mtbert.training.losses import Distilled, KindLoss


@dataclasses.dataclass
class TaughtSplit(TaskSplit):
    """A training split whose batches carry, beside the gold labels, the teacher's prediction of each row, and
    whether the row has a gold label (a training row) or not (a transfer row)."""
    teacher: np.ndarray = dataclasses.field(kw_only=True)  # (N, C) class probabilities, else (N,)
    gold: np.ndarray = dataclasses.field(kw_only=True)  # (N,) bool

    def batch(self, rows: np.ndarray, encoding: str, multiple: int = 1) -> dict[str, torch.Tensor]:
        batch = super().batch(rows, encoding, multiple)
        rows = np.asarray(rows, dtype=np.int64)
        batch["teacher"] = torch.from_numpy(self.teacher[rows])
        if not self.gold[rows].all():  # decided here, on the host: a batch of training rows needs no device read
            batch["gold"] = torch.from_numpy(self.gold[rows])
        return batch


def concatenated(first: TaskSplit, second: TaskSplit) -> dict:
    """The fields of one split holding the rows of `first`, then those of `second`."""
    return {"task": first.task, "ids": np.concatenate([first.ids, second.ids]),
            "labels": np.concatenate([first.labels, second.labels]),
            "tokens": {name: TokenColumn.concat([column, second.tokens[name]])
                       for name, column in first.tokens.items()}, "pad_id": first.pad_id}


class GoldLabels:
    """What an ordinary run trains on: the gold labels alone, with each task's kind of loss."""

    def taught(self, split: TaskSplit) -> TaskSplit:
        return split

    def losses(self, units: dict[str, KindLoss]) -> dict[str, KindLoss]:
        return units

    def fingerprint(self, run_fingerprint: str) -> str:
        return run_fingerprint


GOLD = GoldLabels()


@dataclasses.dataclass(frozen=True)
class Distillation(GoldLabels):
    """What makes a fine-tuning run a student's: the teacher's predictions per task, as (row ids, values),
    and how they blend with the gold labels."""
    teacher: dict[str, tuple[np.ndarray, np.ndarray]]
    alpha: float  # the teacher's weight; 1 - alpha is the gold labels'
    temperature: float
    transfer: dict[str, tuple[TaskSplit, np.ndarray]] = dataclasses.field(default_factory=dict)  # rows, teacher's
    transfer_weight: float = 1.0  # a transfer row's loss: this x the teacher's

    def taught(self, split: TaskSplit) -> TaughtSplit:
        """The split with the teacher's prediction of each of its rows, matched by id (the split may be cut)."""
        ids, values = self.teacher[split.task.name]
        position = {row_id: index for index, row_id in enumerate(ids)}
        missing = [row_id for row_id in split.ids if row_id not in position]
        if missing:
            raise UserError(f"teacher: no prediction of {split.task.name} training row {missing[0]!r} (of "
                            f"{len(missing)} missing); the members' training-split dumps are of other data, "
                            "run `dvc repro`")
        fields = {field.name: getattr(split, field.name) for field in dataclasses.fields(split)}
        teacher = values[[position[row_id] for row_id in split.ids]]
        gold = np.ones(len(split), dtype=bool)
        if split.task.name in self.transfer:  # the transfer rows after the training rows, taught only
            rows, transfer_values = self.transfer[split.task.name]
            fields = concatenated(split, rows)
            teacher = np.concatenate([teacher, transfer_values])
            gold = np.concatenate([gold, np.zeros(len(rows), dtype=bool)])
        return TaughtSplit(**fields, teacher=teacher, gold=gold)

    def losses(self, units: dict[str, KindLoss]) -> dict[str, Distilled]:
        """Each task's loss unit blended with this teacher (training/losses.py, `Distilled`)."""
        return {task: Distilled(unit, self.alpha, self.temperature, self.transfer_weight)
                for task, unit in units.items()}

    def fingerprint(self, run_fingerprint: str) -> str:
        """The run's fingerprint (params and data) with the teacher and the blend, so a checkpoint of another
        teacher is not resumed."""
        digest = hashlib.sha256(run_fingerprint.encode())
        digest.update(json.dumps({"alpha": self.alpha, "temperature": self.temperature}).encode())
        for task in sorted(self.teacher):
            ids, values = self.teacher[task]
            digest.update(json.dumps([task, [str(i) for i in ids]]).encode())
            digest.update(np.ascontiguousarray(values, dtype=np.float64).tobytes())
        if self.transfer:  # a student without a transfer set keeps the fingerprint it had before there was one
            digest.update(json.dumps({"transfer_weight": self.transfer_weight}).encode())
        for task in sorted(self.transfer):
            rows, values = self.transfer[task]
            digest.update(json.dumps([task, [str(i) for i in rows.ids]]).encode())
            for name in sorted(rows.tokens):
                digest.update(rows.tokens[name].values.tobytes())
            digest.update(np.ascontiguousarray(values, dtype=np.float64).tobytes())
        return digest.hexdigest()
