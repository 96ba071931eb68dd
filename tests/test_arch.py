"""Architectures (shared, cerbertus, independent, shared+independent, static) and PCGrad."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from mtbert.model.architectures import ARCHS, TaskEncoders, attention_for
from mtbert.model.dropout import EAGER_ATTENTION
from mtbert.model.multitask import MultitaskModel
from mtbert.model.saved import ModelFolderError, load_model, save_model
from mtbert.params_file import load_params, variant_params, with_changes
from mtbert.training.losses import task_loss
from mtbert.training.pcgrad import project_conflicts
from tests.conftest import REPO_ROOT, TASKS, make_params


@pytest.fixture(scope="module")
def params():
    """The repo's params with STS cross-encoded, as the pair batches below are (the default is a bi-encoder)."""
    params = load_params(REPO_ROOT / "params.yaml")
    sts = with_changes(params.heads["sts"], encoding="cross")
    return with_changes(params, heads={**params.heads, "sts": sts})


@pytest.fixture
def encoder(tiny_backbone):
    from mtbert.model.backbone import load_encoder

    return load_encoder(str(tiny_backbone))


@pytest.fixture(scope="module")
def batches(tiny_tokenizer):
    sst = tiny_tokenizer(["a lovely film", "dull and far too long"], padding=True, return_tensors="pt")
    pair = tiny_tokenizer(["a dog runs", "rain"], ["a dog is running", "it is sunny"], padding=True,
                          return_tensors="pt")
    return {"sst": {**sst, "labels": torch.tensor([4, 0])},
            "qqp": {**pair, "labels": torch.tensor([1.0, 0.0])},
            "sts": {**pair, "labels": torch.tensor([4.5, 0.5])}}


def outputs(model, batches) -> dict[str, torch.Tensor]:
    model.eval()
    with torch.no_grad():
        return {task: model(task, batch) for task, batch in batches.items()}


def encoder_parameters(model) -> int:
    return sum(p.numel() for p in model.encoders.parameters())


def test_cerbertus_with_no_task_layers_is_the_shared_model(params, encoder, batches):
    torch.manual_seed(0)
    shared = MultitaskModel(copy.deepcopy(encoder), TASKS, params.heads, "shared")
    cerbertus = MultitaskModel(copy.deepcopy(encoder), TASKS, params.heads, "cerbertus", 0)
    cerbertus.heads.load_state_dict(shared.heads.state_dict())
    expected, got = outputs(shared, batches), outputs(cerbertus, batches)
    assert all(torch.equal(expected[task], got[task]) for task in batches)
    assert encoder_parameters(cerbertus) == encoder_parameters(shared)


def test_cerbertus_task_layers_start_identical_and_diverge_after_one_task_steps(params, encoder, batches):
    model = MultitaskModel(encoder, TASKS, params.heads, "cerbertus", 1).train()
    towers = model.encoders.towers
    top = {task: towers[task].encoder.layer[1] for task in towers}
    assert top["sst"] is not top["qqp"] and towers["sst"].encoder.layer[0] is towers["qqp"].encoder.layer[0]
    before = {task: copy.deepcopy(layer.state_dict()) for task, layer in top.items()}
    assert all(torch.equal(before["sst"][k], before["qqp"][k]) for k in before["sst"])
    bottom = copy.deepcopy(towers["sst"].encoder.layer[0].state_dict())

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    task_loss(TASKS["sst"], model.head_params["sst"])(model("sst", batches["sst"]), batches["sst"]).backward()
    optimizer.step()

    def changed(layer, old):
        return any(not torch.equal(v, old[k]) for k, v in layer.state_dict().items())

    assert changed(top["sst"], before["sst"])
    assert not changed(top["qqp"], before["qqp"]) and not changed(top["sts"], before["sts"])
    assert changed(towers["qqp"].encoder.layer[0], bottom)  # the shared bottom moved for every task


@pytest.mark.parametrize("task_layers", [1, 2])
def test_parameter_counts_follow_the_formula(params, encoder, task_layers):
    whole = sum(p.numel() for p in encoder.parameters())
    layer = sum(p.numel() for p in encoder.encoder.layer[0].parameters())
    pooler = sum(p.numel() for p in encoder.pooler.parameters())
    embeddings = sum(p.numel() for p in encoder.embeddings.parameters())
    tasks = len(TASKS)
    assert tasks == 3
    cerbertus = MultitaskModel(copy.deepcopy(encoder), TASKS, params.heads, "cerbertus", task_layers)
    own = task_layers * layer + pooler + (embeddings if task_layers == 2 else 0)  # k = L: nothing shared
    assert encoder_parameters(cerbertus) == whole + (tasks - 1) * own
    independent = MultitaskModel(copy.deepcopy(encoder), TASKS, params.heads, "independent")
    assert encoder_parameters(independent) == tasks * whole
    both = MultitaskModel(copy.deepcopy(encoder), TASKS, params.heads, "shared+independent")
    assert encoder_parameters(both) == (tasks + 1) * whole
    static = MultitaskModel(copy.deepcopy(encoder), TASKS, params.heads, "static")
    assert encoder_parameters(static) == 2 * whole
    assert sum(p.numel() for p in static.encoders.parameters() if p.requires_grad) == whole


def test_task_layers_beyond_the_encoder_are_refused(params, encoder):
    with pytest.raises(ValueError, match="model.task_layers: expected 0 to 2"):
        MultitaskModel(encoder, TASKS, params.heads, "cerbertus", 3)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_round_trips_through_save_and_load(params, encoder, tiny_tokenizer, batches, arch, tmp_path):
    torch.manual_seed(0)
    model = MultitaskModel(encoder, TASKS, params.heads, arch, 1)
    with torch.no_grad():  # make every copy distinct, as after training
        for i, parameter in enumerate(model.parameters()):
            parameter.add_(0.01 * torch.randn_like(parameter) * (i % 3))
    config = {"variant": "x", "params": {"tasks": _as_dict(params.tasks), "heads": _as_dict(params.heads),
                                         "model": {"name": "unused", "arch": arch, "task_layers": 1}}}
    save_model(model, tiny_tokenizer, tmp_path / "model", config)
    loaded, _ = load_model(tmp_path / "model")
    assert list(loaded.tasks) == list(TASKS) and loaded.tasks["sts"].kind.label_domain() == (0.0, 5.0, False)
    expected, got = outputs(model, batches), outputs(loaded, batches)
    assert all(torch.equal(expected[task], got[task]) for task in batches)


def test_tasks_kept_at_different_epochs_each_run_on_their_own_snapshot(params, encoder, tiny_tokenizer, batches,
                                                                      tmp_path):
    from mtbert.model.saved import TaskSnapshots, assemble_model

    config = {"variant": "x", "params": {"tasks": _as_dict(params.tasks), "heads": _as_dict(params.heads),
                                         "model": {"name": "unused", "arch": "cerbertus", "task_layers": 1}}}
    torch.manual_seed(0)
    model = MultitaskModel(encoder, TASKS, params.heads, "cerbertus", 1)
    expected = {}
    for epoch in (1, 2):  # the shared layers move between the epochs too
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01 * torch.randn_like(parameter))
        save_model(model, tiny_tokenizer, tmp_path / "epochs" / f"epoch-{epoch}", config)
        expected[epoch] = outputs(model, batches)
    task_epochs = {"sst": 1, "qqp": 2, "sts": 1}
    assemble_model(tmp_path / "model", tmp_path / "epochs", task_epochs, config)
    loaded, saved_config = load_model(tmp_path / "model")
    assert isinstance(loaded, TaskSnapshots) and saved_config["task_epochs"] == task_epochs
    got = outputs(loaded, batches)
    assert all(torch.equal(got[task], expected[epoch][task]) for task, epoch in task_epochs.items())
    assert not torch.equal(expected[1]["qqp"], expected[2]["qqp"])


def test_a_saved_model_without_its_tasks_is_refused_naming_the_file(params, encoder, tiny_tokenizer, tmp_path):
    model = MultitaskModel(encoder, TASKS, params.heads, "shared")
    config = {"variant": "x", "params": {"heads": _as_dict(params.heads), "model": {"arch": "shared"}}}
    save_model(model, tiny_tokenizer, tmp_path / "model", config)
    with pytest.raises(ModelFolderError, match=r"model/mtbert.json: declares no tasks .*retrain it\)$"):
        load_model(tmp_path / "model")
    with pytest.raises(ModelFolderError, match=r"nothing/mtbert.json is missing"):
        load_model(tmp_path / "nothing")


def test_towers_follow_the_declared_tasks(encoder):
    names = ["first", "second"]
    towers = TaskEncoders(copy.deepcopy(encoder), names, "independent", 0)
    assert list(towers.towers) == names
    assert towers.for_task("first") == [towers.shared] and towers.for_task("second")[0] is not towers.shared
    assert list(towers.extra_encoders()) == ["encoder-second"]
    both = TaskEncoders(copy.deepcopy(encoder), names, "shared+independent", 0)
    assert both.width == 2 and list(both.extra_encoders()) == ["encoder-first", "encoder-second"]


def _as_dict(section):
    from mtbert.params import as_dict

    return as_dict(section)


def test_static_copy_stays_frozen_and_without_dropout(params, encoder):
    model = MultitaskModel(encoder, TASKS, params.heads, "static").train()
    assert not model.encoders.static.training and model.encoders.shared.training


# --- PCGrad ---------------------------------------------------------------------------------------
def test_pcgrad_projects_conflicting_gradients_as_in_the_paper():
    g1, g2 = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 1.0])  # dot -1: they conflict
    p1, p2 = project_conflicts([g1, g2], np.random.default_rng(0))
    torch.testing.assert_close(p1, g1 - (-1.0 / 2.0) * g2)  # onto the normal plane of g2: [0.5, 0.5]
    torch.testing.assert_close(p2, g2 - (-1.0 / 1.0) * g1)  # [0, 1]
    assert torch.dot(p1, g2) == 0 and torch.dot(p2, g1) == 0


def test_pcgrad_leaves_non_conflicting_gradients_unchanged():
    grads = [torch.tensor([1.0, 2.0, 0.0]), torch.tensor([0.5, 0.0, 1.0]), torch.tensor([0.0, 1.0, 1.0])]
    projected = project_conflicts(grads, np.random.default_rng(0))
    assert all(torch.equal(a, b) for a, b in zip(grads, projected, strict=True))


# --- training with every arch ---------------------------------------------------------------------
def trainer(tmp_path: Path, backbone: Path, tokenized: Path, **overrides):
    """A fine-tuning run prepared as the `train` stage prepares it (tests/runs.py)."""
    from mtbert.training.loop import Paths
    from tests.runs import prepared

    tmp_path.mkdir(parents=True, exist_ok=True)
    params_file = make_params(tmp_path, backbone, Path("unused"), **overrides)
    params = variant_params(params_file, "base")
    paths = Paths(tokenized=tokenized, model_out=tmp_path / "m", metrics_out=tmp_path / "m.json",
                  live_dir=tmp_path / "live", checkpoints=tmp_path / "ck")
    return prepared(params, paths)


@pytest.mark.slow(reason="trains every architecture")
@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_trains_with_smart_the_teacher_and_a_bi_encoder(arch, tmp_path, tiny_backbone, tiny_tokenized):
    run = trainer(tmp_path, tiny_backbone, tiny_tokenized, model={"arch": arch, "task_layers": 1},
                  train={"epochs": 1}, heads={"sts": {"encoding": "bi", "combine": "features", "pooling": "mean"}},
                  smart={"lambda": 1.0, "task_lambda": {"sst": None, "qqp": None, "sts": None},
                         "mu": 1.0, "radius": 0.1})
    summary = run.train()
    assert summary["speed"]["seconds_per_step"] > 0
    assert set(summary["epochs"][0]["regularisers"]) >= {"sst/smart_loss", "sts/delta_ratio", "qqp/bregman_loss"}


@pytest.mark.slow(reason="trains with PCGrad's per-task backward passes")
def test_pcgrad_trains_joint_steps_with_gradient_accumulation(tmp_path, tiny_backbone, tiny_tokenized):
    def final_heads(name: str, gradient: str) -> dict[str, torch.Tensor]:
        run = trainer(tmp_path / name, tiny_backbone, tiny_tokenized, model={"arch": "cerbertus", "task_layers": 1},
                      train={"epochs": 1, "sampler": "joint", "gradient": gradient, "grad_accum": 2})
        run.train()
        return {k: v.clone() for k, v in run.run.model.heads.state_dict().items()}

    surgery, plain = final_heads("pcgrad", "pcgrad"), final_heads("plain", "plain")
    assert all(torch.isfinite(v).all() for v in surgery.values())
    assert any(not torch.equal(surgery[k], plain[k]) for k in plain)


def test_a_batch_run_in_pieces_under_max_batch_tokens_gives_the_whole_batchs_gradient(tmp_path, tiny_backbone,
                                                                                     tiny_tokenized):
    from mtbert.data.batches import micro_batches
    from mtbert.training.step import step

    totals, gradients, lengths = {}, {}, None
    for budget in (0, 8):  # 8 tokens: every row of the tiny data is a piece of its own
        prepared = trainer(tmp_path / str(budget), tiny_backbone, tiny_tokenized, train={"max_batch_tokens": budget})
        run, lengths = prepared.run, prepared.run.row_lengths["qqp"]
        run.model.eval()  # no dropout, so the pieces compute exactly what the whole batch does
        step(run, prepared.progress, ("qqp",), ends_update=False)  # the gradients, kept in .grad
        totals[budget] = prepared.progress.totals.settle()  # the loss sums, read from the device
        gradients[budget] = {name: p.grad for name, p in run.model.named_parameters() if p.grad is not None}
    rows = np.arange(4)
    assert len(micro_batches(rows, lengths, 0)) == 1 and len(micro_batches(rows, lengths, 8)) == 4
    assert gradients[8].keys() == gradients[0].keys() and gradients[0]
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[8][name], gradient, rtol=1e-4, atol=1e-6, msg=name)
    whole, pieces = totals[0], totals[8]
    assert pieces.batches == whole.batches == {"sst": 0, "qqp": 1, "sts": 0}
    assert pieces.examples == whole.examples == 4
    assert pieces.loss_sum["qqp"] == pytest.approx(whole.loss_sum["qqp"], rel=1e-5)


def test_max_train_examples_caps_one_tasks_training_rows_and_leaves_dev_whole(tmp_path, tiny_backbone, tiny_tokenized):
    capped = {"max_train_examples": {"sst": 0, "qqp": 5, "sts": 0}}
    run = trainer(tmp_path, tiny_backbone, tiny_tokenized, train=capped).run
    whole = trainer(tmp_path / "whole", tiny_backbone, tiny_tokenized).run
    assert len(run.train_data["qqp"]) == 5 < len(whole.train_data["qqp"])
    assert list(run.train_data["qqp"].ids) == list(whole.train_data["qqp"].ids[:5])  # the file's first rows
    assert len(run.train_data["sst"]) == len(whole.train_data["sst"])
    assert all(len(run.dev_data[task]) == len(whole.dev_data[task]) for task in run.tasks)
    assert run.steps_per_epoch < whole.steps_per_epoch


def attention_implementations(model) -> set[str]:
    """What every self-attention module of the model's encoders runs (shared layers read their own encoder's
    config, a task's own layers their tower's)."""
    return {module.config._attn_implementation for module in model.modules()
            if type(module).__name__ == "BertSelfAttention"}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_cpu_trains_with_mtberts_eager_attention_and_evaluates_with_the_fused_kernel(params, encoder, batches, arch):
    model = MultitaskModel(encoder, TASKS, params.heads, arch, 1)
    model.train()
    expected = {EAGER_ATTENTION, "sdpa"} if arch == "static" else {EAGER_ATTENTION}  # the frozen copy never trains
    assert attention_implementations(model) == expected
    model.eval()
    assert attention_implementations(model) == {"sdpa"}


def test_an_encoder_without_registered_attention_functions_trains_with_its_own(encoder):
    encoder.train()
    assert attention_for(encoder) == EAGER_ATTENTION
    encoder._supports_attention_backend = False  # as transformers marks a model that takes none
    assert attention_for(encoder) == "eager" and attention_for(encoder.eval()) == "sdpa"


def test_training_attention_differs_from_the_fused_kernel_only_by_its_dropout_masks(params, encoder, batches):
    model = MultitaskModel(encoder, TASKS, params.heads, "cerbertus", 1).train()
    torch.manual_seed(0)
    with_dropout = {task: model(task, batch) for task, batch in batches.items()}
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # the attention's dropout too: BERT passes its dropout module's p
    outputs_by_attention = {}
    for implementation in (EAGER_ATTENTION, "sdpa"):
        for tower in model.encoders.distinct_encoders():
            tower.set_attn_implementation(implementation)
        outputs_by_attention[implementation] = {task: model(task, batch) for task, batch in batches.items()}
    for task in batches:  # without masks only float rounding apart; with them far apart
        torch.testing.assert_close(outputs_by_attention[EAGER_ATTENTION][task], outputs_by_attention["sdpa"][task],
                                   rtol=1e-5, atol=1e-5)
        assert (with_dropout[task] - outputs_by_attention["sdpa"][task]).abs().max() > 1e-3


def test_without_attention_dropout_training_keeps_the_fused_kernel(params, dropout_free_backbone, batches):
    from mtbert.model.backbone import load_encoder

    model = MultitaskModel(load_encoder(str(dropout_free_backbone)), TASKS, params.heads, "shared").train()
    assert attention_implementations(model) == {"sdpa"}  # with no dropout, sdpa's CPU kernel applies
