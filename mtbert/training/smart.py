"""SMART adversarial regularisation and the Bregman proximal-point teacher (Jiang et al. 2020).

SMART adds lambda * mean_b max_{delta in B} l_s(f(x + delta), f(x)), where x is the input of the encoder
at the perturbed site (`smart.perturb`): the word-embedding lookup (`words`; position and token-type
embeddings and LayerNorm come after, so they are added once, to the perturbed words) or the embedding
output after LayerNorm (`embeddings`, what the public SMART code perturbs). B bounds every token t on
its own: ||delta_t|| <= radius * ||x_t|| in `norm`, so the radius is a fraction of the input that reads
the same on any backbone.

- `adversarial`: delta starts as noise of relative size sigma, takes K ascent steps of relative size
  eta (null: eta = radius, so one step reaches the edge of B) along the normalised gradient of l_s with
  respect to delta alone, and is projected onto B after every step. A token whose gradient is exactly 0
  (bf16 rounds a tiny delta away, and l_s has gradient 0 where the outputs agree) steps along its starting
  noise instead, so delta reaches the radius either way; `ascended` logs the share that followed the
  gradient.
- `random`: delta is Gaussian noise scaled to the edge of B, with no ascent pass. This is what the public
  code (smart-pytorch, MT-DNN) computes in effect: its one ascent step moves the noise by ~1e-9 before it
  is rescaled to unit inf-norm per token. It costs one extra forward and backward pass.

l_s is the task kind's divergence (mtbert/data/kinds.py): the symmetric KL for classifiers (softmax
for classification, Bernoulli for binary) and the squared error for regression, reduced per example and
averaged over the batch.

The Bregman term adds mu * l_s(f(x; theta), f(x; theta_teacher)), the teacher an exponential moving
average of the weights: theta_teacher <- beta * theta_teacher + (1 - beta) * theta after every update.

Dropout (smart.dropout): `same` replays the torch RNG so that every extra pass of a batch (the ascent
pass, the adversarial pass, the teacher) draws the dropout masks the clean pass drew; with delta = 0 the
perturbed outputs then equal the clean ones exactly. `off` compares passes without dropout instead, at the
cost of one more forward and backward pass. Either way the global RNG stream after a step is the one a
run without the regularisers would see; the noise comes from SMART's own generator.

`Regularised` (at the end) is the training objective with these terms added to the task loss; the
builder picks it over the plain `Objective` (training/losses.py) only where smart.lambda or smart.mu
turns a term on.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from mtbert.model.multitask import MultitaskModel
from mtbert.params import SmartParams
from mtbert.training.averaging import MovingAverage
from mtbert.training.losses import BatchLoss, Objective

Forward = Callable[[nn.Module], torch.Tensor]  # runs one model on the current batch, in loss space


# --- the perturbation ---------------------------------------------------------------------------
def token_norms(x: torch.Tensor, norm: str) -> torch.Tensor:
    """The norm of every token's vector (the last dimension), kept as a (..., 1) column."""
    x = x.float()
    return x.abs().amax(-1, keepdim=True) if norm == "inf" else x.norm(dim=-1, keepdim=True)


def project(delta: torch.Tensor, norm: str, bound: torch.Tensor) -> torch.Tensor:
    """Onto the ball of radius `bound` (one per token, (..., 1)) around each token's vector."""
    if norm == "inf":
        return delta.clamp(min=-bound, max=bound)
    lengths = token_norms(delta, norm)
    return delta * (bound / lengths.clamp_min(torch.finfo(lengths.dtype).tiny)).clamp(max=1.0)


def normalise(grad: torch.Tensor, norm: str) -> torch.Tensor:
    """Scaled to unit norm per token (zero where it is zero, e.g. at padding)."""
    return grad / token_norms(grad, norm).clamp_min(torch.finfo(torch.float32).tiny)


def ascent_step(delta: torch.Tensor, grad: torch.Tensor, bound: torch.Tensor, step: torch.Tensor, norm: str,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One ascent step of size `step` per token, projected onto the ball of radius `bound` per token.

    Returns (the new delta, which tokens followed the gradient). Where a token's gradient is exactly 0 it
    steps along its starting noise instead: in bf16 a small delta is rounded away, the perturbed output then
    equals the clean one, and the divergence has gradient 0 there. Without this the step would leave delta
    at the starting noise and the radius would change nothing for that example.
    """
    ascended = token_norms(grad, norm) > 0
    direction = torch.where(ascended, grad, delta.detach())
    stepped = delta.detach() + step * normalise(direction, norm)
    return project(stepped, norm, bound) * mask, ascended & mask


class Perturbation:
    """While applied, adds delta to the output of `site` (the word lookup or the embeddings module).

    An encoder may be called more than once per forward pass, so there is one delta per call, in call
    order. The deltas are created on the first pass by `make_delta(clean_output, token_mask)`; padding
    positions get no perturbation.
    """

    def __init__(self, site: nn.Module, pad_token_id: int | None):
        self.site, self.pad_token_id = site, pad_token_id
        self.deltas: list[torch.Tensor] = []
        self.token_masks: list[torch.Tensor] = []
        self.clean: list[torch.Tensor] = []  # the clean outputs of the last pass, detached

    def _token_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.pad_token_id is None:
            return torch.ones_like(input_ids, dtype=torch.bool).unsqueeze(-1)
        return (input_ids != self.pad_token_id).unsqueeze(-1)

    @contextlib.contextmanager
    def applied(self, make_delta: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        calls = 0
        self.clean = []

        def add_delta(module, args, kwargs, output):
            nonlocal calls
            if calls == len(self.deltas):
                if make_delta is None:
                    raise RuntimeError("the encoder was called more often than when the deltas were made")
                mask = self._token_mask(args[0] if args else kwargs["input_ids"])
                self.token_masks.append(mask)
                self.deltas.append(make_delta(output.detach(), mask))
            self.clean.append(output.detach())
            delta = self.deltas[calls]
            calls += 1
            return output + delta.to(output.dtype)

        handle = self.site.register_forward_hook(add_delta, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()

    def relative_size(self, norm: str) -> float:
        """Mean over the real tokens of the last pass of ||delta_t|| / ||x_t||, in `norm`."""
        ratios, tokens = 0.0, 0
        for delta, clean, mask in zip(self.deltas, self.clean, self.token_masks, strict=True):
            ratio = token_norms(delta, norm) / token_norms(clean, norm).clamp_min(torch.finfo(torch.float32).tiny)
            ratios += float((ratio * mask).sum())
            tokens += int(mask.sum())
        return ratios / tokens if tokens else 0.0


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

    def __init__(self, params: SmartParams, site: Callable[[str], tuple[nn.Module, int | None]],
                 device: torch.device, seed: int):
        self.params = params
        self.site = site  # task -> (the module whose output is perturbed, the padding token id)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def enabled(self, task: str) -> bool:
        return self.params.task_weight(task) > 0

    def _noise_of_size(self, relative: float, clean: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Gaussian noise, rescaled per token to `relative` * ||x_t|| in `norm` (zero at padding)."""
        noise = torch.randn(clean.shape, generator=self.generator, device=clean.device, dtype=torch.float32)
        bound = relative * token_norms(clean, self.params.norm)
        return normalise(noise, self.params.norm) * bound * mask

    def _random_delta(self, clean: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self._noise_of_size(self.params.radius, clean, mask)

    def _starting_delta(self, clean: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # The first ascent step differentiates with respect to it; it must not be 0, where l_s has gradient 0.
        return self._noise_of_size(self.params.sigma * self.params.radius, clean, mask).requires_grad_()

    def loss(self, model: nn.Module, task: str, forward: Forward, reference: torch.Tensor,
             replay: RngReplay) -> tuple[torch.Tensor, dict[str, float]]:
        """(the batch-mean adversarial divergence against `reference` = f(x), the size of delta)."""
        perturbation = Perturbation(*self.site(task))
        sizes = {}
        if self.params.mode == "random":
            make_delta = self._random_delta  # the deltas are made in the pass below
        else:
            sizes["ascended"] = self._ascend_deltas(model, task, forward, reference, replay, perturbation)
            make_delta = None
        with perturbation.applied(make_delta), replay.replayed():
            perturbed = forward(model)
        sizes.update(delta_ratio=perturbation.relative_size(self.params.norm),
                     delta_l2_ratio=perturbation.relative_size("l2"))
        return model.divergence(task, perturbed, reference).mean(), sizes

    def _ascend_deltas(self, model: nn.Module, task: str, forward: Forward, reference: torch.Tensor,
                       replay: RngReplay, perturbation: Perturbation) -> float:
        """K ascent steps from the starting noise; returns the share of real tokens whose last step
        followed the gradient."""
        make_delta = self._starting_delta
        for _ in range(self.params.steps):
            perturbation.deltas = [delta.detach().requires_grad_() for delta in perturbation.deltas]
            with perturbation.applied(make_delta), replay.replayed(), frozen(model):
                perturbed = forward(model)
            ascent_loss = model.divergence(task, perturbed, reference.detach()).mean()
            grads = torch.autograd.grad(ascent_loss, perturbation.deltas)  # delta only, no parameter grads
            ascended = [self._ascend(perturbation, i, grad) for i, grad in enumerate(grads)]
            make_delta = None
        real_tokens = sum(int(mask.sum()) for mask in perturbation.token_masks)
        return sum(int(a.sum()) for a in ascended) / max(1, real_tokens)

    def _ascend(self, perturbation: Perturbation, call: int, grad: torch.Tensor) -> torch.Tensor:
        """Moves the delta of encoder call `call` one step; returns which tokens followed the gradient."""
        norms = token_norms(perturbation.clean[call], self.params.norm)
        perturbation.deltas[call], ascended = ascent_step(
            perturbation.deltas[call], grad, self.params.radius * norms, self.params.step_size * norms,
            self.params.norm, perturbation.token_masks[call])
        return ascended

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


# --- the Bregman proximal-point teacher ---------------------------------------------------------
class EmaTeacher(MovingAverage):
    """theta_teacher <- beta * theta_teacher + (1 - beta) * theta, without gradients, after every update;
    the teacher starts as the student."""

    def loss(self, student: nn.Module, task: str, forward: Forward, student_outputs: torch.Tensor,
             replay: RngReplay) -> torch.Tensor:
        """Batch-mean l_s(f(x; theta), f(x; theta_teacher)), the teacher seeing the student's dropout masks."""
        self.model.train(student.training)
        with torch.no_grad(), replay.replayed():
            teacher_outputs = forward(self.model)
        return student.divergence(task, student_outputs, teacher_outputs).mean()


# --- the objective with the terms ---------------------------------------------------------------
# Regularised: total = loss_weight * (task loss + sum over terms of weight(task) * term), the terms being
# SMART's adversarial term (weight lambda of the task) and the Bregman teacher's (weight mu). The builder
# (training/build.py's `make_objective`) picks it only where smart.lambda or smart.mu turns a term on.
class SmartTerm:
    """SMART's adversarial divergence, on the tasks whose lambda is above 0."""
    name = "smart"

    def __init__(self, smart: Smart, params: SmartParams):
        self.smart, self.params = smart, params

    def weight(self, task: str) -> float:
        return self.params.task_weight(task)

    def loss(self, model, task: str, forward: Forward, reference: torch.Tensor,
             replay: RngReplay) -> tuple[torch.Tensor, dict]:
        loss, sizes = self.smart.loss(model, task, forward, reference, replay)
        return loss, {"smart_loss": loss.item(), "delta_ratio": sizes["delta_ratio"],
                      "delta_l2_ratio": sizes["delta_l2_ratio"], "ascended": sizes.get("ascended")}

    def after_update(self, model) -> None:
        pass

    def state_dict(self) -> dict:
        return self.smart.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.smart.load_state_dict(state)


class BregmanTerm:
    """The divergence from the moving-average teacher, on every task."""
    name = "teacher"

    def __init__(self, teacher: EmaTeacher, mu: float):
        self.teacher, self.mu = teacher, mu

    def weight(self, task: str) -> float:
        return self.mu

    def loss(self, model, task: str, forward: Forward, reference: torch.Tensor,
             replay: RngReplay) -> tuple[torch.Tensor, dict]:
        loss = self.teacher.loss(model, task, forward, reference, replay)
        return loss, {"bregman_loss": loss.item()}

    def after_update(self, model) -> None:
        self.teacher.update(model)

    def state_dict(self) -> dict:
        return self.teacher.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.teacher.load_state_dict(state)


class Regularised(Objective):
    """The task loss plus SMART's and the Bregman teacher's terms, each on the tasks whose weight is above 0."""

    def __init__(self, model: MultitaskModel, params: SmartParams, device: torch.device, bf16: bool, seed: int,
                 losses: dict | None = None):
        super().__init__(model, device, bf16, losses)
        self.params = params
        uses_smart = any(params.task_weight(task) > 0 for task in model.tasks)
        site = functools.partial(model.perturbation_site, where=params.perturb)
        self.smart = Smart(params, site, device, seed) if uses_smart else None
        self.teacher = EmaTeacher(model, params.beta) if params.mu > 0 else None
        self.terms = ([SmartTerm(self.smart, params)] if self.smart is not None else []) + \
                     ([BregmanTerm(self.teacher, params.mu)] if self.teacher is not None else [])

    def __call__(self, model: MultitaskModel, task: str, batch: dict[str, torch.Tensor]) -> BatchLoss:
        # a regulariser replays the clean pass's dropout masks: the RNG's state before that pass draws them
        replay = RngReplay(self.device)
        outputs = self.forward(model, task, batch)
        loss = self.losses[task](outputs, batch)
        result = BatchLoss(total=loss, task_loss=loss.detach())
        terms = [term for term in self.terms if term.weight(task) > 0]
        if terms:
            self._add_terms(terms, model, task, batch, outputs, replay, result)
        result.total = model.head_params[task].loss_weight * result.total
        return result

    def _add_terms(self, terms, model, task, batch, outputs, replay, result: BatchLoss) -> None:
        def forward(m):
            return self.forward(m, task, batch)

        regulariser_mode = dropout_off(model) if self.params.dropout == "off" else contextlib.nullcontext()
        with regulariser_mode:
            # `same`: the regularisers compare against the clean pass, which drew the masks they replay
            reference = outputs if self.params.dropout == "same" else forward(model)
            for term in terms:
                loss, figures = term.loss(model, task, forward, reference, replay)
                result.total = result.total + term.weight(task) * loss
                for name, value in figures.items():
                    setattr(result, name, value)

    def after_update(self, model: MultitaskModel) -> None:
        for term in self.terms:
            term.after_update(model)

    def state_dict(self) -> dict:
        return {term.name: term.state_dict() for term in self.terms}

    def load_state_dict(self, state: dict) -> None:
        for term in self.terms:
            term.load_state_dict(state[term.name])
