"""Training end to end on a 2-layer slice of the real backbone: resume after kill -9, determinism, NaN guard."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from mtbert.params_file import variant_params, with_changes
from mtbert.training import finetune
from mtbert.training.averaging import MovingAverage, NoAverage
from mtbert.training.loop import FiniteWatch, Paths, TrainingError
from mtbert.training.losses import Objective
from mtbert.training.pcgrad import PCGrad
from mtbert.training.progress import FineTuningCheckpoint, Progress
from mtbert.training.smart import Regularised
from mtbert.training.step import Summed, compute
from tests.conftest import REPO_ROOT, kill_once_checkpointed, make_params, module_folder, recorded_forwards, saved_heads
from tests.runs import prepared, result_of, run_training, train_command, train_summary


@pytest.fixture(scope="module")
def training_params(tmp_path_factory, tiny_backbone) -> Path:
    return make_params(tmp_path_factory.mktemp("params"), tiny_backbone, Path("unused"))


@pytest.fixture(scope="module")
def uninterrupted(request, tmp_path_factory, training_params, tiny_tokenized) -> dict:
    return run_training(training_params, tiny_tokenized, module_folder(request, tmp_path_factory, "run_a"))


@pytest.mark.slow(reason="trains twice")
def test_same_params_and_seed_give_identical_metrics(tmp_path, training_params, tiny_tokenized, uninterrupted):
    again = run_training(training_params, tiny_tokenized, tmp_path)
    assert again == uninterrupted
    # An epoch is one pass worth of batches: 16 examples / batch 4 = 4 per task, 12 in all.
    assert sum(uninterrupted["summary"]["epochs"][0]["task_batches"].values()) == 12


@pytest.mark.slow(reason="trains twice, one run killed with SIGKILL")
def test_resume_after_kill_9_equals_an_uninterrupted_run(tmp_path, training_params, tiny_tokenized,
                                                         uninterrupted):
    command = train_command(training_params, tmp_path, tiny_tokenized)
    checkpoint = tmp_path / "ck" / "base" / "last.pt"
    kill_once_checkpointed(command, checkpoint)
    assert not (tmp_path / "metrics" / "base.json").exists()
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True)
    assert result_of(tmp_path) == uninterrupted
    assert not (tmp_path / "ck" / "base").exists()  # removed once the run is complete


@pytest.mark.slow(reason="a real process that imports transformers")
def test_model_folder_reloads_with_transformers(tmp_path, training_params, tiny_tokenized, uninterrupted):
    from transformers import AutoModel, AutoTokenizer
    run = tmp_path / "reload"
    run_training(training_params, tiny_tokenized, run)
    folder = run / "models" / "base"
    config = json.loads((folder / "mtbert.json").read_text())
    assert config["variant"] == "base" and config["params"]["train"]["epochs"] == 2
    for epoch in set(config["task_epochs"].values()):
        encoder = folder / f"epoch-{epoch}" / "encoder"
        assert AutoModel.from_pretrained(encoder).config.num_hidden_layers == 2
        assert AutoTokenizer.from_pretrained(encoder)("a film")["input_ids"][0] == 101


@pytest.mark.parametrize("changes", [{}, {"train": {"sampler": "joint", "gradient": "pcgrad"}}, {"smart": {"mu": 1.0}},
                                     {"train": {"ema": 0.0}}], ids=["default", "pcgrad", "teacher", "no-average"])
def test_the_default_step_is_backward_adamw_and_the_average_and_the_params_add_the_rest(tmp_path, tiny_backbone,
                                                                                        tiny_tokenized, changes):
    """What `prepare` chooses for the step: by default summed gradients, the plain objective, the moving average
    and the eager device work; PCGrad, the Bregman teacher and train.ema: 0 change only their own piece."""
    params = variant_params(make_params(tmp_path, tiny_backbone, Path("unused"), **changes), "base")
    run = prepared(params, Paths(tokenized=tiny_tokenized, model_out=tmp_path / "m", metrics_out=tmp_path / "m.json",
                                 live_dir=tmp_path / "live", checkpoints=tmp_path / "ck")).run
    assert type(run.gradients) is (PCGrad if params.train.gradient == "pcgrad" else Summed)  # one process
    assert type(run.objective) is (Regularised if params.smart.mu > 0 else Objective)
    assert type(run.average) is (MovingAverage if params.train.ema > 0 else NoAverage)
    assert run.compute is compute  # a CPU never captures


@pytest.mark.parametrize("check_every", [1, 50])  # every step, or only before the checkpoint after update 6
def test_non_finite_loss_stops_naming_step_and_task(tmp_path, training_params, tiny_tokenized, monkeypatch,
                                                    check_every):
    params = variant_params(training_params, "base")
    params = params.model_copy(update={"runtime": with_changes(params.runtime, check_every=check_every)})
    paths = Paths(tokenized=tiny_tokenized, model_out=tmp_path / "m", metrics_out=tmp_path / "m.json",
                  live_dir=tmp_path / "live", checkpoints=tmp_path / "ck")
    prepared_run = prepared(params, paths)
    objective = prepared_run.run.objective
    real_losses = dict(objective.losses)
    calls = {"n": 0}

    def poisoned(task):
        def loss(outputs, batch):
            calls["n"] += 1
            value = real_losses[task](outputs, batch)
            return value * float("nan") if calls["n"] == 5 else value
        return loss

    monkeypatch.setattr(objective, "losses", {task: poisoned(task) for task in real_losses})
    with pytest.raises(TrainingError, match=r"non-finite (sst|qqp|sts) loss \(nan\) at epoch 1 step 5"):
        prepared_run.train()
    saved = torch.load(tmp_path / "ck" / "last.pt", weights_only=False)
    assert json.loads(saved["progress"])["updates"] == 3  # written after update 3, before the bad step
    assert not (tmp_path / "m.json").exists()


def test_the_finite_watch_reads_every_pending_loss_at_once_and_names_the_first_bad_one(tmp_path):
    watch = FiniteWatch(tmp_path, "Lower train.lr.")
    watch.add(torch.tensor(0.5), "sst loss", "at step 1")
    watch.check()
    assert watch.pending == []
    for value, where in ((0.25, "at step 2"), (float("inf"), "at step 3"), (float("nan"), "at step 4")):
        watch.add(torch.tensor(value, dtype=torch.bfloat16), "qqp loss", where)
    with pytest.raises(TrainingError, match=rf"^non-finite qqp loss \(inf\) at step 3; the last good checkpoint is "
                                            rf"kept in {tmp_path}\. Lower train.lr\.$"):
        watch.check()


def test_bf16_autocast_trains_on_cpu(tmp_path, tiny_backbone, tiny_tokenized):
    """`train.bf16: true` runs every Linear of the training and its dev passes in bf16 on a CPU too, and the
    summary says so (tests/test_cuda.py checks the same on a GPU); were the flag ignored, this would fail. One
    batch of each task: a CPU without bf16 units (the AVX2 EPYC) emulates it, slowly."""
    params_file = make_params(tmp_path, tiny_backbone, Path("unused"),
                              train={"bf16": True, "epochs": 1, "max_train_examples": {"sst": 4, "qqp": 4, "sts": 4}})
    paths = Paths(tokenized=tiny_tokenized, model_out=tmp_path / "m", metrics_out=tmp_path / "m.json",
                  live_dir=tmp_path / "live", checkpoints=tmp_path / "ck")
    with recorded_forwards(lambda module, output: output.dtype if isinstance(module, torch.nn.Linear) else None) \
            as dtypes:
        summary = train_summary(variant_params(params_file, "base"), "base", paths)
    assert dtypes == {torch.bfloat16}
    assert summary["speed"]["bf16"] is True
    assert all(np.isfinite(loss) for loss in summary["epochs"][0]["train_loss"].values())
    assert -1.0 <= summary["dev"]["sts"]["pearson"] <= 1.0


def test_static_shapes_pad_every_training_batch_and_change_nothing_but_dropout(tmp_path, dropout_free_backbone,
                                                                               tiny_tokenized):
    """runtime.pad_to_multiple: every training batch is a multiple of it wide; with dropout off, the padded run
    trains the same network as the unpadded one, because the padding is masked out."""
    summaries, widths = {}, {}
    for multiple in (1, 16):
        root = tmp_path / f"pad{multiple}"
        root.mkdir()
        params_file = make_params(root, dropout_free_backbone, Path("unused"), train={"epochs": 1},
                                  runtime={"pad_to_multiple": {"cpu": multiple}})
        with recorded_forwards(training_width) as seen:
            params = variant_params(params_file, "base")
            summaries[multiple] = train_summary(params, "base", run_paths(root, tiny_tokenized))
        widths[multiple] = seen
    assert widths[16] and all(width % 16 == 0 for width in widths[16])
    assert any(width % 16 for width in widths[1])  # the data has batches that the rule pads
    for task, loss in summaries[1]["epochs"][0]["train_loss"].items():
        assert summaries[16]["epochs"][0]["train_loss"][task] == pytest.approx(loss, rel=1e-4), task
    # the dev pass pads to the same multiple: float rounding only, which a 16-row Pearson magnifies
    assert summaries[16]["dev"]["overall"] == pytest.approx(summaries[1]["dev"]["overall"], abs=1e-3)


def training_width(module: torch.nn.Module, output: torch.Tensor) -> int | None:
    """The width (tokens) of a training batch, seen at the embeddings' output."""
    return output.shape[1] if module.training and type(module).__name__ == "BertEmbeddings" else None


def run_paths(root: Path, tokenized: Path) -> Paths:
    return Paths(tokenized=tokenized, model_out=root / "model", metrics_out=root / "metrics.json",
                 live_dir=root / "live", checkpoints=root / "ck", snapshots=root / "snapshots")


def uninterrupted_and_resumed(params, tokenized: Path, tmp_path: Path, monkeypatch) -> tuple[dict, dict]:
    """Summaries (less `speed`) of a run in tmp_path/a and of one in tmp_path/b that crashed after update 5
    (past the checkpoint at update 3, mid-epoch) and was started again."""
    uninterrupted = train_summary(params, "base", run_paths(tmp_path / "a", tokenized))
    real_step = finetune.step

    def step_then_crash(run, progress, tasks, ends_update):
        real_step(run, progress, tasks, ends_update)
        if progress.updates == 5:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(finetune, "step", step_then_crash)
        with pytest.raises(KeyboardInterrupt):
            train_summary(params, "base", run_paths(tmp_path / "b", tokenized))
    resumed = train_summary(params, "base", run_paths(tmp_path / "b", tokenized))
    for summary in (uninterrupted, resumed):
        summary.pop("speed")
    return uninterrupted, resumed


def assert_saved_model_reproduces_its_dumps(root: Path, tokenized: Path, batch_size: int) -> dict:
    """The model folder under root predicts dev bit for bit as its kept epochs' snapshot dumps; its summary."""
    from mtbert.data.batches import load_split
    from mtbert.evaluation.evaluate import predict_split
    from mtbert.evaluation.predictions import read_dump
    from mtbert.model.saved import load_model

    model, config = load_model(root / "model")
    for task_name, epoch in config["task_epochs"].items():
        split = load_split(tokenized, model.tasks[task_name], "dev")
        values = predict_split(model, split, batch_size, torch.device("cpu"))
        snapshot_ids, snapshot = read_dump(root / "snapshots" / f"epoch-{epoch}", model.tasks[task_name], "dev")
        assert snapshot_ids.tolist() == split.ids.tolist()
        assert np.array_equal(values, snapshot), task_name  # bit for bit
    return config


@pytest.mark.slow(reason="trains twice, one run crashed")
def test_smart_and_teacher_resume_after_a_crash_like_an_uninterrupted_run(tmp_path, tiny_backbone, tiny_tokenized,
                                                                          monkeypatch):
    params_file = make_params(tmp_path, tiny_backbone, Path("unused"), heads={"sts": {"encoding": "bi"}},
                              smart={"lambda": 1.0, "task_lambda": {"qqp": 0.0, "sts": None}, "mu": 1.0,
                                     "beta": 0.9, "mode": "adversarial", "radius": 0.1})
    params = variant_params(params_file, "base")
    uninterrupted, resumed = uninterrupted_and_resumed(params, tiny_tokenized, tmp_path, monkeypatch)
    assert resumed == uninterrupted
    regularisers = uninterrupted["epochs"][0]["regularisers"]
    assert set(regularisers) == {"sst/smart_loss", "sst/delta_ratio", "sst/delta_l2_ratio", "sst/ascended",
                                 "sts/smart_loss", "sts/delta_ratio", "sts/delta_l2_ratio", "sts/ascended",
                                 "sst/bregman_loss", "qqp/bregman_loss", "sts/bregman_loss"}
    assert 0 < regularisers["sst/delta_ratio"] < 1
    assert saved_heads(tmp_path / "a" / "model") == saved_heads(tmp_path / "b" / "model")


@pytest.mark.slow(reason="several epochs of training")
def test_each_task_keeps_its_best_epoch_and_the_saved_model_reproduces_its_predictions(tmp_path, tiny_backbone,
                                                                                      tiny_tokenized):
    params_file = make_params(tmp_path, tiny_backbone, Path("unused"), train={"epochs": 3, "lr": 3e-4,
                                                                             "snapshot_test": True})
    params = variant_params(params_file, "base")
    for leftover in (tmp_path / "ck" / "snapshots" / "epoch-7", tmp_path / "ck" / "epochs" / "epoch-7"):
        leftover.mkdir(parents=True)  # as a killed run with other params would leave them
    summary = train_summary(params, "base", run_paths(tmp_path, tiny_tokenized))
    for task, epoch in summary["task_epochs"].items():  # the epoch of the task's best dev headline
        scores = [record["dev"][task][params.tasks[task].metric] for record in summary["epochs"]]
        assert epoch == scores.index(max(scores)) + 1
    assert json.loads((tmp_path / "snapshots" / "chosen.json").read_text()) == summary["task_epochs"]
    assert sorted(p.name for p in (tmp_path / "snapshots").glob("epoch-*")) == ["epoch-1", "epoch-2", "epoch-3"]
    assert all(len(list(folder.glob("*-test.parquet"))) == 3 for folder in (tmp_path / "snapshots").glob("epoch-*"))
    assert sorted(p.name for p in (tmp_path / "model").glob("epoch-*")) == sorted(
        {f"epoch-{e}" for e in summary["task_epochs"].values()})
    config = assert_saved_model_reproduces_its_dumps(tmp_path, tiny_tokenized, params.train.eval_batch_size)
    assert config["task_epochs"] == summary["task_epochs"]


@pytest.mark.slow(reason="trains twice, one run crashed")
def test_the_moving_average_is_the_model_kept_and_resumes_like_an_uninterrupted_run(tmp_path, tiny_backbone,
                                                                                    tiny_tokenized, monkeypatch):
    params = variant_params(make_params(tmp_path, tiny_backbone, Path("unused"),
                                        train={"ema": 0.5, "lr": 3e-4, "dev_raw": True}), "base")
    uninterrupted, resumed = uninterrupted_and_resumed(params, tiny_tokenized, tmp_path, monkeypatch)
    assert resumed == uninterrupted
    assert saved_heads(tmp_path / "a" / "model") == saved_heads(tmp_path / "b" / "model")

    # With train.dev_raw every epoch logs the raw weights beside the average, and the two differ.
    epochs = uninterrupted["epochs"]
    assert all(set(record["dev_raw"]) == set(record["dev"]) for record in epochs)
    assert any(record["dev_raw"]["sts"]["pearson"] != record["dev"]["sts"]["pearson"] for record in epochs)
    # What was dumped and kept is the average: the saved model reproduces its epoch's dumps.
    assert_saved_model_reproduces_its_dumps(tmp_path / "a", tiny_tokenized, params.train.eval_batch_size)
    for task_name, epoch in uninterrupted["task_epochs"].items():
        assert uninterrupted["dev"][task_name] == epochs[epoch - 1]["dev"][task_name]


def test_a_checkpoint_of_another_layout_is_ignored_like_one_of_other_params(tmp_path, caplog):
    from mtbert.training.checkpoint import load_checkpoint

    old_layout = tmp_path / "last.pt"  # as mtbert's loop before the typed checkpoint wrote it, same fingerprint
    torch.save({"fingerprint": "same", "model": {}, "optimizer": {}, "scheduler": {}, "ranks": [],
                "history": "[]", "running": "{}", "train_seconds": 1.0, "loop": {}}, old_layout)
    assert load_checkpoint(tmp_path, FineTuningCheckpoint, Progress, "same") is None
    assert "holds no FineTuningCheckpoint" in caplog.text
    assert old_layout.is_file()  # left where it was: it is readable, so it is not set aside


@pytest.fixture(scope="module")
def smart_ema_params(tmp_path_factory, tiny_backbone) -> Path:
    """SMART (adversarial, with the Bregman teacher) and the weights' moving average together: every piece
    of state a checkpoint carries beyond the plain loop's."""
    return make_params(tmp_path_factory.mktemp("smart_ema"), tiny_backbone, Path("unused"),
                       heads={"sts": {"encoding": "bi"}}, train={"ema": 0.5, "lr": 3e-4, "epochs": 1},
                       smart={"lambda": 1.0, "task_lambda": {"qqp": 0.0, "sts": None}, "mu": 1.0, "beta": 0.9,
                              "mode": "adversarial", "radius": 0.1})


@pytest.mark.slow(reason="trains twice, one run killed with SIGKILL")
def test_smart_and_moving_average_resume_after_kill_9_like_an_uninterrupted_run(tmp_path, smart_ema_params,
                                                                               tiny_tokenized):
    uninterrupted = run_training(smart_ema_params, tiny_tokenized, tmp_path / "a")
    command = train_command(smart_ema_params, tmp_path / "b", tiny_tokenized)
    checkpoint = tmp_path / "b" / "ck" / "base" / "last.pt"
    kill_once_checkpointed(command, checkpoint)
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True)
    assert result_of(tmp_path / "b") == uninterrupted
    assert "sst/smart_loss" in uninterrupted["summary"]["epochs"][0]["regularisers"]
    # train.dev_raw and train.snapshot_test are off: the epoch's end was one dev pass of the average, its dumps dev
    assert not any("dev_raw" in record for record in uninterrupted["summary"]["epochs"])
    assert sorted(path.name for path in (tmp_path / "a" / "snapshots" / "base" / "epoch-1").iterdir()) == [
        "qqp-dev.parquet", "sst-dev.parquet", "sts-dev.parquet"]


@pytest.mark.slow(reason="trains twice, one run crashed")
def test_round_robin_smallest_trains_every_task_the_smallest_tasks_batches_and_resumes(tmp_path, tiny_backbone,
                                                                                      tiny_tokenized, monkeypatch):
    # SST cut to 8 rows: 2 batches of 4 per epoch for every task (QQP and STS have 4), 6 steps per epoch
    params = variant_params(make_params(tmp_path, tiny_backbone, Path("unused"), train={
        "sampler": "round_robin_smallest", "max_train_examples": {"sst": 8}}), "base")
    uninterrupted, resumed = uninterrupted_and_resumed(params, tiny_tokenized, tmp_path, monkeypatch)
    assert resumed == uninterrupted  # the crash came mid-epoch 1, after the checkpoint at update 3
    assert [record["task_batches"] for record in uninterrupted["epochs"]] == [{"sst": 2, "qqp": 2, "sts": 2}] * 2
    assert [record["examples"] for record in uninterrupted["epochs"]] == [24, 24]
    run = prepared(params, run_paths(tmp_path / "c", tiny_tokenized)).run
    decay = run.scheduler.lr_lambdas[0]  # linear: reaches 0 at the schedule's last update, 2 epochs of 6 steps
    assert run.steps_per_epoch == 6 and decay(11) > 0 and decay(12) == 0
