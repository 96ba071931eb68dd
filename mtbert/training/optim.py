"""AdamW with layer-wise LR decay, head and embedding LR factors, and a warmup-then-decay schedule."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch
from torch import nn
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from mtbert.model.families import family_of
from mtbert.params import ParamsError, TrainParams

SCHEDULES = {"linear": get_linear_schedule_with_warmup, "cosine": get_cosine_schedule_with_warmup,
             "constant": get_constant_schedule_with_warmup}


def layer_of(name: str, num_layers: int, depth_zero: tuple[str, ...] = ("embeddings",)) -> int:
    """Depth of an encoder parameter: 0 for the embeddings (and what else its family's `depth_zero` names,
    e.g. MPNet's relative-position bias, which every layer reads), i + 1 for encoder layer i, top for the
    rest."""
    if any(part in name for part in depth_zero):
        return 0
    match = re.search(r"\.layers?\.(\d+)\.", name)
    return int(match.group(1)) + 1 if match else num_layers + 1


@dataclasses.dataclass(frozen=True)
class LayerwiseLR:
    """How the learning rate of each parameter is set; both loops group their parameters by it.

    An encoder parameter at depth d of L layers gets lr * layer_decay^(L - d) (the embeddings, d = 0,
    also * embedding_lr_factor); a parameter outside the encoder(s) (a head) gets lr * head_lr_mult. With
    `freeze_layers` N > 0, every encoder parameter at depth <= N (the embeddings and the bottom N layers)
    gets 0: frozen.
    """
    lr: float
    weight_decay: float
    layer_decay: float
    head_lr_mult: float = 1.0
    embedding_lr_factor: float = 1.0
    freeze_layers: int = 0
    encoder_prefix: str = "encoders."  # what the encoder parameters' names start with
    depth_zero: tuple[str, ...] = ("embeddings",)  # the encoder family's input-side parameters (families.py)

    @classmethod
    def for_training(cls, params: TrainParams, depth_zero: tuple[str, ...] = ("embeddings",)) -> LayerwiseLR:
        return cls(params.lr, params.weight_decay, params.layer_decay, params.head_lr_mult,
                   params.embedding_lr_factor, params.freeze_layers, depth_zero=depth_zero)


def lr_scale(name: str, num_layers: int, rule: LayerwiseLR) -> float:
    """The factor on the base LR of one parameter."""
    if not name.startswith(rule.encoder_prefix):
        return rule.head_lr_mult
    depth = layer_of(name, num_layers, rule.depth_zero)
    if depth <= rule.freeze_layers and rule.freeze_layers > 0:
        return 0.0
    scale = rule.layer_decay ** max(num_layers - depth, 0)  # top layer (and pooler): 1
    return scale * rule.embedding_lr_factor if depth == 0 else scale


def no_weight_decay(name: str, parameter: nn.Parameter) -> bool:
    return parameter.ndim < 2 or "LayerNorm" in name or "layer_norm" in name


def param_groups(model: nn.Module, num_layers: int, rule: LayerwiseLR,
                 multipliers: Mapping[str, float] | None = None) -> list[dict]:
    """One AdamW group per (LR, weight decay) pair; frozen parameters (LR 0) get requires_grad=False.
    `multipliers`: a further LR factor for some parameters, by name (fine-tuning's train.task_lr_mult)."""
    groups: dict[tuple[float, float], dict] = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:  # frozen by the arch (static)
            continue
        scale = lr_scale(name, num_layers, rule) * (multipliers or {}).get(name, 1.0)
        if scale == 0.0:
            parameter.requires_grad_(False)
            continue
        decay = 0.0 if no_weight_decay(name, parameter) else rule.weight_decay
        group = groups.setdefault((scale, decay), {"params": [], "names": [], "lr": rule.lr * scale,
                                                   "weight_decay": decay})
        group["params"].append(parameter)
        group["names"].append(name)
    return list(groups.values())


def adamw(groups: list[dict], lr: float) -> torch.optim.AdamW:
    """AdamW with PyTorch's fused kernel where the device has one: one kernel over all parameters instead of
    a loop of per-tensor ops, much faster on CPU (docs/performance.md)."""
    devices = {parameter.device.type for group in groups for parameter in group["params"]}
    return torch.optim.AdamW(groups, lr=lr, fused=True if devices <= {"cpu", "cuda"} else None)


def make_optimizer(model: nn.Module, num_layers: int, params: TrainParams, total_steps: int):
    """Fine-tuning's AdamW and schedule (train.*): the layer-wise rule, and each task's train.task_lr_mult
    on the parameters only that task uses (a multitask model's `parameter_owners()`)."""
    if params.freeze_layers >= num_layers:
        raise ParamsError(f"train.freeze_layers: expected fewer than the encoder's {num_layers} layers (the top "
                          f"one trains), got {params.freeze_layers}")
    multipliers = {name: params.task_lr_mult[task] for name, task in model.parameter_owners().items()}
    rule = LayerwiseLR.for_training(params, family_of(model.encoder.config).depth_zero)
    return layerwise_optimizer(model, num_layers, rule, params.schedule,
                               params.warmup_fraction, total_steps, multipliers)


def layerwise_optimizer(model: nn.Module, num_layers: int, rule: LayerwiseLR, schedule: str,
                        warmup_fraction: float, total_steps: int, multipliers: Mapping[str, float] | None = None):
    """AdamW over the layer-wise groups, and a warmup-then-`schedule` LR scheduler."""
    groups = param_groups(model, num_layers, rule, multipliers)
    optimizer = adamw([{k: v for k, v in g.items() if k != "names"} for g in groups], rule.lr)
    warmup = int(warmup_fraction * total_steps)
    make_schedule = SCHEDULES[schedule]
    if schedule == "constant":
        scheduler = make_schedule(optimizer, num_warmup_steps=warmup)
    else:
        scheduler = make_schedule(optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)
    return optimizer, scheduler
