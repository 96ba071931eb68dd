"""Knowledge distillation: a student fine-tuned on targets blended from the gold labels and a teacher's
predictions of the training rows (Hinton et al. 2015; for multitask models Liu et al. 2019, "Improving
Multi-Task Deep Neural Networks via Knowledge Distillation for Natural Language Understanding").

The student runs the fine-tuning loop (mtbert/training/finetune.py) as it is; `prepare` takes a
`Distillation` and changes two things: each training row carries the teacher's prediction (`TaughtSplit`),
and the objective's task loss is `Distillation.loss`, per batch

    alpha * teacher_loss(outputs, teacher, T) + (1 - alpha) * loss(outputs, gold labels)

with the teacher's loss by task kind (mtbert/data/kinds.py): the cross-entropy against the teacher's
class probabilities (or P(label 1)) at temperature T, times T^2, or the squared error against its score.
With T = 1 the classification loss is exactly the cross-entropy against the blended targets
alpha * teacher + (1 - alpha) * one-hot, and for scores the squared error against the blended score up to
a constant. Where the teacher's predictions come from: mtbert/evaluation/teacher.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import torch

from mtbert.data.batches import TaskSplit
from mtbert.runtime import UserError


@dataclasses.dataclass
class TaughtSplit(TaskSplit):
    """A training split whose batches carry, beside the gold labels, the teacher's prediction of each row."""
    teacher: np.ndarray = dataclasses.field(kw_only=True)  # (N, C) class probabilities, else (N,)

    def batch(self, rows: np.ndarray, encoding: str) -> dict[str, torch.Tensor]:
        batch = super().batch(rows, encoding)
        batch["teacher"] = torch.from_numpy(self.teacher[np.asarray(rows, dtype=np.int64)])
        return batch


@dataclasses.dataclass(frozen=True)
class Distillation:
    """What makes a fine-tuning run a student's: the teacher's predictions per task, as (row ids, values),
    and how they blend with the gold labels."""
    teacher: dict[str, tuple[np.ndarray, np.ndarray]]
    alpha: float  # the teacher's weight; 1 - alpha is the gold labels'
    temperature: float

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
        return TaughtSplit(**fields, teacher=values[[position[row_id] for row_id in split.ids]])

    def loss(self, model, task: str, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch-mean blend of the teacher's loss and the gold labels' (an Objective's task loss)."""
        kind, head = model.tasks[task].kind, model.head_params[task]
        taught = kind.teacher_loss(outputs, batch["teacher"], self.temperature, head)
        gold = kind.loss(outputs, batch["labels"], head)
        return self.alpha * taught + (1 - self.alpha) * gold

    def fingerprint(self, run_fingerprint: str) -> str:
        """The run's fingerprint (params and data) with the teacher and the blend, so a checkpoint of another
        teacher is not resumed."""
        digest = hashlib.sha256(run_fingerprint.encode())
        digest.update(json.dumps({"alpha": self.alpha, "temperature": self.temperature}).encode())
        for task in sorted(self.teacher):
            ids, values = self.teacher[task]
            digest.update(json.dumps([task, [str(i) for i in ids]]).encode())
            digest.update(np.ascontiguousarray(values, dtype=np.float64).tobytes())
        return digest.hexdigest()
