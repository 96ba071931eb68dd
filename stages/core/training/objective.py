"""The training objective of one task batch: the task loss, plus the SMART and Bregman terms when on.

total = loss_weight * (task loss + lambda_task * SMART term + mu * Bregman term). With smart.lambda = 0
(and no task override above 0) and smart.mu = 0 nothing beyond the task loss is computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from stages.core.model.multitask import MultitaskModel
from stages.core.params import SmartParams
from stages.core.training.smart import EmaTeacher, RngReplay, Smart, dropout_off


@dataclasses.dataclass
class BatchLoss:
    total: torch.Tensor  # what to backpropagate
    task_loss: float
    smart_loss: float | None = None  # the batch-mean divergence, before lambda
    bregman_loss: float | None = None  # before mu
    delta_ratio: float | None = None  # mean over tokens of ||delta_t|| / ||x_t||, in smart.norm
    delta_l2_ratio: float | None = None  # the same in the 2-norm, comparable across norms
    ascended: float | None = None  # adversarial: share of tokens whose step followed the gradient


class Objective:
    def __init__(self, model: MultitaskModel, params: SmartParams, device: torch.device, bf16: bool, seed: int):
        self.params, self.device, self.bf16 = params, device, bf16
        uses_smart = any(params.task_weight(task) > 0 for task in model.tasks)
        site = functools.partial(model.perturbation_site, where=params.perturb)
        self.smart = Smart(params, site, device, seed) if uses_smart else None
        self.teacher = EmaTeacher(model, params.beta) if params.mu > 0 else None

    def forward(self, model: torch.nn.Module, task: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            return model(task, batch)

    def __call__(self, model: MultitaskModel, task: str, batch: dict[str, torch.Tensor]) -> BatchLoss:
        replay = RngReplay(self.device)  # before the clean pass draws its dropout masks
        outputs = self.forward(model, task, batch)
        loss = model.loss(task, outputs, batch["labels"])
        result = BatchLoss(total=loss, task_loss=loss.item())
        smart_on = self.smart is not None and self.smart.enabled(task)
        if smart_on or self.teacher is not None:
            self._add_regularisers(model, task, batch, outputs, replay, result, smart_on)
        result.total = model.head_params[task].loss_weight * result.total
        return result

    def _add_regularisers(self, model, task, batch, outputs, replay, result: BatchLoss, smart_on: bool) -> None:
        def forward(m):
            return self.forward(m, task, batch)

        with self._regulariser_mode(model):
            reference = outputs if self.params.dropout == "same" else forward(model)
            if smart_on:
                smart_loss, sizes = self.smart.loss(model, task, forward, reference, replay)
                result.delta_ratio, result.delta_l2_ratio = sizes["delta_ratio"], sizes["delta_l2_ratio"]
                result.ascended = sizes.get("ascended")
                result.total = result.total + self.params.task_weight(task) * smart_loss
                result.smart_loss = smart_loss.item()
            if self.teacher is not None:
                bregman = self.teacher.loss(model, task, forward, reference, replay)
                result.total = result.total + self.params.mu * bregman
                result.bregman_loss = bregman.item()

    def _regulariser_mode(self, model):
        return dropout_off(model) if self.params.dropout == "off" else contextlib.nullcontext()

    def after_update(self, model: MultitaskModel) -> None:
        if self.teacher is not None:
            self.teacher.update(model)

    def state_dict(self) -> dict:
        state = {}
        if self.smart is not None:
            state["smart"] = self.smart.state_dict()
        if self.teacher is not None:
            state["teacher"] = self.teacher.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.smart is not None:
            self.smart.load_state_dict(state["smart"])
        if self.teacher is not None:
            self.teacher.load_state_dict(state["teacher"])
