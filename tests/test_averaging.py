"""The weights' moving average: the debiased one (`train.ema`) forgets the starting weights."""

import pytest
import torch
from torch import nn

from mtbert.training.averaging import MovingAverage


def trajectory(model: nn.Linear, average: MovingAverage, values: list[float]) -> None:
    """Set the model's weight to each value in turn, updating the average after each, as training does."""
    for value in values:
        with torch.no_grad():
            model.weight.fill_(value)
        average.update(model)


def test_the_debiased_average_is_the_decay_weighted_mean_of_the_trained_weights_only():
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(100.0)  # the starting weights, which the debiased average must not remember
    decay, values = 0.9, [1.0, 2.0, 4.0]
    debiased = MovingAverage(model, decay, debiased=True)
    trajectory(model, debiased, values)
    weights = [decay ** (len(values) - 1 - i) for i in range(len(values))]
    expected = sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)
    assert debiased.model.weight.item() == torch.tensor(expected).item()
    # The plain average still holds decay^3 of the starting 100.
    plain_model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        plain_model.weight.fill_(100.0)
    plain = MovingAverage(plain_model, decay)
    trajectory(plain_model, plain, values)
    assert abs(plain.model.weight.item() - (decay ** 3 * 100 + (1 - decay) * sum(
        decay ** (2 - i) * v for i, v in enumerate(values)))) < 1e-4


def test_the_first_update_of_the_debiased_average_is_the_trained_weights():
    model = nn.Linear(2, 1)
    average = MovingAverage(model, 0.998, debiased=True)
    trajectory(model, average, [0.5])
    assert torch.equal(average.model.weight, model.weight) and torch.equal(average.model.bias, model.bias)


def debiased_ema(decay: float):
    """AveragedModel's multi_avg_fn for the debiased average, the count read on the host: update t lerps by
    (1 - d) / (1 - d^t), the number the average computes on the device."""
    @torch.no_grad()
    def update(averaged: list[torch.Tensor], current: list[torch.Tensor], updates: torch.Tensor) -> None:
        torch._foreach_lerp_(averaged, current, (1 - decay) / (1 - decay ** int(updates)))
    return update


@pytest.mark.parametrize("debiased", [True, False])  # train.ema's average, and SMART's teacher
def test_frozen_weights_are_not_lerped_and_the_average_equals_torchs_averaged_model(debiased):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2), nn.BatchNorm1d(2))  # BatchNorm: buffers that move
    model[0].weight.requires_grad_(False)  # frozen, as the embeddings are with train.embedding_lr_factor 0
    ours = MovingAverage(model, 0.9, debiased=debiased)
    reference = AveragedModel(model, multi_avg_fn=debiased_ema(0.9) if debiased else get_ema_multi_avg_fn(0.9))
    reference.update_parameters(model)  # lerps every weight
    for step in range(4):
        with torch.no_grad():
            model[1].weight.add_(step + 1.0)
            model[1].bias.mul_(-2.0)
        model(torch.tensor([1, 2, 3, 4]))  # a training-mode pass moves BatchNorm's running statistics
        ours.update(model)
        reference.update_parameters(model)
    assert ours.state_dict().keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(ours.state_dict()[name], value), name
    assert torch.equal(ours.model[0].weight, model[0].weight)
    assert int(ours.state_dict()["n_averaged"]) == 5


def test_the_update_reads_no_number_on_the_host_so_a_cuda_graph_can_hold_it():
    """On the `meta` device, every update after the first (which takes the count from AveragedModel's) makes no
    host tensor and reads no device value: the same update runs eager and captured (training/capture.py)."""
    from tests.test_families import HostTensors

    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).to("meta")
    for debiased in (True, False):
        average = MovingAverage(model, 0.9, debiased=debiased)
        average.update(model)
        recorder = HostTensors()
        with recorder:
            average.update(model)
            average.update(model)
        assert recorder.found == [], recorder.found


def test_an_average_restored_from_its_state_goes_on_as_the_uninterrupted_one():
    """A checkpoint holds the count the device kept: the restored average takes it up and ends on the same bits."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    steps = [torch.randn(3, 4) for _ in range(6)]
    uninterrupted, first = MovingAverage(model, 0.9, debiased=True), MovingAverage(model, 0.9, debiased=True)
    for i, step in enumerate(steps):
        with torch.no_grad():
            model.weight.add_(step)
        uninterrupted.update(model)
        if i < 3:
            first.update(model)
        if i == 2:
            resumed = MovingAverage(model, 0.9, debiased=True)
            resumed.load_state_dict(first.state_dict())
            assert int(resumed.state_dict()["n_averaged"]) == 4  # the copy and three updates
        if i > 2:
            resumed.update(model)
    for name, value in uninterrupted.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_shared_frozen_weights_are_the_models_own_and_the_average_is_unchanged():
    """share_frozen drops the average's copy of a frozen weight (memory), and moves no average."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2))
    model[0].weight.requires_grad_(False)
    shared, copied = MovingAverage(model, 0.9, debiased=True), MovingAverage(model, 0.9, debiased=True)
    shared.share_frozen(model)
    assert shared.model[0].weight.data_ptr() == model[0].weight.data_ptr()
    assert shared.model[1].weight.data_ptr() != model[1].weight.data_ptr()  # a moving weight keeps its copy
    for step in range(3):
        with torch.no_grad():
            model[1].weight.add_(step + 1.0)
        shared.update(model)
        copied.update(model)
    for name, value in copied.state_dict().items():
        assert torch.equal(shared.state_dict()[name], value), name
