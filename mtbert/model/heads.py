"""Task heads: an MLP over pooled vectors, the Sentence-BERT cosine head for bi-encoders, and Heinsen routing
of the token vectors in place of pooling and the hidden layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtbert.model.dropout import Dropout


class MLPHead(nn.Module):
    """Dropout, then N x (Linear, GELU, Dropout), then the output Linear."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, hidden_layers: int, dropout: float):
        super().__init__()
        layers: list[nn.Module] = [Dropout(dropout)]
        for i in range(hidden_layers):
            layers += [nn.Linear(in_dim if i == 0 else hidden_dim, hidden_dim), nn.GELU(), Dropout(dropout)]
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


class VectorRouting(nn.Module):
    """Heinsen (2022), "An Algorithm for Routing Vectors in Sequences" (arXiv 2211.11754): a variable number
    of input vectors (a batch's token vectors, padding masked out) routed to `n_out` output vectors.

    Input i is active with probability f(a_i) (a sigmoid of a linear score; 0 on padding) and votes V_ij for
    each output j. Each iteration: the E-step assigns each input to the outputs that best predict it (R_ij,
    a softmax over j of log f(agreement); uniform in the first iteration), the D-step splits its activation
    into data used, D_use = f(a_i) R_ij, and ignored, D_ign = f(a_i) - D_use, and the M-step makes each
    output the sum of its votes weighted by their net benefit phi_ij = b_ij D_use - c_ij D_ign ("bang per
    bit"; b and c linear in the input). Outputs are normalised to mean 0, variance 1.

    The per-pair maps are factorised as in the reference implementation's EfficientVectorRouting: a vote is
    V_ij = (x_i * w_j) W + v_j and output j predicts the inputs as (norm(x_out_j) W') * w'_j + v'_j, so the
    (B, n_in, n_out, d_out) votes are never built: sum_i phi_ij V_ij = ((sum_i phi_ij x_i) * w_j) W + v_j sum_i phi_ij.
    Inputs are scaled by 1/sqrt(their number), counting real tokens only, so padding changes nothing.
    """

    def __init__(self, d_inp: int, n_out: int, d_out: int, iterations: int = 2):
        super().__init__()
        self.n_out, self.d_out, self.iterations = n_out, d_out, iterations
        # A: each input's activation score. Initial scales follow the reference implementation.
        self.activation_weight = nn.Parameter(torch.randn(d_inp) * 2.0 * d_inp ** -0.5)
        self.activation_bias = nn.Parameter(torch.zeros(1))
        # F: the votes, V_ij = (x_i * vote_scale_j) vote_map + vote_bias_j
        self.vote_scale = nn.Parameter(torch.randn(n_out, d_inp))
        self.vote_map = nn.Parameter(torch.randn(d_inp, d_out) * 2.0 * d_inp ** -0.5)
        self.vote_bias = nn.Parameter(torch.zeros(n_out, d_out))
        # G: each output's prediction of the inputs, (x_out_j predict_map) * predict_scale_j + predict_bias_j
        self.predict_map = nn.Parameter(torch.randn(d_out, d_inp) * d_out ** -0.5)
        self.predict_scale = nn.Parameter(torch.randn(n_out, d_inp))
        self.predict_bias = nn.Parameter(torch.zeros(n_out, d_inp))
        # S: how well output j's prediction agrees with input i, <x_i, G_j> * agreement_scale_j + agreement_bias_j
        self.agreement_scale = nn.Parameter(torch.randn(n_out) * d_inp ** -0.5)
        self.agreement_bias = nn.Parameter(torch.zeros(n_out))
        # Net benefit and net cost per unit of data used and ignored, per input (a variable number) and output.
        self.benefit = nn.Linear(d_inp, n_out)
        self.cost = nn.Linear(d_inp, n_out)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T, d_inp) input vectors and their (B, T) mask -> (B, n_out, d_out) output vectors."""
        real = mask.unsqueeze(-1).to(x.dtype)  # (B, T, 1)
        scaled = x * real.sum(1, keepdim=True).clamp(min=1.0).rsqrt()
        active = torch.sigmoid(scaled @ self.activation_weight + self.activation_bias).unsqueeze(-1) * real
        benefit, cost = self.benefit(x), self.cost(x)  # (B, T, n_out)

        def net_benefit(assignment: torch.Tensor) -> torch.Tensor:  # the D-step: phi_ij, (B, T, n_out), 0 on padding
            used = active * assignment
            return benefit * used - cost * (active - used)

        out = self.outputs(net_benefit(x.new_full((self.n_out,), 1.0 / self.n_out)), scaled)  # R uniform at first
        for _ in range(self.iterations - 1):
            out = self.outputs(net_benefit(self.assign(x, out)), scaled)
        return F.layer_norm(out, (self.d_out,))

    def outputs(self, phi: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
        """M-step: x_out_j = sum_i phi_ij V_ij, without building the votes. (B, n_out, d_out)."""
        weighted = torch.einsum("bij,bid->bjd", phi, scaled)  # sum_i phi_ij x_i
        return (weighted * self.vote_scale) @ self.vote_map + phi.sum(1).unsqueeze(-1) * self.vote_bias

    def assign(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """E-step: R_ij = softmax over j of log f(S_ij), S_ij the agreement of input i with output j's prediction."""
        predicted = (F.layer_norm(out, (self.d_out,)) @ self.predict_map) * self.predict_scale + self.predict_bias
        agreement = torch.einsum("bid,bjd->bij", x, predicted) * self.agreement_scale + self.agreement_bias
        return F.logsigmoid(agreement).softmax(-1)


class RoutedHead(nn.Module):
    """`pooling: routing`: the task's token vectors routed to a few vectors, flattened, in place of pooling
    and the hidden layers; then `out`, the output layer (or, for a cosine bi-encoder, the cosine head)."""

    def __init__(self, router: VectorRouting, out: nn.Module):
        super().__init__()
        self.router, self.out = router, out

    def pool(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T, d) token vectors and their (B, T) mask -> (B, n_out * d_out)."""
        return self.router(states, mask).flatten(-2)

    def forward(self, *features: torch.Tensor) -> torch.Tensor:
        return self.out(*features)


def is_cosine(head: nn.Module) -> bool:
    """Whether the head ends in the cosine of two embeddings (with or without routing before it)."""
    return isinstance(head.out if isinstance(head, RoutedHead) else head, CosineHead)
