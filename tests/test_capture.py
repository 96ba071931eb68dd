"""Captured steps (mtbert/training/capture.py): which runs can be captured, and the captured path itself.

The captured path runs here on whatever device this process has: in CI a CPU, where its recorder is the
stand-in `Reruns` (recording runs nothing, a replay runs the recorded `compute` again); on a GPU the real
CUDA graphs. Every line of capture.py but the CUDA calls runs in CI, so a drift between the captured path and
the step it records (a signature, what it passes, what it returns) fails CI, not the next run on a GPU."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mtbert.data.batches import load_split
from mtbert.data.tasks import tasks_from_params
from mtbert.params_file import variant_params, with_changes
from mtbert.training import finetune
from mtbert.training.capture import CapturedSteps, DeviceLrs, Reruns, capture_blocker, device_work, one_width
from mtbert.training.checkpoint import restore
from mtbert.training.distributed import Ranks
from mtbert.training.loop import Paths, TrainingError
from mtbert.training.step import compute
from tests.conftest import TASKS, make_params

WIDE = {"cpu": 64, "cuda": 64}  # every tiny batch one width: most steps are a shape seen before, so replayed


def run_paths(out: Path, tokenized: Path) -> Paths:
    return Paths(tokenized=tokenized, model_out=out / "m", metrics_out=out / "m.json", live_dir=out / "live",
                 checkpoints=out / "ck")


def started(out: Path, backbone: Path, tokenized: Path, captured: bool = False, **overrides):
    """The `train` stage's run of `base` (one epoch, dropout off, widths padded to 64), on this process's device;
    with `captured`, its device work captured: by CUDA graphs on a GPU, by the stand-in on a CPU."""
    out.mkdir(exist_ok=True)
    train, heads = {"epochs": 1, **overrides.pop("train", {})}, overrides.pop("heads", {})
    params = variant_params(make_params(out, backbone, Path("unused"), train=train,
                                       heads={task: {"dropout": 0.0, **heads.get(task, {})} for task in TASKS},
                                       runtime={"capture": {"cuda": captured}, "pad_to_multiple": WIDE},
                                       **overrides), "base")
    run, progress = finetune.start(params, "base", run_paths(out, tokenized))
    if captured and run.device.type == "cpu":
        run.compute = CapturedSteps(run, Reruns)
    assert isinstance(run.compute, CapturedSteps) == captured
    return run, progress


def test_the_captured_path_is_called_as_the_step_it_records():
    """`step` calls `run.compute` whichever it is; the captured path must take what `compute` takes."""
    def shape(function, skip: int = 0) -> list[tuple]:
        return [(p.name, p.kind, p.default) for p in list(inspect.signature(function).parameters.values())[skip:]]

    assert shape(CapturedSteps.__call__, skip=1) == shape(compute)  # less `self`


@pytest.mark.parametrize("overrides, reason", [
    ({}, None),
    ({"train": {"grad_accum": 2}}, "train.grad_accum > 1"),
    ({"train": {"sampler": "joint", "gradient": "pcgrad"}}, "PCGrad"),
    ({"smart": {"lambda": 1.0}}, "SMART and the Bregman teacher"),
    ({"smart": {"mu": 1.0}}, "SMART and the Bregman teacher"),
    ({"train": {"freeze_layers": 1}, "runtime": {"frozen_states": {"cpu": True, "cuda": True}}}, "the frozen layers"),
], ids=["default", "accumulation", "pcgrad", "smart", "teacher", "frozen-states"])
def test_a_step_that_needs_the_host_is_not_captured(tmp_path, tiny_backbone, tiny_tokenized, overrides, reason,
                                                    caplog):
    params = variant_params(make_params(tmp_path, tiny_backbone, Path("unused"), **overrides), "base")
    run, _ = finetune.start(params, "base", run_paths(tmp_path, tiny_tokenized))
    blocker = capture_blocker(run)
    assert (blocker is None) if reason is None else blocker.startswith(reason)
    if run.device.type == "cpu":
        assert run.compute is compute  # a CPU never captures, whatever runtime.capture says
        return
    with caplog.at_level(logging.INFO, logger="train"):  # a GPU captures unless something rules it out
        chosen = device_work(run)
    assert isinstance(chosen, CapturedSteps) == (reason is None)
    if reason is not None:
        assert f"captured steps off: {blocker}; the eager step runs" in caplog.text


def test_a_captured_run_trains_what_the_eager_run_trains(tmp_path, dropout_free_backbone, tiny_tokenized):
    """One epoch, most of its steps replayed (each step shape's first step is eager, its second recorded),
    against the eager run: on a CPU the stand-in computes exactly what the eager step computes, on a GPU CUDA
    graphs do to rounding. The moving average's device update rounds apart from the host's by an ulp."""
    runs = {}
    for captured in (False, True):
        run, progress = started(tmp_path / str(captured), dropout_free_backbone, tiny_tokenized, captured,
                                train={"ema": 0.998})
        runs[captured] = run, finetune.train(run, progress)
    (eager, eager_summary), (run, summary) = runs[False], runs[True]
    replayed = run.compute
    print(f"\n  {replayed.summary()}")
    assert replayed.graphs and replayed.replays > 0 and not replayed.failed
    assert replayed.replays + replayed.eager_steps == run.steps_per_epoch
    exact = run.device.type == "cpu"
    assert summary["epochs"][0]["examples"] == eager_summary["epochs"][0]["examples"]
    for task, loss in eager_summary["epochs"][0]["train_loss"].items():
        assert summary["epochs"][0]["train_loss"][task] == (loss if exact else pytest.approx(loss, rel=1e-4)), task
    for (name, a), b in zip(eager.model.state_dict().items(), run.model.state_dict().values(), strict=True):
        if exact:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=name)
    for a, b in zip(eager.average.model.parameters(), run.average.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert int(run.average.state_dict()["n_averaged"]) == int(eager.average.state_dict()["n_averaged"])


def replayed_losses(backbone: Path, out: Path, tokenized: Path) -> tuple[float, float]:
    """One recorded step replayed twice on the same batch from the same weights: its two losses."""
    run, progress = started(out, backbone, tokenized, captured=True)
    run.model.train()
    task = next(iter(run.tasks))
    for _ in range(20):  # a key's first step is eager, its second recorded
        if run.compute.graphs:
            break
        finetune.step(run, progress, (task,), ends_update=True)
    graph = next(iter(run.compute.graphs.values()))
    weights = [p.detach().clone() for p in run.model.parameters()]
    losses = []
    for _ in range(2):
        with torch.no_grad():
            for parameter, saved in zip(run.model.parameters(), weights, strict=True):
                parameter.copy_(saved)  # in place: the graph reads these very tensors
        run.compute.recorder.replay(graph.recorded)
        losses.append(float(graph.losses[0].task_loss))
    return losses[0], losses[1]


def test_each_replay_draws_new_dropout_masks_and_is_otherwise_the_same(tmp_path, tiny_backbone,
                                                                       dropout_free_backbone, tiny_tokenized):
    with_dropout = replayed_losses(tiny_backbone, tmp_path / "dropout", tiny_tokenized)
    without = replayed_losses(dropout_free_backbone, tmp_path / "none", tiny_tokenized)
    print(f"\n  two replays' losses: dropout on {with_dropout}, off {without}")
    assert with_dropout[0] != with_dropout[1]  # the generator moved on between replays
    assert without[0] == without[1]


def test_a_non_finite_loss_in_a_replayed_step_stops_the_run_naming_it(tmp_path, dropout_free_backbone,
                                                                      tiny_tokenized, monkeypatch):
    """The loss turns NaN inside the recorded step (a device value the loss multiplies by), at step 9."""
    run, progress = started(tmp_path, dropout_free_backbone, tiny_tokenized, captured=True)
    run.params = run.params.model_copy(update={"runtime": with_changes(run.params.runtime, check_every=1)})
    poison, real_losses, real_step = torch.ones((), device=run.device), dict(run.objective.losses), finetune.step
    monkeypatch.setattr(run.objective, "losses", {task: lambda outputs, batch, unit=unit: unit(outputs, batch) * poison
                                                  for task, unit in real_losses.items()})

    def step(run, progress, tasks, ends_update):
        if progress.step_in_epoch == 8:
            poison.fill_(float("nan"))
        real_step(run, progress, tasks, ends_update)

    monkeypatch.setattr(finetune, "step", step)
    with pytest.raises(TrainingError, match=r"non-finite (sst|qqp|sts) loss \(nan\) at epoch 1 step 9"):
        finetune.train(run, progress)
    assert run.compute.replays > 0


def test_a_bi_encoder_batch_at_one_width_computes_what_two_widths_compute(tmp_path, dropout_free_backbone,
                                                                           tiny_tokenized):
    run, _ = started(tmp_path, dropout_free_backbone, tiny_tokenized, heads={"sts": {"encoding": "bi"}})
    split = load_split(tiny_tokenized, tasks_from_params(run.params.tasks)["sts"], "train")
    lengths = split.tokens["input_ids_1"].lengths() - split.tokens["input_ids_2"].lengths()
    rows = torch.arange(len(split)).numpy()[lengths != 0][:4]  # sentences of unequal lengths
    batch = split.batch(rows, "bi")
    widened = one_width(batch)
    assert batch["input_ids_1"].shape[1] != batch["input_ids_2"].shape[1]
    assert widened["input_ids_1"].shape == widened["input_ids_2"].shape == widened["attention_mask_2"].shape
    run.model.eval()
    with torch.no_grad():
        on_device = {name: tensor.to(run.device) for name, tensor in batch.items()}
        assert torch.equal(run.model("sts", on_device),
                           run.model("sts", {name: tensor.to(run.device) for name, tensor in widened.items()}))


def test_the_lr_vector_is_read_while_recording_and_refilled_from_the_schedules_numbers():
    """What a CUDA graph's AdamW reads: each group's lr a view into one vector while a graph is recorded;
    outside, numbers, which the LR schedule sets and a refill copies into the vector before each replay."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.2}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    lrs = DeviceLrs(optimizer, torch.device("cpu"))
    assert all(group["capturable"] for group in optimizer.param_groups)
    with lrs.as_views():
        assert [group["lr"].data_ptr() for group in optimizer.param_groups] == \
               [lrs.values[0].data_ptr(), lrs.values[1].data_ptr()]
    assert [group["lr"] for group in optimizer.param_groups] == [0.1, 0.2]  # numbers again
    optimizer.step()  # (no gradients: nothing moves) before the schedule's step, as in training
    scheduler.step()
    lrs.refill()
    assert lrs.values.tolist() == pytest.approx([0.05, 0.1])


def test_a_checkpoint_of_device_lrs_restores_numbers(tmp_path):
    """Any checkpoint holding an lr as a tensor (as captured runs once saved) is restored as a number."""
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
