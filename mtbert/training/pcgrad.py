"""PCGrad (Yu et al. 2020): gradient surgery across the tasks of one step.

Each task's gradient is projected onto the normal plane of every other task's (original) gradient it
conflicts with (negative dot product), the others taken in random order; the projected gradients are
summed. Gradients that do not conflict pass unchanged. `PCGrad` is the step's gradient combination with
`train.gradient: pcgrad` (training/step.py's `Gradients`, chosen by training/build.py): it collects each task's
gradient apart, then projects and sums them into `.grad` at the step's end.
"""

from __future__ import annotations

import numpy as np
import torch

from mtbert.rng import PCGRAD_ORDER, generator
from mtbert.training.distributed import Ranks, average_tensor


def project_conflicts(grads: list[torch.Tensor], rng: np.random.Generator) -> list[torch.Tensor]:
    """The tasks' flat gradients with their conflicts removed."""
    projected = []
    for i, grad in enumerate(grads):
        grad = grad.clone()
        others = [j for j in range(len(grads)) if j != i]
        for j in rng.permutation(others):
            other = grads[j]
            dot = torch.dot(grad, other)
            if dot < 0:
                grad -= dot / torch.dot(other, other) * other
        projected.append(grad)
    return projected


def flat_gradient(loss: torch.Tensor, parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """d loss / d parameters as one vector; parameters the loss does not reach get zeros."""
    grads = torch.autograd.grad(loss, parameters, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten()
                      for g, p in zip(grads, parameters, strict=True)])


def accumulate(parameters: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Add a flat gradient into the parameters' .grad (so gradient accumulation keeps working)."""
    offset = 0
    for parameter in parameters:
        piece = flat[offset:offset + parameter.numel()].view_as(parameter)
        offset += parameter.numel()
        if parameter.grad is None:
            parameter.grad = piece.clone()
        else:
            parameter.grad.add_(piece)


class PCGrad:
    """A step's gradients kept apart per task, each averaged over the ranks, then projected and summed into
    the parameters' .grad at the step's end."""

    def __init__(self, parameters: list[torch.nn.Parameter], ranks: Ranks, device: torch.device, seed: int):
        self.parameters, self.ranks, self.device, self.seed = parameters, ranks, device, seed
        self.task_gradient: torch.Tensor | None = None
        self.per_task: list[torch.Tensor] = []

    def backward(self, loss: torch.Tensor) -> None:
        """Add the gradient of a piece of the current task's batch."""
        piece = flat_gradient(loss, self.parameters)  # one graph alive at a time
        self.task_gradient = piece if self.task_gradient is None else self.task_gradient + piece

    def end_task(self) -> None:
        gradient = self.task_gradient
        if gradient is None:  # this rank's shard of the batch is empty
            gradient = torch.zeros(sum(p.numel() for p in self.parameters), device=self.device)
        self.per_task.append(average_tensor(gradient, self.ranks))  # project the global gradients
        self.task_gradient = None

    def end_step(self, progress) -> None:
        """The tasks' gradients projected and summed into `.grad`. The order the other tasks are projected in is
        drawn from the seed and the step's place: the same on every rank and on resume."""
        order = generator(self.seed, PCGRAD_ORDER, progress.epoch, progress.step_in_epoch)
        accumulate(self.parameters, sum(project_conflicts(self.per_task, order)))
        self.per_task = []

    def before_update(self) -> None:
        pass  # each task's gradient was averaged over the ranks already (`end_task`)
