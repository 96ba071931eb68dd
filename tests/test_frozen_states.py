"""The frozen bottom computed once per row (train.freeze_layers, runtime.frozen_states): the layers above its
saved states give the whole encoder's output, a run with them trains the same network without running the
bottom in its steps, and the saved states are reused only where their record says they are this run's."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from mtbert.data.batches import load_split
from mtbert.data.tasks import tasks_from_params
from mtbert.evaluation.evaluate import predict_split
from mtbert.evaluation.predictions import read_dump
from mtbert.model.backbone import load_encoder, load_tokenizer
from mtbert.model.dropout import without_dropout_where_frozen
from mtbert.model.frozen import ReleasedBottom, bottom_states, bottom_weights
from mtbert.model.multitask import MultitaskModel
from mtbert.model.saved import load_model
from mtbert.params_file import variant_params
from mtbert.runtime import UnreadableInputError
from mtbert.training import frozen_states
from mtbert.training.averaging import MovingAverage
from mtbert.training.checkpoint import own_where_released, tensor_bytes
from mtbert.training.frozen_states import states_depth, with_frozen_states
from tests.conftest import make_params, saved_heads
from tests.runs import train_summary
from tests.test_train import run_paths, uninterrupted_and_resumed


def model_of(tmp_path: Path, backbone: Path, arch: str = "cerbertus", sts: dict | None = None, **changes):
    """A 2-layer model as `train` builds it from make_params' params (changes: make_params' keyword arguments)."""
    params = variant_params(make_params(tmp_path, backbone, Path("unused"), model={"arch": arch, "task_layers": 1},
                                        heads={"sts": sts or {}}, **changes), "base")
    model = MultitaskModel(load_encoder(str(backbone)), tasks_from_params(params.tasks), params.heads, arch, 1)
    return model, params


def layer_calls(layer: torch.nn.Module) -> list:
    calls = []
    layer.register_forward_hook(lambda module, args, output: calls.append(module.training))
    return calls


@pytest.mark.parametrize("sts", [{"encoding": "cross"}, {"encoding": "bi", "combine": "cosine"}])
def test_the_layers_above_the_saved_states_give_the_whole_encoders_output(tmp_path, family_backbone, sts):
    """Each family (BERT, and MPNet with its relative-position bias), one sentence and a pair read both ways: the
    output from the bottom layer's states equals the whole encoder's, the bottom layer does not run, and the
    states are what the output is computed from."""
    model, _ = model_of(tmp_path, family_backbone, sts=sts)
    model.eval()
    model.states_depth = 1
    pad = model.family.pad_id
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (3, 7))
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 3 + [0] * 4])
    ids[mask == 0] = pad
    types = model.family.encoder_inputs(torch.zeros_like(ids))
    bottom = model.encoder.encoder.layer[0]
    calls = layer_calls(bottom)
    with torch.no_grad():
        states = bottom_states(model.encoder, 1, ids, mask, **types)
        batches = {"sst": ({"input_ids": ids, "attention_mask": mask, **types}, {"states": states})}
        if sts["encoding"] == "bi":  # the second sentences: others, narrower
            ids_2, mask_2 = torch.randint(5, 1000, (3, 5)), mask[[2, 0, 1], :5]
            ids_2[mask_2 == 0] = pad
            states_2 = bottom_states(model.encoder, 1, ids_2, mask_2, **model.family.encoder_inputs(None))
            batches["sts"] = ({"input_ids_1": ids, "attention_mask_1": mask, "input_ids_2": ids_2,
                               "attention_mask_2": mask_2}, {"states_1": states, "states_2": states_2})
        else:
            batches["sts"] = batches["sst"]
        for task, (batch, saved) in batches.items():
            whole = model(task, batch)
            calls.clear()
            from_states = model(task, {**batch, **saved})
            assert not calls, task  # the bottom layer did not run
            torch.testing.assert_close(from_states, whole, rtol=1e-5, atol=1e-5)
            moved = model(task, {**batch, **{key: value + 1.0 for key, value in saved.items()}})
            assert not torch.allclose(moved, whole, atol=1e-3), task  # read from the states, not recomputed
        model.states_depth = 0  # a model that does not read states (e.g. one loaded to predict)
        with pytest.raises(ValueError, match=r"^a batch brought frozen states of shape \(3, 7, \d+\) to a model that"):
            model("sst", {**batches["sst"][0], "states": states})
    assert len(model.encoder.encoder.layer) == 2  # the layer list is whole again


def test_the_depth_is_the_frozen_layers_every_task_shares_and_none_where_states_cannot_serve(tmp_path, tiny_backbone):
    cpu = torch.device("cpu")
    model, params = model_of(tmp_path, tiny_backbone, train={"freeze_layers": 1})
    assert states_depth(params, model, cpu) == 1
    model, params = model_of(tmp_path, tiny_backbone, arch="shared", train={"freeze_layers": 1})
    assert states_depth(params, model, cpu) == 1
    model, params = model_of(tmp_path, tiny_backbone, train={"freeze_layers": 0})
    assert states_depth(params, model, cpu) == 0
    model, params = model_of(tmp_path, tiny_backbone, train={"freeze_layers": 1},
                             runtime={"frozen_states": {"cpu": False}})
    assert states_depth(params, model, cpu) == 0
    assert states_depth(params, model, torch.device("cuda")) == 0  # off on a GPU by default
    model, params = model_of(tmp_path, tiny_backbone, train={"freeze_layers": 1}, smart={"lambda": 1.0})
    assert states_depth(params, model, cpu) == 0  # SMART perturbs the embeddings, below the states
    for arch in ("independent", "shared+independent", "static"):
        model, params = model_of(tmp_path, tiny_backbone, arch=arch, train={"freeze_layers": 1})
        assert states_depth(params, model, cpu) == 0, arch


@pytest.fixture
def frozen_model(tmp_path, tiny_backbone, tiny_tokenized):
    """A 2-layer model reading its bottom layer's states, with each task's training split."""
    model, _ = model_of(tmp_path, tiny_backbone, sts={"encoding": "bi", "combine": "cosine"})
    model.states_depth = 1
    for frozen in (model.encoder.embeddings, model.encoder.encoder.layer[0]):
        frozen.requires_grad_(False)
    without_dropout_where_frozen(model)  # as `train` leaves a model with train.freeze_layers 1
    return model, {task: load_split(tiny_tokenized, model.tasks[task], "train") for task in model.tasks}


def states_of(model, splits, folder: Path, fingerprint: str = "run-a"):
    return with_frozen_states(model, splits, "train", folder, fingerprint, False, 8, torch.device("cpu"))


def test_each_batch_brings_its_rows_states_as_the_bottom_gives_them(tmp_path, frozen_model):
    model, splits = frozen_model
    with_states = states_of(model, splits, tmp_path / "states")
    rows = np.array([5, 0, 11])
    for task, split in with_states.items():
        batch = split.batch(rows, model.encoding(task))
        columns = ("input_ids_1", "input_ids_2") if model.encoding(task) == "bi" else ("input_ids",)
        model.train()  # the states, computed in eval mode, are the bottom's in training mode: its dropout is off
        for column in columns:
            expected = frozen_states.bottom_of(model, batch, column, False, torch.device("cpu"))
            key = frozen_states.STATE_KEYS[column]
            mask = batch[column.replace("input_ids", "attention_mask")].bool()
            assert batch[key].shape == (3, batch[column].shape[1], model.encoder.config.hidden_size)
            torch.testing.assert_close(batch[key][mask], torch.from_numpy(expected)[mask], rtol=1e-5, atol=1e-5)
            assert not batch[key][~mask].any()  # zero past each row's tokens


def test_saved_states_are_reused_only_for_the_same_run_and_whole_files(tmp_path, frozen_model, monkeypatch):
    model, splits = frozen_model
    folder = tmp_path / "states"
    states_of(model, splits, folder)
    computed = []
    real_compute = frozen_states.compute
    monkeypatch.setattr(frozen_states, "compute", lambda *args: computed.append(args[1]) or real_compute(*args))
    states_of(model, splits, folder)
    assert computed == []  # the same run: reused
    states_of(model, splits, folder, fingerprint="run-b")
    assert computed == list(splits)  # another run's: computed again
    computed.clear()
    victim = folder / "train-qqp-input_ids.f32"
    victim.write_bytes(victim.read_bytes()[:-4])  # cut by one float
    states_of(model, splits, folder, fingerprint="run-b")
    assert computed == list(splits)
    computed.clear()
    (folder / "train.json").write_text("{")  # a record cut short
    states_of(model, splits, folder, fingerprint="run-b")
    assert computed == list(splits)


def test_a_states_file_cut_after_it_was_checked_is_one_line_naming_it(tmp_path, frozen_model):
    model, splits = frozen_model
    with_states = states_of(model, splits, tmp_path / "states")
    victim = tmp_path / "states" / "train-sst-input_ids.f32"
    victim.write_bytes(b"")
    with pytest.raises(UnreadableInputError, match=r"^\S+train-sst-input_ids\.f32: cut short at row \d+; delete"):
        with_states["sst"].batch(np.array([0, 1]), "cross")


def test_a_released_bottom_holds_no_data_until_a_save_reads_it_back_whole(tmp_path, tiny_backbone, frozen_model):
    """Released: the embeddings' and the bottom layer's weights are meta tensors in the model, its towers and its
    moving average, the model still computes from the states, and a batch without them is refused; within
    `restored` every weight is back as it was, and a save writes them; a checkpoint of the released model
    writes no data for them and loads back into a whole model keeping that model's own."""
    model, splits = frozen_model
    average = MovingAverage(model, 0.5, debiased=True)
    average.share_frozen(model)
    whole = {key: value.clone() for key, value in model.state_dict().items()}
    batch = states_of(model, splits, tmp_path / "states")["sst"].batch(np.array([0, 3]), "cross")
    model.eval()
    with torch.no_grad():
        before = model("sst", batch)
        bottom = ReleasedBottom.release([model, average.model], 1, tmp_path / "bottom.safetensors")
        keys = [key for key, _, _ in bottom_weights(model.encoder, 1)]
        for encoder in (model.encoder, average.model.encoder, *model.encoders.towers.values()):
            assert all(weight.is_meta for _, module, name in bottom_weights(encoder, 1)
                       for weight in [module.get_parameter(name)])
            assert not any(weight.is_meta for weight in encoder.encoder.layer[1].parameters())
        torch.testing.assert_close(model("sst", batch), before, rtol=0, atol=0)
        model.train()
        model.eval()  # a switch of mode, which transformers answers by asking each encoder's device
        without = {key: value for key, value in batch.items() if key != "states"}
        with pytest.raises(ValueError, match=r"^a batch without frozen states reached a model whose frozen bottom"):
            model("sst", without)
        state = model.state_dict()
        released = {key for key, value in state.items() if value.is_meta}
        assert {key for key in released if key.startswith("encoders.shared.")} == {
            f"encoders.shared.{key}" for key in keys}
        assert tensor_bytes(state) == tensor_bytes({key: whole[key] for key in whole if key not in released})
        with bottom.restored():
            for key, value in model.state_dict().items():
                assert torch.equal(value, whole[key]), key
            assert average.model.encoder.embeddings.word_embeddings.weight.data_ptr() == \
                model.encoder.embeddings.word_embeddings.weight.data_ptr()  # one copy, shared
            model.encoders.save(tmp_path / "saved", load_tokenizer(str(tiny_backbone)))
        assert model.encoder.embeddings.word_embeddings.weight.is_meta
    saved = load_encoder(str(tmp_path / "saved" / "encoder")).state_dict()
    for key in keys:
        assert torch.equal(saved[key], whole[f"encoders.shared.{key}"]), key
    path = tmp_path / "checkpoint.pt"
    torch.save(state, path)
    fresh, _ = model_of(tmp_path, tiny_backbone, sts={"encoding": "bi", "combine": "cosine"})
    fresh.load_state_dict(own_where_released(torch.load(path, weights_only=True), fresh))
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, whole[key]), key


@contextlib.contextmanager
def bottom_rows_counted(monkeypatch) -> Iterator[list[int]]:
    """Within: the rows of each run of the bottom layer of every model built (the training's own)."""
    rows: list[int] = []
    real_init = MultitaskModel.__init__

    def counting(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.encoder.encoder.layer[0].register_forward_pre_hook(
            lambda module, args, kwargs: rows.append(len(args[0] if args else kwargs["hidden_states"])),
            with_kwargs=True)

    with monkeypatch.context() as patch:
        patch.setattr(MultitaskModel, "__init__", counting)
        yield rows


@pytest.mark.slow(reason="trains twice")
def test_a_run_with_the_states_trains_the_same_network_without_running_the_bottom_in_its_steps(tmp_path, tiny_backbone,
                                                                                              tiny_tokenized,
                                                                                              monkeypatch):
    """freeze_layers 1 of 2, CerBERTus with one task layer, dropout on above the frozen layer: the same dropout
    masks are drawn in both runs (the frozen layer draws none), so the losses and the dev metrics agree up to
    float rounding; with the states, the bottom layer runs once per training row and per dev row, in the
    state files' computation only."""
    summaries, bottom_runs = {}, {}
    for on in (False, True):
        root = tmp_path / str(on)
        root.mkdir()
        params_file = make_params(root, tiny_backbone, Path("unused"), model={"arch": "cerbertus", "task_layers": 1},
                                  heads={"sts": {"encoding": "bi", "combine": "cosine"}},
                                  train={"freeze_layers": 1, "embedding_lr_factor": 0.0},
                                  runtime={"frozen_states": {"cpu": on}})
        with bottom_rows_counted(monkeypatch) as rows:
            summaries[on] = train_summary(variant_params(params_file, "base"), "base", run_paths(root, tiny_tokenized))
        bottom_runs[on] = sum(rows)
        assert not (root / "ck").exists()  # the state files went with the checkpoint folder
    tasks = tasks_from_params(variant_params(params_file, "base").tasks)
    for epoch, (plain, cached) in enumerate(zip(summaries[False]["epochs"], summaries[True]["epochs"], strict=True)):
        for task, loss in plain["train_loss"].items():
            assert cached["train_loss"][task] == pytest.approx(loss, rel=1e-4), (epoch, task)
        for task in tasks.values():  # each dev row's prediction (a 16-row Pearson would magnify the rounding)
            plain_ids, plain_values = read_dump(tmp_path / "False" / "snapshots" / f"epoch-{epoch + 1}", task, "dev")
            cached_ids, cached_values = read_dump(tmp_path / "True" / "snapshots" / f"epoch-{epoch + 1}", task, "dev")
            assert cached_ids.tolist() == plain_ids.tolist()
            np.testing.assert_allclose(cached_values, plain_values, rtol=1e-4, atol=1e-5, err_msg=task.name)
    # 16 training and 16 dev rows per task: SST's and QQP's once, STS's two sentences each
    assert bottom_runs[True] == 2 * (16 + 16 + 32)
    assert bottom_runs[False] > 2 * bottom_runs[True]  # every step and every dev pass ran it


@pytest.mark.slow(reason="trains twice, one run crashed")
def test_a_run_with_its_bottom_released_resumes_like_an_uninterrupted_run_and_saves_the_whole_model(
        tmp_path, tiny_backbone, tiny_tokenized, monkeypatch):
    """With the states, the bottom released and a moving average beside the model: a run killed past a
    checkpoint resumes to the uninterrupted run's figures and heads; the saved epochs hold the starting point's
    bottom, and predict dev as their dumps; test, with train.snapshot_test, is dumped from its own states."""
    params = variant_params(make_params(tmp_path, tiny_backbone, Path("unused"),
                                        model={"arch": "cerbertus", "task_layers": 1},
                                        train={"freeze_layers": 1, "embedding_lr_factor": 0.0, "ema": 0.5,
                                               "snapshot_test": True}), "base")
    uninterrupted, resumed = uninterrupted_and_resumed(params, tiny_tokenized, tmp_path, monkeypatch)
    assert resumed == uninterrupted
    assert saved_heads(tmp_path / "a" / "model") == saved_heads(tmp_path / "b" / "model")
    start = load_encoder(str(tiny_backbone)).state_dict()
    for folder in (tmp_path / "a" / "model").glob("epoch-*"):
        saved = load_encoder(str(folder / "encoder")).state_dict()
        for key, _, _ in bottom_weights(load_encoder(str(tiny_backbone)), 1):
            assert torch.equal(saved[key], start[key]), (folder.name, key)
    model, config = load_model(tmp_path / "a" / "model")
    for task_name, epoch in config["task_epochs"].items():
        task = model.tasks[task_name]
        values = predict_split(model, load_split(tiny_tokenized, task, "dev"), 8, torch.device("cpu"))
        _, dumped = read_dump(tmp_path / "a" / "snapshots" / f"epoch-{epoch}", task, "dev")
        np.testing.assert_allclose(dumped, values, rtol=1e-4, atol=1e-5, err_msg=task_name)
        assert len(read_dump(tmp_path / "a" / "snapshots" / f"epoch-{epoch}", task, "test")[0]) == len(
            load_split(tiny_tokenized, task, "test").ids)
