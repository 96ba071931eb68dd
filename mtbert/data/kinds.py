"""What a task's kind decides: its labels, output size, predictions, divergence, metrics and dumps (its loss:
mtbert/training/losses.py, one unit per kind).

Every task-specific behaviour of the pipeline dispatches here, on the kind a task declares in
params.yaml (`tasks.<name>.kind`), never on the task's name:

- classification (C classes): label a class id 0..C-1; C logits, C probabilities; SMART's divergence the
  symmetric KL of the softmaxes; accuracy and macro-F1; a confusion-matrix plot.
- binary: label 0 or 1; one logit, P(label 1); the symmetric KL of the Bernoullis; accuracy and F1; a
  confusion-matrix plot.
- regression (a range [lo, hi]): label a number in it; one score; the squared error; Pearson and Spearman;
  a predicted-vs-gold scatter.

A regression head regresses on the label itself (`target: raw`) or on (label - lo) / (hi - lo) through a
sigmoid (`target: unit`).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
import torch.nn.functional as F

from mtbert.per_task import KIND_METRICS


class Kind:
    """The behaviour shared by every task of one kind; a task holds one instance."""

    name: ClassVar[str]
    metric_names: ClassVar[tuple[str, ...]]  # the keys `metrics()` returns
    plot: ClassVar[str]  # the plot table `plot_table()` writes: confusion | scatter
    label_type: ClassVar[pa.DataType]  # the label column of the tokenized Parquet
    cosine_affine: ClassVar[bool]  # a cosine bi-encoder head maps cos to a logit by a learnt affine map

    output_size: int  # the head's output units

    # --- labels of the raw files ---
    def label_domain(self) -> tuple[float, float, bool]:
        """(lowest, highest, integers only) of a valid label."""
        raise NotImplementedError

    def describe_domain(self) -> str:
        low, high, integer = self.label_domain()
        return f"an integer {low}-{high}" if integer else f"a number {low}-{high}"

    def parse_labels(self, values: pd.Series) -> pd.Series:
        return values.astype("int64")

    def label_distribution(self, labels: pd.Series) -> dict:
        """For metrics/data.json: counts per class."""
        return {str(label): int(count) for label, count in labels.value_counts().sort_index().items()}

    # --- the model ---
    def head_output(self, out: torch.Tensor, head, is_cosine: bool) -> torch.Tensor:
        """A head's raw (B, output_size) output in loss space."""
        return out.squeeze(-1)

    def predictions(self, outputs: torch.Tensor, head) -> torch.Tensor:
        """Loss space to user-facing values."""
        raise NotImplementedError

    def divergence(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """SMART's l_s between two outputs in loss space, one value per example: (B,)."""
        raise NotImplementedError

    # --- predictions as arrays ---
    def metrics(self, values: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        raise NotImplementedError

    def smooth_loss(self, values: np.ndarray, labels: np.ndarray) -> float:
        """A smooth criterion of unrounded predictions (lower is better): log-loss, or squared error."""
        raise NotImplementedError

    def predicted_labels(self, values: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def value_columns(self) -> list[str]:
        """The dump columns holding the unrounded predictions."""
        raise NotImplementedError

    def plot_table(self, values: np.ndarray, labels: np.ndarray) -> pd.DataFrame:
        return pd.DataFrame({"actual": labels.astype(int), "predicted": self.predicted_labels(values)})


class Classification(Kind):
    name = "classification"
    metric_names = KIND_METRICS["classification"]
    plot = "confusion"
    label_type = pa.int64()
    cosine_affine = True

    def __init__(self, classes: int):
        self.output_size = classes

    def label_domain(self) -> tuple[float, float, bool]:
        return 0, self.output_size - 1, True

    def head_output(self, out: torch.Tensor, head, is_cosine: bool) -> torch.Tensor:
        return out

    def predictions(self, outputs, head):
        return outputs.float().softmax(-1)

    def divergence(self, a, b):
        """KL(p||q) + KL(q||p) = sum_c (p_c - q_c)(log p_c - log q_c) for p, q = softmax of (B, C) logits."""
        log_p, log_q = F.log_softmax(a.float(), -1), F.log_softmax(b.float(), -1)
        return ((log_p.exp() - log_q.exp()) * (log_p - log_q)).sum(-1)

    def metrics(self, values, labels):
        predicted = values.argmax(-1)
        labels = labels.astype(int)
        f1s = [_f1(predicted == c, labels == c) for c in range(values.shape[-1])]
        return {"accuracy": float(np.mean(predicted == labels)), "macro_f1": float(np.mean(f1s))}

    def smooth_loss(self, values, labels):
        chosen = values[np.arange(len(labels)), labels.astype(int)]
        return float(-np.mean(np.log(np.clip(chosen, 1e-12, 1.0))))

    def predicted_labels(self, values):
        return values.argmax(-1)

    def value_columns(self):
        return [f"prob_{c}" for c in range(self.output_size)]


class Binary(Kind):
    name = "binary"
    metric_names = KIND_METRICS["binary"]
    plot = "confusion"
    label_type = pa.int64()
    cosine_affine = True
    output_size = 1

    def label_domain(self) -> tuple[float, float, bool]:
        return 0, 1, True

    def predictions(self, outputs, head):
        return torch.sigmoid(outputs.float())

    def divergence(self, a, b):
        """KL + reverse KL of Bernoulli(sigmoid(a)) and Bernoulli(sigmoid(b)); it reduces to (p - q)(a - b)."""
        a, b = a.float(), b.float()
        return (torch.sigmoid(a) - torch.sigmoid(b)) * (a - b)

    def metrics(self, values, labels):
        predicted = values >= 0.5
        gold = labels.astype(int) == 1
        return {"accuracy": float(np.mean(predicted == gold)), "f1": _f1(predicted, gold)}

    def smooth_loss(self, values, labels):
        p = np.clip(values, 1e-12, 1 - 1e-12)
        gold = labels.astype(int) == 1
        return float(-np.mean(np.where(gold, np.log(p), np.log1p(-p))))

    def predicted_labels(self, values):
        return (values >= 0.5).astype(np.int64)

    def value_columns(self):
        return ["prob"]


class Regression(Kind):
    name = "regression"
    metric_names = KIND_METRICS["regression"]
    plot = "scatter"
    label_type = pa.float64()
    cosine_affine = False  # cos itself is the similarity, scaled to the label range
    output_size = 1

    def __init__(self, low: float, high: float):
        self.low, self.high = low, high

    def label_domain(self) -> tuple[float, float, bool]:
        return self.low, self.high, False

    def parse_labels(self, values: pd.Series) -> pd.Series:
        return values.astype("float64")

    def label_distribution(self, labels: pd.Series) -> dict:
        """Mean, std and a histogram of unit-width bins over the range, the last one closed."""
        edges = list(np.arange(self.low, self.high, 1.0)) + [self.high + 1e-4]
        names = [f"{a:g}-{min(a + 1, self.high):g}" for a in edges[:-1]]
        bins = pd.cut(labels, bins=edges, right=False, labels=names)
        histogram = {str(name): int(count) for name, count in bins.value_counts(sort=False).items()}
        return {"mean": round(float(labels.mean()), 4), "std": round(float(labels.std()), 4),
                "histogram": histogram}

    def _unit(self, head) -> bool:
        return head.target == "unit"

    def head_output(self, out, head, is_cosine):
        out = out.squeeze(-1)
        if self._unit(head):
            return out if is_cosine else torch.sigmoid(out)
        return self.low + (self.high - self.low) * out if is_cosine else out

    def predictions(self, outputs, head):
        outputs = outputs.float()
        return outputs * (self.high - self.low) + self.low if self._unit(head) else outputs

    def divergence(self, a, b):
        if a.shape != b.shape:
            raise ValueError(f"squared error of shapes {tuple(a.shape)} and {tuple(b.shape)}: they must match")
        return (a.float() - b.float()) ** 2

    def metrics(self, values, labels):
        if len(values) < 2 or np.std(values) == 0:
            return {"pearson": 0.0, "spearman": 0.0}
        from scipy import stats  # here: scipy.stats takes ~1 s to import, and `mtbert predict` never scores
        return {"pearson": float(stats.pearsonr(values, labels).statistic),
                "spearman": float(stats.spearmanr(values, labels).statistic)}

    def smooth_loss(self, values, labels):
        return float(np.mean((values - labels) ** 2))

    def predicted_labels(self, values):
        return values

    def value_columns(self):
        return ["score"]

    def plot_table(self, values, labels):
        return pd.DataFrame({"gold": labels, "predicted": np.round(values, 4)})


def _f1(predicted: np.ndarray, gold: np.ndarray) -> float:
    true_positive = np.sum(predicted & gold)
    denominator = np.sum(predicted) + np.sum(gold)
    return float(2 * true_positive / denominator) if denominator else 0.0
