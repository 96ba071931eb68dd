"""mtbert's CPU dropout (mtbert/model/dropout.py): its masks follow torch's seed and keep the rate, the kept
values and their gradients are scaled, and its eager attention is transformers' apart from the masks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.bert.modeling_bert import eager_attention_forward

from mtbert.model.dropout import (
    Dropout,
    drop,
    eager_attention,
    keep_mask,
    kept_scale,
    use_cheap_masks,
    without_dropout_where_frozen,
)


def test_masks_follow_torchs_seed():
    torch.manual_seed(0)
    first = keep_mask((40, 50), 0.1)
    torch.manual_seed(0)
    again = keep_mask((40, 50), 0.1)
    other = keep_mask((40, 50), 0.1)
    assert first.dtype == torch.bool and torch.equal(first, again) and not torch.equal(first, other)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_masks_keep_the_rounded_rate_in_both_halves(p):
    torch.manual_seed(1)
    mask = keep_mask((1000, 400), p).view(-1).float()
    kept = 1 - round(p * 2**15) / 2**15
    low_bits, high_bits = mask.chunk(2)  # the first half's draws come from the words' low bits
    for half in (low_bits, high_bits):
        assert abs(half.mean().item() - kept) < 4 * (kept * (1 - kept) / len(half)) ** 0.5
    assert kept_scale(p) == pytest.approx(1 / kept)


@pytest.mark.parametrize("shape", [(1,), (3, 5), (0, 4), (2, 3, 7)])
def test_masks_take_any_shape(shape):
    assert keep_mask(shape, 0.2).shape == shape


def test_drop_scales_the_kept_values_and_their_gradient():
    x = torch.randn(6, 7, requires_grad=True)
    torch.manual_seed(2)
    y = drop(x, 0.25, training=True)
    y.backward(torch.ones_like(y))
    torch.manual_seed(2)
    mask = keep_mask((6, 7), 0.25)
    scale = kept_scale(0.25)
    assert torch.allclose(y, x.detach() * mask * scale) and torch.allclose(x.grad, mask * scale)
    assert drop(x, 0.25, training=False) is x and drop(x, 0.0, training=True) is x
    assert torch.equal(drop(x, 1.0, training=True), torch.zeros_like(x))
    torch.manual_seed(2)  # p rounds to 1, where 1 / (1 - p) has no value: PyTorch's dropout instead
    assert torch.equal(drop(x, 1 - 2**-17, training=True), torch.zeros_like(x))


def test_cheap_masks_replace_every_plain_dropout_module_and_keep_the_state():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3), nn.Sequential(nn.Dropout(0.1), nn.Linear(4, 2)))
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    use_cheap_masks(model)
    dropouts = [module for module in model.modules() if isinstance(module, nn.Dropout)]
    assert [type(module) for module in dropouts] == [Dropout, Dropout] and [m.p for m in dropouts] == [0.3, 0.1]
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
    x = torch.randn(3, 4)
    assert torch.equal(model.eval()(x), model(x))  # evaluation draws nothing


def attention_inputs():
    torch.manual_seed(3)
    query, key, value = (torch.randn(2, 4, 5, 8) for _ in range(3))
    mask = torch.zeros(2, 1, 1, 5)
    mask[1, ..., 3:] = torch.finfo(torch.float32).min  # the second row's last two tokens are padding
    return query, key, value, mask


def test_eager_attention_is_transformers_without_dropout():
    module = nn.Module().train()
    query, key, value, mask = attention_inputs()
    ours, our_probabilities = eager_attention(module, query, key, value, mask, scaling=0.3, dropout=0.0)
    theirs, their_probabilities = eager_attention_forward(module, query, key, value, mask, scaling=0.3, dropout=0.0)
    assert torch.equal(ours, theirs) and torch.equal(our_probabilities, their_probabilities)


def test_eager_attention_drops_probabilities_with_the_cheap_masks():
    module = nn.Module().train()
    query, key, value, mask = attention_inputs()
    torch.manual_seed(4)
    _, dropped = eager_attention(module, query, key, value, mask, dropout=0.2)
    _, probabilities = eager_attention(module, query, key, value, mask, dropout=0.0)
    torch.manual_seed(4)
    expected = probabilities * keep_mask(probabilities.shape, 0.2) * kept_scale(0.2)
    assert torch.allclose(dropped, expected)
    _, evaluated = eager_attention(module.eval(), query, key, value, mask, dropout=0.2)
    assert torch.equal(evaluated, probabilities)


def test_dropout_goes_only_where_every_weight_is_frozen():
    """train.freeze_layers: a frozen block's dropout off (a fixed function of its input), a trained one's kept."""
    frozen = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    trained = nn.Sequential(nn.Linear(4, 4), Dropout(0.1))
    model = nn.Sequential(frozen, trained, nn.Dropout(0.2))  # the outer dropout: inside a partly trained module
    frozen.requires_grad_(False)
    without_dropout_where_frozen(model)
    assert frozen[1].p == 0.0
    assert trained[1].p == 0.1 and model[2].p == 0.2
    model.train()
    x = torch.ones(3, 4)
    assert torch.equal(frozen(x), frozen(x))  # in training mode, no mask drawn
