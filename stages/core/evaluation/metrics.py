"""Dev metrics of the three tasks and the overall score (mean of SST acc, QQP acc, STS Pearson)."""

from __future__ import annotations

import numpy as np
from scipy import stats

HEADLINE = {"sst": "accuracy", "qqp": "accuracy", "sts": "pearson"}


def sst_metrics(probabilities: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    predicted = probabilities.argmax(-1)
    labels = labels.astype(int)
    f1s = [_f1(predicted == c, labels == c) for c in range(probabilities.shape[-1])]
    return {"accuracy": float(np.mean(predicted == labels)), "macro_f1": float(np.mean(f1s))}


def qqp_metrics(probabilities: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    predicted = probabilities >= 0.5
    gold = labels.astype(int) == 1
    return {"accuracy": float(np.mean(predicted == gold)), "f1": _f1(predicted, gold)}


def sts_metrics(scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    if len(scores) < 2 or np.std(scores) == 0:
        return {"pearson": 0.0, "spearman": 0.0}
    return {"pearson": float(stats.pearsonr(scores, labels).statistic),
            "spearman": float(stats.spearmanr(scores, labels).statistic)}


TASK_METRICS = {"sst": sst_metrics, "qqp": qqp_metrics, "sts": sts_metrics}


def task_metrics(task: str, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    return TASK_METRICS[task](predictions, labels)


def overall(per_task: dict[str, dict[str, float]]) -> float:
    return float(np.mean([per_task[task][metric] for task, metric in HEADLINE.items()]))


def _f1(predicted: np.ndarray, gold: np.ndarray) -> float:
    true_positive = np.sum(predicted & gold)
    denominator = np.sum(predicted) + np.sum(gold)
    return float(2 * true_positive / denominator) if denominator else 0.0
