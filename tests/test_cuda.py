"""The CUDA paths CI cannot run, on the 2-layer backbone: bf16 autocast in train, pretrain and predict, the
data-parallel collectives on NCCL, the resume of a killed run (the CUDA generator's state), and captured
steps resumed after a kill (the rest of the captured path: tests/test_capture.py). Skipped
without a GPU (CI has none): run `pytest tests/test_cuda.py -s` where one is (docs/performance.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mtbert.evaluation.predictions import read_dump
from mtbert.params_file import load_params, variant_params
from mtbert.training import distributed
from mtbert.training.loop import Paths
from stages.pretrain import pretrain
from tests.conftest import REPO_ROOT, TASKS, attention_runs, kill_once_checkpointed, make_params, recorded_forwards
from tests.deployed import invoke
from tests.runs import result_of, run_training, train_command, train_summary
from tests.test_distributed import norm, weights, weights_of_backbone
from tests.test_pretrain import paths_in, pretrain_params
from tests.test_train import training_width

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FP32, BF16 = {(torch.float32, "cuda")}, {(torch.bfloat16, "cuda")}
EAGER = {"capture": {"cuda": False}}  # the eager step, as the captured one's reference (capture is on by default)


def linear_outputs():
    """The (dtype, device) of every nn.Linear output computed in the block: bf16 only where autocast ran."""
    return recorded_forwards(lambda module, output: (output.dtype, output.device.type)
                             if isinstance(module, torch.nn.Linear) else None)


def stage_paths(out: Path, tokenized: Path) -> Paths:
    """Variant `base` laid out under `out` as `python -m stages.train` lays it out (tests/runs.py reads it)."""
    return Paths(tokenized=tokenized, model_out=out / "models" / "base", metrics_out=out / "metrics" / "base.json",
                 live_dir=out / "metrics" / "base", checkpoints=out / "ck" / "base",
                 snapshots=out / "snapshots" / "base")


def train_in_process(out: Path, backbone: Path, tokenized: Path, **train) -> tuple[dict, set]:
    """One epoch of the `train` stage's run in this process; its summary and the Linear outputs seen."""
    params = make_params(out, backbone, Path("unused"), heads={task: {"dropout": 0.0} for task in TASKS},
                         train={"epochs": 1, **train}, runtime=EAGER)
    with linear_outputs() as seen:
        summary = train_summary(variant_params(params, "base"), "base", stage_paths(out, tokenized))
    return summary, seen


def assert_trained_alike(expected: Path, got: Path, backbone: Path) -> None:
    """Two one-epoch runs (stage layout) ended alike: bit for bit, or as close as tests/test_distributed.py
    has two trainings agree (nearly every weight within 1e-5, the difference a sliver of the training's
    change): CUDA kernels may add in another order from run to run, as use_deterministic_algorithms(True,
    warn_only=True) only warns of those with no deterministic version. Prints which it was."""
    a, b, start = weights(expected), weights(got), weights_of_backbone(backbone)
    assert a.keys() == b.keys()
    differing = sum(int(((a[k] - b[k]).abs() > 1e-5).sum()) for k in a) / sum(v.numel() for v in a.values())
    difference, change = norm({k: a[k] - b[k] for k in a}), norm({k: a[k] - start[k] for k in start})
    print(f"\n  bit for bit: {all(torch.equal(a[k], b[k]) for k in a)}; weights differing by > 1e-5: "
          f"{differing:.3%}; difference {difference:.3g} against a training change of {change:.3g}")
    assert differing < 0.005 and difference < 0.03 * change
    one, two = result_of(expected)["summary"], result_of(got)["summary"]
    assert [(e["examples"], e["task_batches"]) for e in one["epochs"]] == \
           [(e["examples"], e["task_batches"]) for e in two["epochs"]]
    assert two["dev"]["overall"] == pytest.approx(one["dev"]["overall"], abs=1e-3)


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory, dropout_free_backbone, tiny_tokenized) -> tuple[Path, dict, set]:
    """The reference: one epoch in fp32 on the GPU, dropout off (bf16 and NCCL runs are compared with it)."""
    out = tmp_path_factory.mktemp("fp32")
    return out, *train_in_process(out, dropout_free_backbone, tiny_tokenized)


# bf16 keeps 8 significant bits (0.4% per rounding): same weights give outputs a percent or two apart, and a
# dozen updates from the same start keep the losses within a few percent; a broken autocast gives NaN or far off.
def test_train_runs_bf16_autocast_on_the_gpu_close_to_fp32(tmp_path, fp32_run, dropout_free_backbone,
                                                           tiny_tokenized):
    _, reference, reference_seen = fp32_run
    summary, seen = train_in_process(tmp_path, dropout_free_backbone, tiny_tokenized, bf16="auto")
    assert (reference_seen, seen) == (FP32, BF16)  # `auto` chose bf16 on the GPU, and every layer ran in it
    assert (reference["speed"]["bf16"], summary["speed"]["bf16"]) == (False, True)
    losses = {task: (reference["epochs"][0]["train_loss"][task], loss)
              for task, loss in summary["epochs"][0]["train_loss"].items()}
    print(f"\n  train loss (fp32, bf16): {losses}; dev overall {reference['dev']['overall']:.4f}, "
          f"{summary['dev']['overall']:.4f}")
    assert all(bf16 == pytest.approx(fp32, rel=0.05) for fp32, bf16 in losses.values())
    assert np.isfinite(summary["dev"]["overall"])  # 16 dev rows of a barely trained model: no closer check


def test_static_shapes_on_the_gpu_pad_every_training_batch_and_train_what_unpadded_batches_train(
        tmp_path, dropout_free_backbone, tiny_tokenized):
    """runtime.pad_to_multiple.cuda (16 by default): every training batch a multiple of 16 wide, copied through
    pinned memory; with dropout off, the same losses as batches of their longest row's width."""
    summaries, widths = {}, {}
    for multiple in (1, 16):
        out = tmp_path / f"pad{multiple}"
        out.mkdir()
        params = make_params(out, dropout_free_backbone, Path("unused"), train={"epochs": 1},
                             heads={task: {"dropout": 0.0} for task in TASKS},
                             runtime={"pad_to_multiple": {"cuda": multiple}, **EAGER})
        with recorded_forwards(training_width) as widths[multiple]:
            summaries[multiple] = train_summary(variant_params(params, "base"), "base",
                                                stage_paths(out, tiny_tokenized))
    assert widths[16] and all(width % 16 == 0 for width in widths[16])
    assert any(width % 16 for width in widths[1])
    for task, loss in summaries[1]["epochs"][0]["train_loss"].items():
        assert summaries[16]["epochs"][0]["train_loss"][task] == pytest.approx(loss, rel=1e-3), task


def test_pretrain_runs_bf16_autocast_on_the_gpu_close_to_fp32(tmp_path, dropout_free_backbone, tiny_tokenized):
    runs = {}
    for bf16 in (False, "auto"):
        root = tmp_path / str(bf16)
        root.mkdir()
        params = load_params(pretrain_params(root, dropout_free_backbone, steps=8, eval_every=8, bf16=bf16))
        with linear_outputs() as seen:
            runs[bf16] = pretrain(params, paths_in(root, tiny_tokenized)), seen
    (fp32, fp32_seen), (bf16, bf16_seen) = runs[False], runs["auto"]
    assert (fp32_seen, bf16_seen) == (FP32, BF16)
    assert (fp32["speed"]["bf16"], bf16["speed"]["bf16"]) == (False, True)
    print(f"\n  held-out loss before, after (fp32): {fp32['before']['loss']:.4f}, {fp32['after']['loss']:.4f}; "
          f"(bf16): {bf16['before']['loss']:.4f}, {bf16['after']['loss']:.4f}")
    assert bf16["before"]["loss"] == pytest.approx(fp32["before"]["loss"], rel=0.02)  # the same weights
    assert bf16["after"]["loss"] == pytest.approx(fp32["after"]["loss"], rel=0.05)
    assert bf16["after"]["loss"] < bf16["before"]["loss"]


def test_predict_runs_bf16_autocast_on_the_gpu_close_to_fp32(tmp_path, fp32_run, dropout_free_backbone,
                                                             tiny_tokenized):
    seen = {}
    for bf16 in (False, "auto"):
        root = tmp_path / str(bf16)
        root.mkdir()
        params = make_params(root, dropout_free_backbone, Path("unused"), extra={"predict": {"bf16": bf16}})
        with linear_outputs() as seen[bf16]:
            invoke("stages.predict", "--variant", "base", "--params-file", params, "--tokenized-dir", tiny_tokenized,
                   "--rejects-file", tiny_tokenized.parent / "rejects.tsv", "--models-dir", fp32_run[0] / "models",
                   "--predictions-dir", root / "predictions", "--metrics-dir", root / "metrics")
    assert (seen[False], seen["auto"]) == (FP32, BF16)
    for task in TASKS.values():
        for split in ("dev", "test"):
            fp32_ids, fp32 = read_dump(tmp_path / "False" / "predictions" / "base", task, split)
            bf16_ids, bf16 = read_dump(tmp_path / "auto" / "predictions" / "base", task, split)
            print(f"\n  {task.name}-{split}: max |bf16 - fp32| {np.abs(bf16 - fp32).max():.3g}", end="")
            assert bf16_ids.tolist() == fp32_ids.tolist()
            np.testing.assert_allclose(bf16, fp32, rtol=0.03, atol=0.03)


class GroupOfOne(distributed.Ranks):
    """Rank 0 of a process group of one, taking the data-parallel code paths. `Ranks.distributed` is False
    for a single process (so `torchrun --nproc_per_node 1` starts no group at all), and one GPU cannot hold
    two NCCL ranks: this is how the all-reduces, broadcasts and gathers run on NCCL on a one-GPU machine."""
    distributed = True


def test_training_through_nccl_collectives_equals_the_plain_run(tmp_path, fp32_run, dropout_free_backbone,
                                                                tiny_tokenized, monkeypatch):
    devices, real_all_reduce = [], dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        devices.append(tensor.device.type)
        return real_all_reduce(tensor, *args, **kwargs)

    def init_ranks() -> GroupOfOne:  # what init_ranks does for a rank of torchrun's group, with world size 1
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        return GroupOfOne()

    monkeypatch.setattr(distributed, "init_ranks", init_ranks)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    try:
        summary, _ = train_in_process(tmp_path, dropout_free_backbone, tiny_tokenized)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"\n  {len(devices)} NCCL all-reduces", end="")
    assert devices and set(devices) == {"cuda"}  # every step's gradients went through NCCL
    assert summary["speed"]["processes"] == 1
    assert_trained_alike(fp32_run[0], tmp_path, dropout_free_backbone)


@pytest.mark.parametrize("ema", [0.0, 0.998], ids=["raw weights", "moving average"])
def test_a_killed_cuda_run_resumes_to_the_uninterrupted_result(tmp_path, tiny_backbone, tiny_tokenized, ema):
    # dropout on: the resumed run draws the same masks only from the checkpoint's CUDA generator state;
    # with the moving average on, the kept model is the average, restored from the checkpoint on the GPU
    params = make_params(tmp_path, tiny_backbone, Path("unused"), train={"epochs": 1, "ema": ema}, runtime=EAGER)
    run_training(params, tiny_tokenized, tmp_path / "a")
    command = train_command(params, tmp_path / "b", tiny_tokenized)
    kill_once_checkpointed(command, tmp_path / "b" / "ck" / "base" / "last.pt")  # at update 3 of 12
    assert not (tmp_path / "b" / "metrics" / "base.json").exists()
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True)
    assert_trained_alike(tmp_path / "a", tmp_path / "b", tiny_backbone)
    assert not (tmp_path / "b" / "ck" / "base").exists()


def test_a_gpu_trains_with_the_fused_attention_kernel(tmp_path, tiny_backbone, tiny_tokenized):
    # a CPU trains with eager attention (sdpa has no CPU kernel with dropout, tests/test_arch.py); CUDA's
    # fused kernels take attention dropout, so the stage's training passes on a GPU keep sdpa
    with attention_runs() as seen:
        train_in_process(tmp_path, tiny_backbone, tiny_tokenized)
    assert {implementation for training, implementation in seen if training} == {"sdpa"}


# --- captured steps (runtime.capture.cuda, mtbert/training/capture.py) ----------------------------------------
# Replays against eager, dropout across replays, a non-finite loss and what rules capture out are in
# tests/test_capture.py, which runs them on this GPU's CUDA graphs and in CI on the CPU stand-in. What needs a
# GPU alone: a killed captured run resumed by the stage (the CUDA generator's state, graphs recorded anew).
@pytest.mark.parametrize("ema", [0.0, 0.998], ids=["raw weights", "moving average"])
def test_a_killed_captured_run_resumes_to_the_uninterrupted_result(tmp_path, tiny_backbone, tiny_tokenized, ema):
    """Dropout on; the resumed process captures its graphs anew (each shape's first step eager again)."""
    params = make_params(tmp_path, tiny_backbone, Path("unused"), train={"epochs": 1, "ema": ema},
                         runtime={"capture": {"cuda": True}})
    run_training(params, tiny_tokenized, tmp_path / "a")
    command = train_command(params, tmp_path / "b", tiny_tokenized)
    kill_once_checkpointed(command, tmp_path / "b" / "ck" / "base" / "last.pt")
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True)
    assert_trained_alike(tmp_path / "a", tmp_path / "b", tiny_backbone)
