"""What the captured steps (mtbert/training/capture.py) rest on that a CPU can check: which runs can be
captured, the bi-encoder's one width, the moving average's update with no host read, and lr tensors in a
checkpoint. The capture itself needs a GPU: tests/test_cuda.py."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mtbert.data.batches import load_split
from mtbert.data.tasks import tasks_from_params
from mtbert.params_file import variant_params
from mtbert.training.averaging import MovingAverage
from mtbert.training.capture import CapturedSteps, capture_blocker, one_width
from mtbert.training.checkpoint import restore
from mtbert.training.distributed import Ranks
from mtbert.training.finetune import eager_step, start
from mtbert.training.loop import Paths
from tests.conftest import make_params


def cpu_run(tmp_path: Path, backbone: Path, tokenized: Path, **overrides):
    params = variant_params(make_params(tmp_path, backbone, Path("unused"), **overrides), "base")
    paths = Paths(tokenized=tokenized, model_out=tmp_path / "m", metrics_out=tmp_path / "m.json",
                  live_dir=tmp_path / "live", checkpoints=tmp_path / "ck")
    return start(params, "base", paths)[0]


def test_the_captured_step_takes_what_the_loop_gives_the_eager_step():
    """`train_epoch` calls whichever step it chose with the same arguments; a captured step that drifted
    from the eager one would fail only on a GPU, which CI does not have (a CUDA test rotted so once)."""
    def shape(function, skip: int = 0) -> list[tuple]:
        return [(p.name, p.kind, p.default) for p in list(inspect.signature(function).parameters.values())[skip:]]

    assert shape(CapturedSteps.step, skip=1) == shape(eager_step)  # less `self`


@pytest.mark.parametrize("overrides, reason", [
    ({}, None),
    ({"train": {"grad_accum": 2}}, "train.grad_accum > 1"),
    ({"train": {"sampler": "joint", "gradient": "pcgrad"}}, "PCGrad"),
    ({"smart": {"lambda": 1.0}}, "SMART and the Bregman teacher"),
    ({"smart": {"mu": 1.0}}, "SMART and the Bregman teacher"),
], ids=["default", "accumulation", "pcgrad", "smart", "teacher"])
def test_a_step_that_needs_the_host_is_not_captured(tmp_path, tiny_backbone, tiny_tokenized, overrides, reason):
    run = cpu_run(tmp_path, tiny_backbone, tiny_tokenized, **overrides)
    blocker = capture_blocker(run)
    assert (blocker is None) if reason is None else blocker.startswith(reason)
    assert run.captured is None  # a CPU never captures, whatever runtime.capture says


def test_a_bi_encoder_batch_at_one_width_computes_what_two_widths_compute(tmp_path, dropout_free_backbone,
                                                                           tiny_tokenized):
    run = cpu_run(tmp_path, dropout_free_backbone, tiny_tokenized, heads={"sts": {"encoding": "bi"}})
    split = load_split(tiny_tokenized, tasks_from_params(run.params.tasks)["sts"], "train")
    lengths = split.tokens["input_ids_1"].lengths() - split.tokens["input_ids_2"].lengths()
    rows = torch.arange(len(split)).numpy()[lengths != 0][:4]  # sentences of unequal lengths
    batch = split.batch(rows, "bi")
    widened = one_width(batch)
    assert batch["input_ids_1"].shape[1] != batch["input_ids_2"].shape[1]
    assert widened["input_ids_1"].shape == widened["input_ids_2"].shape == widened["attention_mask_2"].shape
    run.model.eval()
    with torch.no_grad():
        assert torch.equal(run.model("sts", batch), run.model("sts", widened))


def test_the_moving_averages_device_update_follows_its_host_update():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    host, device = MovingAverage(model, 0.9, debiased=True), MovingAverage(model, 0.9, debiased=True)
    for _ in range(5):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter))
        host.update(model)
        device.update_on_device(model)
        device.count_update()
    assert int(host.averaged.n_averaged) == int(device.averaged.n_averaged) == 6
    for a, b in zip(host.model.parameters(), device.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    restored = MovingAverage(model, 0.9, debiased=True)
    restored.load_state_dict(device.state_dict())
    assert restored.device_count is None  # taken again from the restored count at the next update


def test_a_checkpoint_of_device_lrs_restores_numbers(tmp_path):
    """A run with captured steps saves each group's lr as a tensor; any run restores it as a number."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    optimizer.param_groups[0]["lr"] = torch.tensor(0.05)

    saved = SimpleNamespace(model=model.state_dict(), optimizer=optimizer.state_dict(),
                            scheduler=scheduler.state_dict(), ranks=[{"rng": {"torch": torch.get_rng_state()}}])
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    restore(saved, model, fresh, torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: 1.0), Ranks())
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.05) and isinstance(fresh.param_groups[0]["lr"], float)
    assert fresh.param_groups[0]["capturable"] is False
