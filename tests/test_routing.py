"""Heinsen routing of token vectors (`heads.<task>.pooling: routing`): the algorithm, its params, and a head
that trains, saves and reloads on the 2-layer model."""

from pathlib import Path

import pytest
import torch

from mtbert.model.heads import RoutedHead, VectorRouting
from mtbert.params import HeadParams, ParamsError, as_dict, check_heads
from mtbert.params_file import load_params, variant_params, with_changes
from tests.conftest import REPO_ROOT, make_params
from tests.runs import train_summary
from tests.test_train import assert_saved_model_reproduces_its_dumps, run_paths


@pytest.fixture
def router() -> VectorRouting:
    torch.manual_seed(0)
    return VectorRouting(d_inp=8, n_out=3, d_out=5, iterations=3)


def test_outputs_are_normalised_vectors(router):
    out = router(torch.randn(2, 6, 8), torch.ones(2, 6, dtype=torch.long))
    assert out.shape == (2, 3, 5)
    assert torch.allclose(out.mean(-1), torch.zeros(2, 3), atol=1e-5)
    assert torch.allclose(out.var(-1, unbiased=False), torch.ones(2, 3), atol=1e-2)  # layer norm's eps


def test_padding_changes_nothing(router):
    torch.manual_seed(1)
    x = torch.randn(2, 6, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    batched = router(x, mask)
    alone = router(x[:1, :3], mask[:1, :3])  # row 0 without its padding
    garbage = x.clone()
    garbage[0, 3:] = 1e4
    assert torch.allclose(batched[0], alone[0], atol=1e-6)
    assert torch.allclose(router(garbage, mask)[0], batched[0], atol=1e-6)
    assert torch.equal(router(garbage, mask)[1], batched[1])


def test_the_order_of_the_inputs_does_not_matter(router):
    torch.manual_seed(2)
    x = torch.randn(1, 7, 8)
    mask = torch.ones(1, 7, dtype=torch.long)
    assert torch.allclose(router(x[:, torch.randperm(7)], mask), router(x, mask), atol=1e-5)


def test_the_factorised_m_step_equals_the_sum_of_the_materialised_votes(router):
    torch.manual_seed(3)
    phi, scaled = torch.randn(2, 6, 3), torch.randn(2, 6, 8)
    votes = torch.einsum("bid,jd,dh->bijh", scaled, router.vote_scale, router.vote_map) + router.vote_bias
    assert torch.allclose(router.outputs(phi, scaled), torch.einsum("bij,bijh->bjh", phi, votes), atol=1e-4)


def test_later_iterations_reassign_the_inputs(router):
    torch.manual_seed(4)
    x, mask = torch.randn(2, 6, 8), torch.ones(2, 6, dtype=torch.long)
    single = VectorRouting(8, 3, 5, iterations=1)
    single.load_state_dict(router.state_dict())
    assert not torch.allclose(single(x, mask), router(x, mask))  # the E-step moved the outputs
    assignment = router.assign(x, single(x, mask))
    assert torch.allclose(assignment.sum(-1), torch.ones(2, 6))  # each input's data is split over the outputs


def test_every_parameter_learns(router):
    head = RoutedHead(router, torch.nn.Linear(15, 2))
    x, mask = torch.randn(2, 6, 8), torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    head(head.pool(x, mask)).square().sum().backward()
    assert all(parameter.grad is not None and parameter.grad.abs().sum() > 0 for parameter in head.parameters())


def test_routing_sizes_get_defaults_and_belong_to_routing_heads_only():
    params = load_params(REPO_ROOT / "params.yaml")
    heads = check_heads(params.tasks, {"sst": HeadParams(pooling="routing", routing_vectors=2)})
    assert (heads["sst"].routing_vectors, heads["sst"].routing_dim, heads["sst"].routing_iters) == (2, 64, 2)
    assert as_dict(heads["qqp"]) == as_dict(params.heads["qqp"])  # other heads save no routing keys
    assert "routing_dim" not in as_dict(params.heads["sst"])
    with pytest.raises(ParamsError, match=r"^heads.sst.routing_dim: expected with pooling: routing only, got "
                                          r"pooling: mean$"):
        check_heads(params.tasks, {"sst": HeadParams(routing_dim=32)})
    with pytest.raises(ParamsError, match=r"routing_vectors: expected greater than or equal to 2, got 1"):
        with_changes(HeadParams(pooling="routing"), routing_vectors=1)


@pytest.mark.slow(reason="trains routing heads")
def test_routing_heads_train_save_and_reload_bit_for_bit(tmp_path, tiny_backbone, tiny_tokenized):
    """SST routed by a cross-encoder, QQP by a bi-encoder (features), STS by a cosine bi-encoder; the static
    arch routes the two encoders' token vectors side by side."""
    params = variant_params(make_params(tmp_path, tiny_backbone, Path("unused"), model={"arch": "static"},
                                        train={"epochs": 1}, heads={
        "sst": {"pooling": "routing", "routing_vectors": 2, "routing_dim": 16},
        "qqp": {"pooling": "routing", "encoding": "bi", "combine": "features"},
        "sts": {"pooling": "routing", "encoding": "bi", "combine": "cosine"}}), "base")
    summary = train_summary(params, "base", run_paths(tmp_path, tiny_tokenized))
    assert all(torch.isfinite(torch.tensor(loss)) for loss in summary["epochs"][0]["train_loss"].values())
    config = assert_saved_model_reproduces_its_dumps(tmp_path, tiny_tokenized, params.train.eval_batch_size)
    assert config["params"]["heads"]["sst"]["routing_dim"] == 16
