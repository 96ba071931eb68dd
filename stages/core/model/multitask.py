"""One encoder, three task heads: pooling, pair encodings, heads, losses and user-facing predictions."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stages.core.data.tasks import TASKS
from stages.core.model.architectures import TaskEncoders
from stages.core.params import HeadParams, HeadsParams, PairHeadParams


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


class MultitaskModel(nn.Module):
    """Outputs in loss space: SST logits (B, 5), QQP logit (B,), STS score (B,) on the target scale.

    `arch` and `task_layers` (model.arch, model.task_layers) decide which encoders each head reads; see
    stages/core/model/architectures.py.
    """

    def __init__(self, encoder: nn.Module, heads: HeadsParams, arch: str = "shared", task_layers: int = 0):
        super().__init__()
        self.encoders = TaskEncoders(encoder, arch, task_layers)
        self.head_params = {"sst": heads.sst, "qqp": heads.qqp, "sts": heads.sts}
        dim = encoder.config.hidden_size
        width = self.encoders.width
        self.heads = nn.ModuleDict({task: self._make_head(task, p, dim, width)
                                    for task, p in self.head_params.items()})

    @property
    def encoder(self) -> nn.Module:
        """The shared encoder (for cerbertus and independent: the first task's)."""
        return self.encoders.shared

    def word_embeddings(self, task: str) -> nn.Embedding:
        """Where SMART perturbs the task's input: the word-embedding lookup of its first encoder."""
        return self.encoders.for_task(task)[0].get_input_embeddings()

    @staticmethod
    def _make_head(task: str, params: HeadParams, dim: int, width: int) -> nn.Module:
        out_dim = TASKS[task].num_classes if TASKS[task].label_kind == "class" else 1
        if isinstance(params, PairHeadParams) and params.encoding == "bi":
            if params.combine == "cosine":
                return CosineHead(affine=task != "sts")
            return MLPHead(4 * width * dim, dim, out_dim, params.hidden_layers, params.dropout)
        return MLPHead(width * dim, dim, out_dim, params.hidden_layers, params.dropout)

    def embed(self, task: str, input_ids, attention_mask, pooling: str, token_type_ids=None) -> torch.Tensor:
        pooled = []
        for encoder in self.encoders.for_task(task):
            output = encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            pooled.append(pool(pooling, output.last_hidden_state, attention_mask,
                               getattr(output, "pooler_output", None)))
        return pooled[0] if len(pooled) == 1 else torch.cat(pooled, -1)

    def forward(self, task: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        params = self.head_params[task]
        head = self.heads[task]
        if isinstance(params, PairHeadParams) and params.encoding == "bi":
            u, v = self._embed_pair(task, batch, params.pooling)
            out = head(u, v) if isinstance(head, CosineHead) else head(torch.cat([u, v, (u - v).abs(), u * v], -1))
        else:
            out = head(self.embed(task, batch["input_ids"], batch["attention_mask"], params.pooling,
                                  batch.get("token_type_ids")))
        if task == "sst":
            return out
        out = out.squeeze(-1)
        if task == "sts":
            return self._sts_output(out, params, isinstance(head, CosineHead))
        return out

    @staticmethod
    def _sts_output(out: torch.Tensor, params, is_cosine: bool) -> torch.Tensor:
        if params.target == "unit":
            return out if is_cosine else torch.sigmoid(out)
        return 5.0 * out if is_cosine else out

    def _embed_pair(self, task: str, batch, pooling: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Both sentences through the encoder in one call of 2B rows."""
        ids_1, ids_2 = batch["input_ids_1"], batch["input_ids_2"]
        width = max(ids_1.shape[1], ids_2.shape[1])
        ids = torch.cat([F.pad(ids_1, (0, width - ids_1.shape[1])), F.pad(ids_2, (0, width - ids_2.shape[1]))])
        mask = torch.cat([F.pad(batch["attention_mask_1"], (0, width - ids_1.shape[1])),
                          F.pad(batch["attention_mask_2"], (0, width - ids_2.shape[1]))])
        pooled = self.embed(task, ids, mask, pooling)
        return pooled[: len(ids_1)], pooled[len(ids_1):]

    def loss(self, task: str, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Batch-mean loss: cross-entropy (SST), BCE with logits (QQP), MSE (STS); shapes (B,) vs (B,)."""
        outputs = outputs.float()
        if task == "sst":
            return F.cross_entropy(outputs, labels.long())
        if task == "qqp":
            return F.binary_cross_entropy_with_logits(outputs, labels.float())
        target = labels.float() / 5.0 if self.head_params["sts"].target == "unit" else labels.float()
        return F.mse_loss(outputs, target)

    def predictions(self, task: str, outputs: torch.Tensor) -> torch.Tensor:
        """User-facing: SST class probabilities (B, 5), QQP P(duplicate) (B,), STS score 0-5 (B,)."""
        outputs = outputs.float()
        if task == "sst":
            return outputs.softmax(-1)
        if task == "qqp":
            return torch.sigmoid(outputs)
        return outputs * 5.0 if self.head_params["sts"].target == "unit" else outputs

    def encoding(self, task: str) -> str:
        params = self.head_params[task]
        return params.encoding if isinstance(params, PairHeadParams) else "cross"
