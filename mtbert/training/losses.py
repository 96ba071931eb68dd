"""The loss of each task kind (one unit per kind), a distilled student's blend of it with a teacher's, and
the objective the default step backpropagates: a task batch's forward pass and its unit, times the head's
loss_weight (`Objective`). SMART's and the Bregman teacher's terms extend it in training/smart.py
(`Regularised`).

A unit takes a task batch's outputs (in loss space, as MultitaskModel returns them) and the batch, and
gives the batch mean as a 0-dim float32 tensor:

    loss = unit(outputs, batch)

| kind | outputs | `batch["labels"]` | gold loss |
|---|---|---|---|
| classification | (B, C) logits z | (B,) class ids y | −mean log softmax(z)[y] |
| binary | (B,) logit z | (B,) 0 or 1 | BCE(sigmoid(z), y) |
| regression | (B,) score s | (B,) numbers in [lo, hi] | mean (s − t(y))² |

| kind | `batch["teacher"]` (distillation) | teacher loss at temperature T |
|---|---|---|
| classification | (B, C) probabilities p | T² × CE(z / T, softmax(log p / T)) |
| binary | (B,) P(label 1) p | T² × BCE(z / T, sigmoid(logit(p) / T)) |
| regression | (B,) score r | mean (s − t(r))² |

t is the identity (`heads.<task>.target: raw`) or (y − lo) / (hi − lo) (`target: unit`). The teacher's
columns hold user-facing values, as the prediction dumps do. T² keeps the teacher's gradient the same size
whatever T (Hinton et al. 2015); with T = 1 the classification blend below is exactly the cross-entropy
against alpha × teacher + (1 − alpha) × one-hot.

A distilled student (mtbert/training/distillation.py) learns from `Distilled(unit, alpha, T, weight)`:
alpha × teacher loss + (1 − alpha) × gold loss per training row, and weight × teacher loss per transfer row
(a row with no gold label); the batch's loss is the mean over its rows of either kind.

    >>> unit = task_loss(task, head)          # e.g. CrossEntropy() for a classification task
    >>> unit(model(task_name, batch), batch)  # tensor(1.61, grad_fn=...)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mtbert.data.tasks import Task
from mtbert.model.multitask import MultitaskModel
from mtbert.params import HeadParams


class CrossEntropy:
    """classification: cross-entropy of C logits against a class id, or against a teacher's probabilities."""

    def __call__(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.gold(outputs, batch["labels"])

    def gold(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), labels.long())

    def taught(self, outputs: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
        # the softmax of log p / T: for one teacher, the softmax of its logits over T
        soft = F.softmax(teacher.float().clamp(min=1e-12).log() / temperature, -1)
        return F.cross_entropy(outputs.float() / temperature, soft) * temperature ** 2


class BinaryCrossEntropy:
    """binary: BCE of one logit against a 0/1 label, or against a teacher's P(label 1) (the two classes of a
    Bernoulli, as CrossEntropy does for C)."""

    def __call__(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.gold(outputs, batch["labels"])

    def gold(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs.float(), labels.float())

    def taught(self, outputs: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
        soft = torch.sigmoid(torch.logit(teacher.float(), eps=1e-7) / temperature)
        return F.binary_cross_entropy_with_logits(outputs.float() / temperature, soft) * temperature ** 2


class SquaredError:
    """regression: the squared error against the label, or the teacher's score, on the head's target scale
    (no temperature: a score has no distribution to soften)."""

    def __init__(self, low: float, high: float, unit: bool):
        self.low, self.high, self.unit = low, high, unit

    def __call__(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.gold(outputs, batch["labels"])

    def gold(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        target = (labels.float() - self.low) / (self.high - self.low) if self.unit else labels.float()
        return F.mse_loss(outputs.float(), target)

    def taught(self, outputs: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
        return self.gold(outputs, teacher)


KindLoss = CrossEntropy | BinaryCrossEntropy | SquaredError


def task_loss(task: Task, head: HeadParams) -> KindLoss:
    """The loss unit of the task's kind (`tasks.<name>.kind`); a regression's target is its raw label unless
    heads.<task>.target is `unit`."""
    kind = task.kind
    if kind.name == "classification":
        return CrossEntropy()
    if kind.name == "binary":
        return BinaryCrossEntropy()
    return SquaredError(kind.low, kind.high, unit=head.target == "unit")


class Distilled:
    """A student's loss: a kind's unit blended with the teacher's predictions (`batch["teacher"]`); a batch
    holding transfer rows also carries `batch["gold"]`, whether each row has a gold label."""

    def __init__(self, unit: KindLoss, alpha: float, temperature: float, transfer_weight: float):
        self.unit, self.alpha, self.temperature, self.transfer_weight = unit, alpha, temperature, transfer_weight

    def __call__(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        gold = batch.get("gold")  # only in a batch with transfer rows (decided on the host)
        if gold is None or bool(gold.all()):
            return self.blend(outputs, batch["teacher"], batch["labels"])
        share = gold.float().mean()  # each part's mean, weighted by its share of the batch's rows
        taught = self.unit.taught(outputs[~gold], batch["teacher"][~gold], self.temperature)
        loss = (1 - share) * self.transfer_weight * taught
        if bool(gold.any()):
            loss = loss + share * self.blend(outputs[gold], batch["teacher"][gold], batch["labels"][gold])
        return loss

    def blend(self, outputs: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """alpha x the teacher's loss + (1 - alpha) x the gold labels', each a mean over the rows."""
        taught = self.unit.taught(outputs, teacher, self.temperature)
        return self.alpha * taught + (1 - self.alpha) * self.unit.gold(outputs, labels)


# --- the objective ------------------------------------------------------------------------------
@dataclasses.dataclass
class BatchLoss:
    total: torch.Tensor  # what to backpropagate
    task_loss: torch.Tensor  # detached, on the device: reading it would make the step wait
    smart_loss: float | None = None  # the batch-mean divergence, before lambda
    bregman_loss: float | None = None  # before mu
    delta_ratio: float | None = None  # mean over tokens of ||delta_t|| / ||x_t||, in smart.norm
    delta_l2_ratio: float | None = None  # the same in the 2-norm, comparable across norms
    ascended: float | None = None  # adversarial: share of tokens whose step followed the gradient


def kind_losses(model: MultitaskModel) -> dict[str, KindLoss]:
    """Each task's loss against its gold labels: its kind's unit (above)."""
    return {name: task_loss(task, model.head_params[name]) for name, task in model.tasks.items()}


class Objective:
    """The task loss of a batch times its head's loss_weight (1 unless heads.<task>.loss_weight says
    otherwise): what the default step backpropagates. The forward pass runs under bf16 autocast where the run
    decided on bf16 (train.bf16); each loss unit computes in fp32."""

    def __init__(self, model: MultitaskModel, device: torch.device, bf16: bool, losses: dict | None = None):
        self.device, self.bf16 = device, bf16
        self.autocast_cache = True  # off for captured steps: a CUDA graph must not hold autocast's cached casts
        self.losses = losses if losses is not None else kind_losses(model)  # task -> (outputs, batch) -> mean loss

    def forward(self, model: torch.nn.Module, task: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16,
                            cache_enabled=self.autocast_cache):
            return model(task, batch)

    def __call__(self, model: MultitaskModel, task: str, batch: dict[str, torch.Tensor]) -> BatchLoss:
        loss = self.losses[task](self.forward(model, task, batch), batch)
        return BatchLoss(total=model.head_params[task].loss_weight * loss, task_loss=loss.detach())

    def after_update(self, model: MultitaskModel) -> None:
        """What follows the weights after each update: nothing here (the Bregman teacher, training/smart.py)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
