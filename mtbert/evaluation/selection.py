"""Which epoch each task's predictions come from: its own best dev epoch (`task`, as the best single
models of the reports kept them), or the one epoch with the best dev overall score (`overall`).

Both read the same history, one record per finished epoch (epoch 1 first) with its dev metrics; a tie
goes to the earlier epoch.
"""

from __future__ import annotations

import numpy as np

from mtbert.data.tasks import Task
from mtbert.evaluation.metrics import overall


def best_epoch(scores: list[float]) -> int:
    """The 1-based epoch of the highest score; np.argmax takes the first of equal ones; NaN never wins."""
    return int(np.argmax(np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=-np.inf))) + 1


def chosen_epochs(history: list[dict], tasks: dict[str, Task], rule: str) -> dict[str, int]:
    """Task name -> the epoch its model is kept from."""
    if rule == "overall":
        epoch = best_epoch([record["dev"]["overall"] for record in history])
        return {name: epoch for name in tasks}
    return {name: best_epoch([record["dev"][name][task.headline] for record in history])
            for name, task in tasks.items()}


def chosen_metrics(history: list[dict], tasks: dict[str, Task], epochs: dict[str, int]) -> dict:
    """Each task's dev metrics at its chosen epoch, and their overall score."""
    dev = {name: history[epochs[name] - 1]["dev"][name] for name in tasks}
    dev["overall"] = overall(dev, tasks)
    return dev
