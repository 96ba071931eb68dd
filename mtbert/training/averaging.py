"""An exponential moving average of a model's weights, kept beside the model being trained.

theta_avg <- decay * theta_avg + (1 - decay) * theta after every optimiser update (`train.ema` uses the
debiased form below: avg += (1 - d) / (1 - d^t) * (theta - avg)). torch's AveragedModel
does the bookkeeping (a frozen deep copy of the model, a fused lerp over its parameters); its first update
copies the weights, so the average starts as the model. Two users: `train.ema`, where the average is the
model that is evaluated and kept (Polyak averaging), and SMART's Bregman teacher (training/smart.py).
`NoAverage` stands in when `train.ema` is 0: its model is the trained model itself.

`train.ema` debiases its average the way Adam debiases its moments: after t updates the average is
sum_i d^(t-i) theta_i / sum_i d^(t-i) over the trained weights theta_1..theta_t, so the starting weights
drop out. Without it a short run (95 updates at decay 0.998) reports mostly the untrained weights
(0.998^95 = 83% of them); after a full default run (2,688 updates) they weigh 0.998^2688 = 0.5%, which
the debiased average spreads over the trained weights instead. The teacher keeps its starting point:
SMART's Bregman term pulls towards the past iterates, the pretrained weights among them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def debiased_ema(decay: float):
    """AveragedModel's multi_avg_fn for the debiased average: update t lerps by (1 - d) / (1 - d^t),
    1 at the first update (the average becomes the trained weights) and towards 1 - d after ~1/(1 - d)."""
    @torch.no_grad()
    def update(averaged: list[torch.Tensor], current: list[torch.Tensor], updates: torch.Tensor) -> None:
        updates_so_far = int(updates)  # AveragedModel counts the copy it starts with as its first
        torch._foreach_lerp_(averaged, current, (1 - decay) / (1 - decay ** updates_so_far))
    return update


class MovingAverage:
    separate = True  # the averaged model is a copy, evaluated beside the raw weights

    def __init__(self, model: nn.Module, decay: float, debiased: bool = False):
        self.decay, self.debiased = decay, debiased
        self.average = debiased_ema(decay) if debiased else get_ema_multi_avg_fn(decay)
        self.averaged = AveragedModel(model, multi_avg_fn=self.average)
        self.averaged.requires_grad_(False)
        self.averaged.update_parameters(model)  # the first update copies every weight

    @property
    def model(self) -> nn.Module:
        """The averaged copy, an ordinary module of the model's class."""
        return self.averaged.module

    def update(self, model: nn.Module) -> None:
        """AveragedModel.update_parameters for the weights an optimiser moves (requires_grad). A frozen
        weight's average is the weight itself, from the first update's copy, so lerping it is work for
        nothing: with the embeddings frozen (the default) that is 11.7M of the 30.4M weights."""
        moving = [(averaged, current.detach()) for averaged, current
                  in zip(self.model.parameters(), model.parameters(), strict=True) if current.requires_grad]
        if moving:
            self.average([averaged for averaged, _ in moving], [current for _, current in moving],
                         self.averaged.n_averaged)
        with torch.no_grad():
            for averaged, current in zip(self.model.buffers(), model.buffers(), strict=True):
                averaged.copy_(current)  # buffers are kept in step, not averaged (as AveragedModel does)
        self.averaged.n_averaged += 1

    def share_frozen(self, model: nn.Module) -> None:
        """The average's copy of each frozen weight (requires_grad off) replaced by the weight itself: a weight
        that never moves is its own average, so the copy is memory for nothing (with train.freeze_layers 8,
        80M of an MPNet member's 140M weights)."""
        for averaged, current in zip(self.model.parameters(), model.parameters(), strict=True):
            if not current.requires_grad:
                averaged.data = current.data

    def on_device(self) -> OnDeviceAverage:
        """This average, updated with no number read by the host from now on (captured steps)."""
        return OnDeviceAverage(self)

    def state_dict(self) -> dict:
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.averaged.load_state_dict(state)


class OnDeviceAverage(MovingAverage):
    """The same average, updated with no number read by the host, so that a CUDA graph can hold the update
    (training/capture.py): the debiasing weight (1 - d) / (1 - d^t) is computed on the device from a device
    copy of the count t, and the lerp is written as avg += weight * (current - avg). Rounding differs from
    `MovingAverage.update`'s lerp by an ulp, so a run uses one or the other throughout. The host's count
    (AveragedModel's `n_averaged`, which a checkpoint records) is taken from the device's when saved."""

    def __init__(self, average: MovingAverage):
        self.decay, self.debiased, self.average, self.averaged = (average.decay, average.debiased, average.average,
                                                                  average.averaged)
        self.device_count: torch.Tensor | None = None  # from the count a checkpoint restored, at the first update

    def update(self, model: nn.Module) -> None:
        if self.device_count is None:
            device = next(model.parameters()).device
            self.device_count = self.averaged.n_averaged.to(device=device, dtype=torch.float64)
        moving = [(averaged, current.detach()) for averaged, current
                  in zip(self.model.parameters(), model.parameters(), strict=True) if current.requires_grad]
        if self.debiased:
            weight = ((1 - self.decay) / (1 - torch.pow(self.decay, self.device_count))).float()
        else:
            weight = torch.full_like(self.device_count, 1 - self.decay, dtype=torch.float32)
        with torch.no_grad():
            if moving:
                averaged, current = [a for a, _ in moving], [c for _, c in moving]
                difference = torch._foreach_sub(current, averaged)
                torch._foreach_mul_(difference, weight)
                torch._foreach_add_(averaged, difference)
            for averaged_buffer, buffer in zip(self.model.buffers(), model.buffers(), strict=True):
                averaged_buffer.copy_(buffer)
            self.device_count.add_(1)

    def on_device(self) -> OnDeviceAverage:
        return self

    def state_dict(self) -> dict:
        if self.device_count is not None:
            self.averaged.n_averaged.copy_(self.device_count.to(self.averaged.n_averaged))
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.averaged.load_state_dict(state)
        self.device_count = None  # taken again from the restored count


class NoAverage:
    """The raw weights are the model (`train.ema: 0`)."""
    separate = False

    def __init__(self, model: nn.Module):
        self.model = model

    def update(self, model: nn.Module) -> None:
        pass

    def share_frozen(self, model: nn.Module) -> None:
        pass

    def on_device(self) -> NoAverage:
        return self

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def weight_average(model: nn.Module, decay: float) -> MovingAverage | NoAverage:
    return MovingAverage(model, decay, debiased=True) if decay > 0 else NoAverage(model)
