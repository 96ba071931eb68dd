"""An exponential moving average of a model's weights, kept beside the model being trained.

theta_avg <- decay * theta_avg + (1 - decay) * theta after every optimiser update. torch's AveragedModel
does the bookkeeping (a frozen deep copy of the model, a fused lerp over its parameters); its first update
copies the weights, so the average starts as the model. Two users: `train.ema`, where the average is the
model that is evaluated and kept (Polyak averaging), and SMART's Bregman teacher (training/smart.py).
`NoAverage` stands in when `train.ema` is 0: its model is the trained model itself.
"""

from __future__ import annotations

from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class MovingAverage:
    separate = True  # the averaged model is a copy, evaluated beside the raw weights

    def __init__(self, model: nn.Module, decay: float):
        self.averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
        self.averaged.requires_grad_(False)
        self.averaged.update_parameters(model)

    @property
    def model(self) -> nn.Module:
        """The averaged copy, an ordinary module of the model's class."""
        return self.averaged.module

    def update(self, model: nn.Module) -> None:
        self.averaged.update_parameters(model)

    def state_dict(self) -> dict:
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.averaged.load_state_dict(state)


class NoAverage:
    """The raw weights are the model (`train.ema: 0`)."""
    separate = False

    def __init__(self, model: nn.Module):
        self.model = model

    def update(self, model: nn.Module) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def weight_average(model: nn.Module, decay: float) -> MovingAverage | NoAverage:
    return MovingAverage(model, decay) if decay > 0 else NoAverage(model)
