"""PCGrad (Yu et al. 2020): gradient surgery across the tasks of one step.

Each task's gradient is projected onto the normal plane of every other task's (original) gradient it
conflicts with (negative dot product), the others taken in random order; the projected gradients are
summed. Gradients that do not conflict pass unchanged.
"""

from __future__ import annotations

import numpy as np
import torch


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
