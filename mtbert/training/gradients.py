"""How a step's task losses become the .grad fields: chosen once per run by `train.gradient`.

- `PlainGradients`: each loss is backpropagated as it comes (the tasks' gradients add up).
- `PCGradGradients`: each task's gradient is kept apart, averaged over the ranks, and the step's gradients
  are summed after gradient surgery (training/pcgrad.py).

The step calls the same three methods either way: `backward(loss)` per piece of a task's batch,
`end_task()` after each task, `end_step(order_seed)` after the step's tasks.
"""

from __future__ import annotations

import numpy as np
import torch

from mtbert.training.distributed import Ranks, average_tensor
from mtbert.training.pcgrad import accumulate, flat_gradient, project_conflicts


class PlainGradients:
    averages_over_ranks = False  # the optimiser step averages the summed gradients

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # frees the piece's activations before the next piece runs

    def end_task(self) -> None:
        pass

    def end_step(self, order_seed: list[int]) -> None:
        pass


class PCGradGradients:
    averages_over_ranks = True  # each task's gradient is averaged before the projection

    def __init__(self, parameters: list[torch.nn.Parameter], ranks: Ranks, device: torch.device):
        self.parameters, self.ranks, self.device = parameters, ranks, device
        self.task_gradient: torch.Tensor | None = None
        self.per_task: list[torch.Tensor] = []

    def backward(self, loss: torch.Tensor) -> None:
        piece = flat_gradient(loss, self.parameters)  # one graph alive at a time
        self.task_gradient = piece if self.task_gradient is None else self.task_gradient + piece

    def end_task(self) -> None:
        gradient = self.task_gradient
        if gradient is None:  # this rank's shard of the batch is empty
            gradient = torch.zeros(sum(p.numel() for p in self.parameters), device=self.device)
        self.per_task.append(average_tensor(gradient, self.ranks))  # project the global gradients
        self.task_gradient = None

    def end_step(self, order_seed: list[int]) -> None:
        """`order_seed` fixes the order the other tasks are projected in: the same on every rank and on resume."""
        order = np.random.default_rng(order_seed)
        accumulate(self.parameters, sum(project_conflicts(self.per_task, order)))
        self.per_task = []


def gradient_rule(name: str, parameters: list[torch.nn.Parameter], ranks: Ranks, device: torch.device):
    return PCGradGradients(parameters, ranks, device) if name == "pcgrad" else PlainGradients()
