"""Dev metrics: each task's by its kind (mtbert/data/kinds.py), and the overall score, the mean of
every task's headline metric (by default SST accuracy, QQP accuracy, STS Pearson)."""

from __future__ import annotations

import numpy as np

from mtbert.data.tasks import Task


def task_metrics(task: Task, values: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    return task.kind.metrics(values, labels)


def headline(task: Task, values: np.ndarray, labels: np.ndarray) -> float:
    return task_metrics(task, values, labels)[task.headline]


def overall(per_task: dict[str, dict[str, float]], tasks: dict[str, Task]) -> float:
    return float(np.mean([per_task[name][task.headline] for name, task in tasks.items()]))


def headline_summary(per_task: dict[str, dict[str, float]], tasks: dict[str, Task]) -> str:
    """For the logs, e.g. 'sst accuracy 0.4859  qqp accuracy 0.8425  sts pearson 0.8634'."""
    return "  ".join(f"{name} {task.headline} {per_task[name][task.headline]:.4f}" for name, task in tasks.items())
