"""Data-parallel training: 2 gloo processes on CPU against 1 process with the same global batch."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from mtbert.training.distributed import Ranks, shard
from tests.conftest import REPO_ROOT, TASKS, kill_once_checkpointed, make_params

pytestmark = pytest.mark.slow(reason="torchrun with two processes against one")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shards_are_disjoint_and_cover_the_global_batch(world_size):
    rows = np.random.default_rng(0).permutation(37)[:10]
    shards = [shard(rows, Ranks(rank=r, world_size=world_size)) for r in range(world_size)]
    together = np.concatenate(shards)
    assert len(together) == len(set(together.tolist())) == len(rows)
    assert set(together.tolist()) == set(rows.tolist())


def train_command(tmp_path: Path, backbone: Path, tokenized: Path, nproc: int, checkpoint_every: int = 3,
                  **train) -> list[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    no_dropout = {task: {"dropout": 0.0} for task in TASKS}
    params = make_params(tmp_path, backbone, Path("unused"), heads=no_dropout,
                         train={"nproc": nproc, "epochs": 1, **train},
                         runtime={"threads": nproc, "checkpoint_every": {"train": checkpoint_every}})
    out = tmp_path / "out"
    # nproc > 1: the stage relaunches itself through torchrun, as under `dvc repro`
    return [sys.executable, "-m", "stages.train", "--variant", "base", "--params-file", str(params),
            "--tokenized-dir", str(tokenized), "--pretrained-dir", str(backbone),
            "--models-dir", str(out / "models"), "--metrics-dir", str(out / "metrics"),
            "--checkpoints-dir", str(out / "ck"), "--snapshots-dir", str(out / "snapshots")]


def run_stage(command: list[str]) -> None:
    """Run a stage; on failure, show the end of its log (a CalledProcessError alone hides it)."""
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-4000:]}"


def train(tmp_path: Path, backbone: Path, tokenized: Path, nproc: int, **train) -> Path:
    run_stage(train_command(tmp_path, backbone, tokenized, nproc, **train))
    return tmp_path / "out"


def weights(out: Path) -> dict[str, torch.Tensor]:
    model = out / "models" / "base" / "epoch-1"  # one epoch
    encoder = load_file(str(model / "encoder" / "model.safetensors"))
    heads = load_file(str(model / "heads.safetensors"))
    return {**{f"encoder.{k}": v for k, v in encoder.items()}, **{f"heads.{k}": v for k, v in heads.items()}}


def weights_of_backbone(backbone: Path) -> dict[str, torch.Tensor]:
    return {f"encoder.{k}": v for k, v in load_file(str(backbone / "model.safetensors")).items()}


def norm(tensors: dict[str, torch.Tensor]) -> float:
    return sum(float((t.double() ** 2).sum()) for t in tensors.values()) ** 0.5


@pytest.mark.parametrize("train_overrides", [{}, {"sampler": "joint", "gradient": "pcgrad"}],
                         ids=["plain", "pcgrad"])
def test_two_gloo_processes_match_one_process_with_the_same_global_batch(tmp_path, dropout_free_backbone,
                                                                           tiny_tokenized, train_overrides):
    one = train(tmp_path / "one", dropout_free_backbone, tiny_tokenized, 1, **train_overrides)
    two = train(tmp_path / "two", dropout_free_backbone, tiny_tokenized, 2, **train_overrides)
    single, double = weights(one), weights(two)
    assert single.keys() == double.keys()
    # Summing the ranks' gradients rounds differently from one big batch. Adam's first updates are
    # about lr * sign(gradient), so where a gradient is ~0 that rounding can flip a step of size lr:
    # hence "equal" is: nearly every weight within 1e-5, and the difference a sliver of the training's change.
    start = weights_of_backbone(dropout_free_backbone)
    differing = sum(int(((single[k] - double[k]).abs() > 1e-5).sum()) for k in single)
    assert differing / sum(v.numel() for v in single.values()) < 0.005
    difference = norm({k: single[k] - double[k] for k in single})
    change = norm({k: single[k] - start[k] for k in start})
    assert difference < 0.03 * change, f"difference {difference:.3g} against a training change of {change:.3g}"
    summary_one = json.loads((one / "metrics" / "base.json").read_text())
    summary_two = json.loads((two / "metrics" / "base.json").read_text())
    assert summary_two["speed"]["processes"] == 2 and summary_one["speed"]["processes"] == 1
    # the ranks' examples add up to the 1-process count: each example of a global batch went to one rank
    assert summary_two["epochs"][0]["examples"] == summary_one["epochs"][0]["examples"] == 3 * 16
    assert summary_two["epochs"][0]["task_batches"] == summary_one["epochs"][0]["task_batches"]
    assert summary_two["dev"]["overall"] == pytest.approx(summary_one["dev"]["overall"], abs=1e-3)
    # one set of outputs: the main rank's, and no leftovers
    assert sorted(p.name for p in (two / "metrics").iterdir()) == ["base", "base.json"]
    assert sorted(p.name for p in (two / "models").iterdir()) == ["base"]
    assert not (two / "ck" / "base").exists()  # the resume checkpoint is removed at the end


def test_a_killed_two_process_run_resumes_to_the_uninterrupted_result(tmp_path, dropout_free_backbone,
                                                                       tiny_tokenized):
    settings = {"epochs": 2, "checkpoint_every": 2}
    uninterrupted = weights(train(tmp_path / "a", dropout_free_backbone, tiny_tokenized, 2, **settings))
    command = train_command(tmp_path / "b", dropout_free_backbone, tiny_tokenized, 2, **settings)
    checkpoint = tmp_path / "b" / "out" / "ck" / "base" / "last.pt"
    kill_once_checkpointed(command, checkpoint)
    # torchrun starts its workers in sessions of their own: they must die with it, not train on
    assert wait_until_gone(str(tmp_path / "b" / "params.yaml")) == []
    assert not (tmp_path / "b" / "out" / "metrics" / "base.json").exists()
    run_stage(command)
    resumed = weights(tmp_path / "b" / "out")
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)


def wait_until_gone(marker: str, timeout: float = 10.0) -> list[int]:
    """The pids of processes whose command line contains `marker`, once none are left or time is up."""
    deadline = time.time() + timeout
    while True:
        alive = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    alive.append(int(entry.name))
            except OSError:  # the process ended while we looked
                continue
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


def pretrain(tmp_path: Path, backbone: Path, tokenized: Path, nproc: int) -> dict[str, torch.Tensor]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    params_file = make_params(tmp_path, backbone, Path("unused"))
    params = yaml.safe_load(params_file.read_text())
    params["pretrain"].update(enabled=True, steps=6, batch_size=8, lr=1e-3, eval_every=3,
                              eval_examples=0, bucket_batches=2, nproc=nproc)
    params["runtime"].update({"threads": nproc, "checkpoint_every": {"train": 3, "pretrain": 3}})
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run([sys.executable, "-m", "stages.pretrain", "--params-file", str(params_file),
                    "--tokenized-dir", str(tokenized), "--out-dir", str(tmp_path / "pretrained"),
                    "--metrics-file", str(tmp_path / "pretrain.json"), "--live-dir", str(tmp_path / "live"),
                    "--checkpoints-dir", str(tmp_path / "ck")], cwd=REPO_ROOT, check=True, capture_output=True)
    summary = json.loads((tmp_path / "pretrain.json").read_text())
    assert summary["speed"]["processes"] == nproc
    return load_file(str(tmp_path / "pretrained" / "model.safetensors"))


def test_two_process_masked_lm_matches_one_process(tmp_path, dropout_free_backbone, tiny_tokenized):
    one = pretrain(tmp_path / "one", dropout_free_backbone, tiny_tokenized, 1)
    two = pretrain(tmp_path / "two", dropout_free_backbone, tiny_tokenized, 2)
    start = load_file(str(dropout_free_backbone / "model.safetensors"))
    difference = norm({k: one[k] - two[k] for k in one})
    change = norm({k: one[k] - start[k] for k in one})
    assert difference < 0.03 * change, f"difference {difference:.3g} against a training change of {change:.3g}"
    # one set of outputs, and the resume checkpoint gone
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["live", "params.yaml", "pretrain.json",
                                                                     "pretrained"]
