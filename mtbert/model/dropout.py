"""Dropout whose masks cost a quarter of PyTorch's random draws on a CPU.

PyTorch draws a CPU dropout mask with `bernoulli_`: two 32-bit draws per element from one mt19937
stream, on one core, while the other cores wait. Here one 32-bit draw makes the masks of two elements
(16 and 15 of its random bits), and the comparison and the multiply run on every core. The masks still come from
torch's global generator, in the order the forward pass needs them, so a seed, a resumed checkpoint
and SMART's replay of the RNG (mtbert/training/smart.py `RngReplay`) hold as with PyTorch's.

The drop probability is rounded to a multiple of 2^-15 (0.1 becomes 0.10000610) and kept values are
scaled by 1 / (1 - the rounded p), so every activation's expectation is unchanged. On other devices
PyTorch's own dropout runs (on a GPU it is one fused kernel already).

Where it runs: every `nn.Dropout` of an encoder loaded by mtbert/model/backbone.py (`use_cheap_masks`),
the task heads' dropout, and the attention probabilities' dropout, through the attention function
registered here as `mtbert-eager` (the encoder's own eager attention, with these masks). A backbone whose
attention takes no registered function (`_supports_attention_backend`) keeps its own eager attention,
with PyTorch's masks there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

LEVELS = 2**15  # a draw has 15 or 16 random bits: p is rounded to a multiple of 2^-15
EAGER_ATTENTION = "mtbert-eager"


def keep_mask(shape: torch.Size | tuple[int, ...], p: float) -> torch.Tensor:
    """A boolean CPU mask, True with probability 1 - round(p * 2^15) / 2^15, from torch's global generator.

    `random_()` fills an int32 with 31 random bits. Its bits 0-15 make one element's draw (dropped below
    2t of 2^16), its bits 16-30 another's (dropped below t of 2^15): the first half of the mask comes
    from the low bits, the second from the high ones.
    """
    count = torch.Size(shape).numel()
    words = torch.empty((count + 1) // 2, dtype=torch.int32).random_()
    dropped = dropped_levels(p)
    mask = torch.empty(2 * len(words), dtype=torch.bool)
    torch.ge(words & 0xFFFF, 2 * dropped, out=mask[:len(words)])
    torch.ge(words, dropped << 16, out=mask[len(words):])  # bits 16-30 alone, as bits 0-15 are below 2^16
    return mask[:count].view(shape)


def dropped_levels(p: float) -> int:
    """p in units of 2^-15, rounded: how many of a draw's 2^15 levels drop the element."""
    return round(p * LEVELS)


def kept_scale(p: float) -> float:
    """1 / the probability that `keep_mask` keeps an element."""
    return LEVELS / (LEVELS - dropped_levels(p))


class MaskedScale(torch.autograd.Function):
    """x * mask * scale, saving only the boolean mask for the backward pass, as PyTorch's dropout does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return torch.ops.aten.native_dropout_backward(x, mask, scale)  # that kernel computes x * mask * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return torch.ops.aten.native_dropout_backward(grad, mask, ctx.scale), None, None


def drop(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """`F.dropout` with `keep_mask`'s masks on a CPU; PyTorch's own elsewhere."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or dropped_levels(p) == LEVELS:  # p within 2^-16 of 1 drops everything
        return F.dropout(x, p, training)
    return MaskedScale.apply(x, keep_mask(x.shape, p), kept_scale(p))


class Dropout(nn.Dropout):
    """`nn.Dropout` (same p, same state dict: none) with this module's masks on a CPU."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return drop(input, self.p, self.training)


def use_cheap_masks(model: nn.Module) -> nn.Module:
    """Every plain `nn.Dropout` inside `model` replaced by `Dropout` with the same p, in place."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Dropout:
                setattr(parent, name, Dropout(child.p))
    return model


def without_dropout_where_frozen(model: nn.Module) -> None:
    """p = 0 for every dropout inside a module whose weights are all frozen (train.freeze_layers): the frozen
    layers then compute a fixed function of their input, the same in every epoch, and draw no masks. The
    encoders' configs keep their rates, so a saved model is unchanged."""
    for module in model.modules():
        weights = list(module.parameters())
        if weights and not any(weight.requires_grad for weight in weights):
            for inner in module.modules():
                if isinstance(inner, nn.Dropout):
                    inner.p = 0.0


def eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """A BERT-family encoder's eager attention (transformers' `eager_attention_forward`), its attention
    probabilities dropped by `drop`."""
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probabilities = drop(F.softmax(scores, dim=-1), dropout, module.training)
    return torch.matmul(probabilities, value).transpose(1, 2).contiguous(), probabilities


AttentionInterface.register(EAGER_ATTENTION, eager_attention)
AttentionMaskInterface.register(EAGER_ATTENTION, eager_mask)  # unregistered, transformers would build no mask
