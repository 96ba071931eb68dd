"""Pooling token states into one sentence vector: CLS, mean, max or CLS-anchored attention."""

from __future__ import annotations

import math

import torch


def pool(kind: str, hidden: torch.Tensor, mask: torch.Tensor, pooler_output: torch.Tensor | None) -> torch.Tensor:
    """(B, T, d) hidden states and (B, T) mask -> (B, d); padding never contributes."""
    if kind == "cls":
        return pooler_output if pooler_output is not None else hidden[:, 0]
    mask_f = mask.unsqueeze(-1).to(hidden.dtype)
    if kind == "mean":
        return (hidden * mask_f).sum(1) / mask_f.sum(1).clamp(min=1.0)
    if kind == "max":
        return hidden.masked_fill(mask_f == 0, torch.finfo(hidden.dtype).min).max(1).values
    if kind == "attention":
        # CLS-anchored: alpha_t = softmax_t(<h_cls, h_t> / sqrt(d)), output h_cls + sum_t alpha_t h_t. The
        # 1/sqrt(d) keeps the softmax from collapsing onto the CLS token's own (largest) dot product.
        cls = hidden[:, 0]
        scores = torch.einsum("bd,btd->bt", cls, hidden) / math.sqrt(hidden.shape[-1])
        scores = scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)
        return cls + torch.einsum("bt,btd->bd", scores.softmax(-1), hidden)
    raise ValueError(f"unknown pooling {kind!r}")
