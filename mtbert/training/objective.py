"""The training objective of one task batch: the forward pass under autocast, and the task's loss times its
loss_weight (`Objective`); with SMART or the Bregman teacher on, their terms added (`Regularised`).

Regularised: total = loss_weight * (task loss + sum over terms of weight(task) * term), the terms being SMART's
adversarial term (weight lambda of the task) and the Bregman teacher's (weight mu). `make_objective` picks
the class once, from smart.*: with smart.lambda = 0 (and no task override above 0) and smart.mu = 0 it is the
plain `Objective`, which computes nothing beyond the task loss. The task loss is the task kind's unit
(mtbert/training/losses.py), or for a distilled student its blend with the teacher's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from mtbert.model.multitask import MultitaskModel
from mtbert.params import SmartParams
from mtbert.training.losses import KindLoss, task_loss
from mtbert.training.smart import EmaTeacher, Forward, RngReplay, Smart, dropout_off


@dataclasses.dataclass
class BatchLoss:
    total: torch.Tensor  # what to backpropagate
    task_loss: torch.Tensor  # detached, on the device: reading it would make the step wait
    smart_loss: float | None = None  # the batch-mean divergence, before lambda
    bregman_loss: float | None = None  # before mu
    delta_ratio: float | None = None  # mean over tokens of ||delta_t|| / ||x_t||, in smart.norm
    delta_l2_ratio: float | None = None  # the same in the 2-norm, comparable across norms
    ascended: float | None = None  # adversarial: share of tokens whose step followed the gradient


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


def kind_losses(model: MultitaskModel) -> dict[str, KindLoss]:
    """Each task's loss against its gold labels: its kind's unit (training/losses.py)."""
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

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


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


def make_objective(model: MultitaskModel, params: SmartParams, device: torch.device, bf16: bool, seed: int,
                   losses: dict | None = None) -> Objective:
    """The plain objective, or the regularised one where smart.* turns a term on (a task's lambda, or mu)."""
    if params.mu > 0 or any(params.task_weight(task) > 0 for task in model.tasks):
        return Regularised(model, params, device, bf16, seed, losses)
    return Objective(model, device, bf16, losses)
