"""SMART adversarial regularisation and the Bregman proximal-point teacher (Jiang et al. 2020).

SMART adds lambda * mean_b max_{||delta|| <= eps} l_s(f(x + delta), f(x)), where x is the output of the
word-embedding lookup (position and token-type embeddings and LayerNorm come after, so they are added
once, to the perturbed words). delta starts as N(0, sigma^2), takes K ascent steps of size eta along the
normalised gradient of l_s with respect to delta alone, and is projected onto the eps-ball around each
token's embedding after every step. l_s is the task kind's divergence (stages/core/data/kinds.py): the
symmetric KL for classifiers (softmax for classification, Bernoulli for binary) and the squared error
for regression, reduced per example and averaged over the batch.

The Bregman term adds mu * l_s(f(x; theta), f(x; theta_teacher)), the teacher an exponential moving
average of the weights: theta_teacher <- beta * theta_teacher + (1 - beta) * theta after every update.

Dropout (smart.dropout): `same` replays the torch RNG so that every extra pass of a batch (the ascent
pass, the adversarial pass, the teacher) draws the dropout masks the clean pass drew; with delta = 0 the
perturbed outputs then equal the clean ones exactly. `off` compares passes without dropout instead, at the
cost of one more forward and backward pass. Either way the global RNG stream after a step is the one a
run without the regularisers would see; the initial noise comes from SMART's own generator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from stages.core.params import SmartParams

Forward = Callable[[nn.Module], torch.Tensor]  # runs one model on the current batch, in loss space


# --- the perturbation ---------------------------------------------------------------------------
def project(delta: torch.Tensor, norm: str, epsilon: float) -> torch.Tensor:
    """Onto the eps-ball of each token's embedding vector (the last dimension)."""
    if norm == "inf":
        return delta.clamp(-epsilon, epsilon)
    lengths = delta.norm(dim=-1, keepdim=True)
    return delta * (epsilon / lengths.clamp_min(epsilon)).clamp(max=1.0)


def normalise(grad: torch.Tensor, norm: str) -> torch.Tensor:
    """The gradient scaled to unit norm per token (zero where it is zero, e.g. at padding)."""
    if norm == "inf":
        size = grad.abs().amax(-1, keepdim=True)
    else:
        size = grad.norm(dim=-1, keepdim=True)
    return grad / size.clamp_min(torch.finfo(grad.dtype).tiny)


class WordPerturbation:
    """While applied, adds delta to the output of the word-embedding lookup.

    An encoder may be called more than once per forward pass, so there is one delta per call, in call
    order. The deltas are created on the first pass by `make_delta(lookup, token_mask)`; padding
    positions get no perturbation.
    """

    def __init__(self, word_embeddings: nn.Embedding):
        self.word_embeddings = word_embeddings
        self.deltas: list[torch.Tensor] = []
        self.token_masks: list[torch.Tensor] = []
        self.lookups: list[torch.Tensor] = []  # the clean lookups of the last pass, detached

    def _token_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        pad = self.word_embeddings.padding_idx
        mask = torch.ones_like(input_ids, dtype=torch.bool) if pad is None else input_ids != pad
        return mask.unsqueeze(-1)

    @contextlib.contextmanager
    def applied(self, make_delta: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        calls = 0
        self.lookups = []

        def add_delta(module, inputs, output):
            nonlocal calls
            if calls == len(self.deltas):
                if make_delta is None:
                    raise RuntimeError("the encoder was called more often than when the deltas were made")
                mask = self._token_mask(inputs[0])
                self.token_masks.append(mask)
                self.deltas.append(make_delta(output.detach(), mask))
            self.lookups.append(output.detach())
            delta = self.deltas[calls]
            calls += 1
            return output + delta.to(output.dtype)

        handle = self.word_embeddings.register_forward_hook(add_delta)
        try:
            yield self
        finally:
            handle.remove()

    def relative_size(self) -> float:
        """||delta|| / ||word embeddings|| over the real tokens of the last pass."""
        def squared_size(tensors: list[torch.Tensor]) -> float:
            return sum(float((t * m).float().pow(2).sum()) for t, m in zip(tensors, self.token_masks, strict=True))

        lookup_sq = squared_size(self.lookups)
        return (squared_size(self.deltas) / lookup_sq) ** 0.5 if lookup_sq > 0 else 0.0


# --- dropout masks ------------------------------------------------------------------------------
class RngReplay:
    """A snapshot of torch's RNG, taken before the clean pass, to draw the same dropout masks again."""

    def __init__(self, device: torch.device):
        self.device = device
        self.snapshot = self._state()

    def _state(self) -> tuple:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _set(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Inside: the RNG as it was at the snapshot. After: as it was before entering."""
        after = self._state()
        self._set(self.snapshot)
        try:
            yield
        finally:
            self._set(after)


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """No parameter takes part in autograd inside, so a pass saves nothing for weight gradients."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    for parameter in trainable:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in trainable:
            parameter.requires_grad_(True)


# --- the adversarial term -----------------------------------------------------------------------
class Smart:
    """The SMART term of one batch; see the module docstring for the method."""

    def __init__(self, params: SmartParams, word_embeddings: Callable[[str], nn.Embedding], device: torch.device,
                 seed: int):
        self.params = params
        self.word_embeddings = word_embeddings  # task -> the lookup its input goes through
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def enabled(self, task: str) -> bool:
        return self.params.task_weight(task) > 0

    def _initial_noise(self, lookup: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(lookup.shape, generator=self.generator, device=lookup.device, dtype=torch.float32)
        noise = noise * self.params.sigma * mask
        if self.params.steps == 0:
            return project(noise, self.params.norm, self.params.epsilon)
        return noise.requires_grad_()  # the first ascent step differentiates with respect to it

    def loss(self, model: nn.Module, task: str, forward: Forward, reference: torch.Tensor,
             replay: RngReplay) -> tuple[torch.Tensor, float]:
        """(the batch-mean adversarial divergence, ||delta|| / ||embeddings||) against `reference` = f(x)."""
        perturbation = WordPerturbation(self.word_embeddings(task))
        make_delta = self._initial_noise
        for _ in range(self.params.steps):
            perturbation.deltas = [delta.detach().requires_grad_() for delta in perturbation.deltas]
            with perturbation.applied(make_delta), replay.replayed(), frozen(model):
                perturbed = forward(model)
            ascent_loss = model.divergence(task, perturbed, reference.detach()).mean()
            grads = torch.autograd.grad(ascent_loss, perturbation.deltas)  # delta only, no parameter grads
            perturbation.deltas = [self._ascend(d, g, m) for d, g, m in
                                   zip(perturbation.deltas, grads, perturbation.token_masks, strict=True)]
            make_delta = None
        with perturbation.applied(make_delta), replay.replayed():
            perturbed = forward(model)
        return model.divergence(task, perturbed, reference).mean(), perturbation.relative_size()

    def _ascend(self, delta: torch.Tensor, grad: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        stepped = delta.detach() + self.params.eta * normalise(grad, self.params.norm)
        return project(stepped, self.params.norm, self.params.epsilon) * mask

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


# --- the Bregman proximal-point teacher ---------------------------------------------------------
class EmaTeacher:
    """theta_teacher <- beta * theta_teacher + (1 - beta) * theta, without gradients, after every update.

    torch's AveragedModel does the averaging; its first update copies the weights, so the teacher
    starts as the student and every later update is the moving average.
    """

    def __init__(self, model: nn.Module, beta: float):
        self.averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(beta))
        self.averaged.requires_grad_(False)
        self.averaged.update_parameters(model)

    @property
    def model(self) -> nn.Module:
        return self.averaged.module

    def update(self, student: nn.Module) -> None:
        self.averaged.update_parameters(student)

    def loss(self, student: nn.Module, task: str, forward: Forward, student_outputs: torch.Tensor,
             replay: RngReplay) -> torch.Tensor:
        """Batch-mean l_s(f(x; theta), f(x; theta_teacher)), the teacher seeing the student's dropout masks."""
        self.model.train(student.training)
        with torch.no_grad(), replay.replayed():
            teacher_outputs = forward(self.model)
        return student.divergence(task, student_outputs, teacher_outputs).mean()

    def state_dict(self) -> dict:
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.averaged.load_state_dict(state)
