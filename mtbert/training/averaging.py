"""An exponential moving average of a model's weights, kept beside the model being trained.

theta_avg <- decay * theta_avg + (1 - decay) * theta after every optimiser update (`train.ema` uses the
debiased form below: avg += (1 - d) / (1 - d^t) * (theta - avg)). torch's AveragedModel holds the average
(a frozen deep copy of the model, its count `n_averaged`); its first update copies the weights, so the
average starts as the model. Two users: `train.ema`, where the average is the model that is evaluated and
kept (Polyak averaging), and SMART's Bregman teacher (training/smart.py). `NoAverage` stands in when
`train.ema` is 0: its model is the trained model itself.

`train.ema` debiases its average the way Adam debiases its moments: after t updates the average is
sum_i d^(t-i) theta_i / sum_i d^(t-i) over the trained weights theta_1..theta_t, so the starting weights
drop out. Without it a short run (95 updates at decay 0.998) reports mostly the untrained weights
(0.998^95 = 83% of them); after a full default run (2,688 updates) they weigh 0.998^2688 = 0.5%, which
the debiased average spreads over the trained weights instead. The teacher keeps its starting point:
SMART's Bregman term pulls towards the past iterates, the pretrained weights among them.

One update serves eager and captured steps alike: the count t lives on the model's device and the weight
is computed there, so the host reads no number and a CUDA graph can hold the update (training/capture.py).
A 0-d weight tensor lerps to the same bits as the number would.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from mtbert.model.frozen import device_of
from mtbert.training.checkpoint import own_where_released


class MovingAverage:
    separate = True  # the averaged model is a copy, evaluated beside the raw weights

    def __init__(self, model: nn.Module, decay: float, debiased: bool = False):
        self.decay, self.debiased = decay, debiased
        self.averaged = AveragedModel(model)
        self.averaged.requires_grad_(False)
        self.averaged.update_parameters(model)  # the first update copies every weight
        self.count: torch.Tensor | None = None  # t on the model's device, from n_averaged at the first update

    @property
    def model(self) -> nn.Module:
        """The averaged copy, an ordinary module of the model's class."""
        return self.averaged.module

    def weight(self) -> torch.Tensor:
        """This update's lerp weight, on the device: (1 - d) / (1 - d^t) debiased (1 at the first update, where
        AveragedModel's count already holds its copy), else 1 - d."""
        if self.debiased:
            return ((1 - self.decay) / (1 - torch.pow(self.decay, self.count))).float()
        return torch.full((), 1 - self.decay, device=self.count.device)

    def update(self, model: nn.Module) -> None:
        """The average moved towards the weights an optimiser moves (requires_grad). A frozen weight's average
        is the weight itself, from the first update's copy, so lerping it is work for nothing: with the
        embeddings frozen (the default) that is 11.7M of the 30.4M weights."""
        if self.count is None:
            self.count = self.averaged.n_averaged.to(device_of(model), torch.float64)
        moving = [(averaged, current.detach()) for averaged, current
                  in zip(self.model.parameters(), model.parameters(), strict=True) if current.requires_grad]
        with torch.no_grad():
            if moving:
                averaged, current = [a for a, _ in moving], [c for _, c in moving]
                torch._foreach_lerp_(averaged, current, [self.weight()] * len(averaged))
            for averaged_buffer, buffer in zip(self.model.buffers(), model.buffers(), strict=True):
                averaged_buffer.copy_(buffer)  # buffers are kept in step, not averaged (as AveragedModel does)
            self.count.add_(1)

    def share_frozen(self, model: nn.Module) -> None:
        """The average's copy of each frozen weight (requires_grad off) replaced by the weight itself: a weight
        that never moves is its own average, so the copy is memory for nothing (with train.freeze_layers 8,
        80M of an MPNet member's 140M weights)."""
        for averaged, current in zip(self.model.parameters(), model.parameters(), strict=True):
            if not current.requires_grad:
                averaged.data = current.data

    def state_dict(self) -> dict:
        """AveragedModel's state, its count `n_averaged` taken from the device's."""
        if self.count is not None:
            self.averaged.n_averaged.copy_(self.count.to(self.averaged.n_averaged))
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.averaged.load_state_dict(own_where_released(state, self.averaged))
        self.count = None  # taken again from the restored count at the next update


class NoAverage:
    """The raw weights are the model (`train.ema: 0`)."""
    separate = False

    def __init__(self, model: nn.Module):
        self.model = model

    def update(self, model: nn.Module) -> None:
        pass

    def share_frozen(self, model: nn.Module) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def weight_average(model: nn.Module, decay: float) -> MovingAverage | NoAverage:
    return MovingAverage(model, decay, debiased=True) if decay > 0 else NoAverage(model)
