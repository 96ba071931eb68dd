"""Task heads: an MLP over pooled vectors, and the Sentence-BERT cosine head for bi-encoders."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLPHead(nn.Module):
    """Dropout, then N x (Linear, GELU, Dropout), then the output Linear."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, hidden_layers: int, dropout: float):
        super().__init__()
        layers: list[nn.Module] = [nn.Dropout(dropout)]
        for i in range(hidden_layers):
            layers += [nn.Linear(in_dim if i == 0 else hidden_dim, hidden_dim), nn.GELU(), nn.Dropout(dropout)]
        layers.append(nn.Linear(hidden_dim if hidden_layers else in_dim, out_dim))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CosineHead(nn.Module):
    """Sentence-BERT style: cos(u, v), mapped by a learnt affine map for classification."""

    def __init__(self, affine: bool):
        super().__init__()
        self.affine = nn.Linear(1, 1) if affine else None
        if self.affine is not None:
            nn.init.constant_(self.affine.weight, 5.0)
            nn.init.constant_(self.affine.bias, -2.5)

    def forward(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cosine = F.cosine_similarity(u, v, dim=-1).unsqueeze(-1)
        return self.affine(cosine) if self.affine is not None else cosine
