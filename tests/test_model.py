"""Pooling, pair encodings, heads and the optimiser's per-layer learning rates."""


import pytest
import torch

from mtbert.model.backbone import load_encoder
from mtbert.model.multitask import MultitaskModel
from mtbert.model.pooling import pool
from mtbert.params import ParamsError
from mtbert.params_file import load_params, with_changes
from mtbert.per_task import ROUTING_DEFAULTS
from mtbert.training.losses import task_loss
from mtbert.training.optim import make_optimizer
from tests.conftest import REPO_ROOT, TASKS


@pytest.fixture(scope="module")
def params():
    return load_params(REPO_ROOT / "params.yaml")


@pytest.fixture(scope="module")
def encoder(tiny_backbone):
    return load_encoder(str(tiny_backbone)).eval()


@pytest.mark.parametrize("kind", ["cls", "mean", "max", "attention"])
def test_pooling_ignores_padding(kind):
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    pooled = pool(kind, hidden, mask, None)
    assert pooled.shape == (2, 8)
    changed = hidden.clone()
    changed[0, 3:] = 1e4  # garbage in the padding of row 0
    assert torch.allclose(pool(kind, changed, mask, None)[0], pooled[0])


def test_mean_and_max_pooling_values():
    hidden = torch.tensor([[[1.0, 5.0], [3.0, -1.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert pool("mean", hidden, mask, None).tolist() == [[2.0, 2.0]]
    assert pool("max", hidden, mask, None).tolist() == [[3.0, 5.0]]


def batch_for(encoding: str, labels):
    ids = torch.tensor([[101, 2204, 3185, 102, 0], [101, 2919, 102, 0, 0]])
    mask = (ids != 0).long()
    if encoding == "bi":
        return {"input_ids_1": ids, "attention_mask_1": mask, "input_ids_2": ids[:, :3],
                "attention_mask_2": mask[:, :3], "labels": torch.tensor(labels)}
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
            "labels": torch.tensor(labels)}


@pytest.mark.parametrize("pooling", ["cls", "mean", "max", "attention", "routing"])
@pytest.mark.parametrize(("encoding", "combine"), [("cross", "features"), ("bi", "features"), ("bi", "cosine")])
def test_every_pair_encoding_and_pooling_gives_the_right_shapes(params, encoder, pooling, encoding, combine):
    sizes = ROUTING_DEFAULTS if pooling == "routing" else {}
    heads = {
        "sst": with_changes(params.heads["sst"], pooling=pooling, **sizes),
        "qqp": with_changes(params.heads["qqp"], pooling=pooling, encoding=encoding, combine=combine, **sizes),
        "sts": with_changes(params.heads["sts"], pooling=pooling, encoding=encoding, combine=combine, **sizes)}
    model = MultitaskModel(encoder, TASKS, heads).eval()
    sst = model("sst", batch_for("cross", [1, 4]))
    qqp = model("qqp", batch_for(encoding, [0.0, 1.0]))
    sts = model("sts", batch_for(encoding, [2.5, 4.0]))
    assert sst.shape == (2, 5) and qqp.shape == (2,) and sts.shape == (2,)
    assert model.predictions("sst", sst).sum(-1).tolist() == pytest.approx([1.0, 1.0])
    assert task_loss(TASKS["sts"], heads["sts"])(sts, {"labels": torch.tensor([2.5, 4.0])}).ndim == 0


def test_bi_encoder_cosine_sts_is_five_times_the_cosine(params, encoder):
    sts = with_changes(params.heads["sts"], encoding="bi", combine="cosine", pooling="mean", target="raw")
    model = MultitaskModel(encoder, TASKS, {**params.heads, "sts": sts}).eval()
    batch = batch_for("bi", [0.0, 0.0])
    batch["input_ids_2"], batch["attention_mask_2"] = batch["input_ids_1"], batch["attention_mask_1"]
    with torch.no_grad():
        assert model("sts", batch).tolist() == pytest.approx([5.0, 5.0], abs=1e-4)  # identical sentences


def test_sts_unit_target_predicts_on_0_to_5(params, encoder):
    model = MultitaskModel(encoder, TASKS, {**params.heads, "sts": with_changes(
        params.heads["sts"], encoding="cross", target="unit")}).eval()
    with torch.no_grad():
        out = model("sts", batch_for("cross", [0.0, 5.0]))
    assert ((out > 0) & (out < 1)).all()
    assert torch.equal(model.predictions("sts", out), out * 5)


def test_layerwise_lr_decay_gives_the_expected_rates(params, encoder):
    train = with_changes(params.train, lr=1e-3, layer_decay=0.5, head_lr_mult=2.0, embedding_lr_factor=0.1)
    model = MultitaskModel(encoder, TASKS, params.heads)
    optimizer, _ = make_optimizer(model, 2, train, total_steps=10)
    lr_of = {}
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            lr_of[id(parameter)] = group["initial_lr"]
    named = dict(model.named_parameters())

    def lr(name):
        return lr_of[id(named[name])]

    assert lr("encoders.shared.encoder.layer.1.attention.self.query.weight") == pytest.approx(1e-3)
    assert lr("encoders.shared.encoder.layer.0.attention.self.query.weight") == pytest.approx(5e-4)
    assert lr("encoders.shared.embeddings.word_embeddings.weight") == pytest.approx(1e-3 * 0.25 * 0.1)
    assert lr("heads.sst.net.1.weight") == pytest.approx(2e-3)
    decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert decay[id(named["encoders.shared.encoder.layer.0.output.LayerNorm.weight"])] == 0.0
    assert decay[id(named["encoders.shared.encoder.layer.0.output.dense.bias"])] == 0.0
    assert decay[id(named["encoders.shared.encoder.layer.0.output.dense.weight"])] == train.weight_decay


def test_task_lr_mult_scales_only_what_its_task_alone_uses(params, tiny_backbone):
    # cerbertus k = 1 on the 2-layer encoder: layer 0 and the embeddings are shared; sst's top layer is the
    # shared encoder's own, qqp and sts have copies.
    model = MultitaskModel(load_encoder(str(tiny_backbone)), TASKS, params.heads, "cerbertus", 1)
    train = with_changes(params.train, lr=1e-3, layer_decay=0.5, head_lr_mult=2.0, embedding_lr_factor=1.0,
                                task_lr_mult={"sst": 0.5, "qqp": 2.0, "sts": 3.0})
    optimizer, _ = make_optimizer(model, 2, train, total_steps=10)
    lr_of = {id(parameter): group["initial_lr"] for group in optimizer.param_groups for parameter in group["params"]}
    named = dict(model.named_parameters())

    def lr(name):
        return lr_of[id(named[name])]

    assert lr("encoders.shared.encoder.layer.0.attention.self.query.weight") == pytest.approx(5e-4)
    assert lr("encoders.shared.embeddings.word_embeddings.weight") == pytest.approx(2.5e-4)
    assert lr("encoders.shared.encoder.layer.1.attention.self.query.weight") == pytest.approx(1e-3 * 0.5)
    assert lr("encoders.towers.qqp.encoder.layer.1.attention.self.query.weight") == pytest.approx(1e-3 * 2.0)
    assert lr("encoders.towers.sts.encoder.layer.1.attention.self.query.weight") == pytest.approx(1e-3 * 3.0)
    assert lr("heads.qqp.net.1.weight") == pytest.approx(2e-3 * 2.0)
    assert lr("heads.sst.net.1.weight") == pytest.approx(2e-3 * 0.5)


def test_freeze_layers_freezes_the_embeddings_and_the_bottom_layers_only(params, tiny_backbone):
    """train.freeze_layers 1 of the tiny encoder's 2 layers: no gradient, so no optimiser state, below the top."""
    model = MultitaskModel(load_encoder(str(tiny_backbone)), TASKS, params.heads, "cerbertus", 1)
    optimizer, _ = make_optimizer(model, 2, with_changes(params.train, embedding_lr_factor=1.0, freeze_layers=1),
                                  total_steps=10)
    frozen = {name for name, weight in model.named_parameters() if not weight.requires_grad}
    assert frozen and all(".embeddings." in name or ".layer.0." in name for name in frozen)
    assert all(".layer.1." not in name for name in frozen)
    assert not any(weight.requires_grad for weight in model.encoder.encoder.layer[0].parameters())
    assert model.encoder.encoder.layer[1].attention.self.query.weight.requires_grad
    optimised = {id(weight) for group in optimizer.param_groups for weight in group["params"]}
    assert not any(id(weight) in optimised for weight in model.parameters() if not weight.requires_grad)


def test_freeze_layers_must_leave_a_layer_to_train(params, tiny_backbone):
    model = MultitaskModel(load_encoder(str(tiny_backbone)), TASKS, params.heads)
    with pytest.raises(ParamsError, match=r"^train.freeze_layers: expected fewer than the encoder's 2 layers"):
        make_optimizer(model, 2, with_changes(params.train, freeze_layers=2), total_steps=10)


def test_embedding_lr_factor_zero_freezes_the_embeddings(params, tiny_backbone):
    model = MultitaskModel(load_encoder(str(tiny_backbone)), TASKS, params.heads)
    make_optimizer(model, 2, with_changes(params.train, embedding_lr_factor=0.0), total_steps=10)
    assert not model.encoder.embeddings.word_embeddings.weight.requires_grad
    assert model.encoder.encoder.layer[0].attention.self.query.weight.requires_grad
