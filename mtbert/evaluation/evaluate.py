"""Predictions over a whole split, and dev metrics."""

from __future__ import annotations

import numpy as np
import torch

from mtbert.data.batches import TaskSplit, eval_batches
from mtbert.evaluation.metrics import overall, task_metrics
from mtbert.model.multitask import MultitaskModel


def predict_split(model: MultitaskModel, split: TaskSplit, batch_size: int, device: torch.device,
                  bf16: bool = False) -> np.ndarray:
    """User-facing predictions in the split's row order ((N, C) class probabilities, else (N,))."""
    task = split.task.name
    encoding = model.encoding(task)
    batches = eval_batches(split.lengths(encoding), batch_size)
    outputs: list[np.ndarray] = []
    was_training = model.training
    model.eval()
    with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for rows in batches:
            batch = {k: v.to(device) for k, v in split.batch(rows, encoding).items()}
            outputs.append(model.predictions(task, model(task, batch)).float().cpu().numpy())
    model.train(was_training)
    order = np.concatenate(batches)
    result = np.empty((len(split), *outputs[0].shape[1:]), dtype=np.float64)
    result[order] = np.concatenate(outputs)
    return result


def evaluate(model: MultitaskModel, dev: dict[str, TaskSplit], batch_size: int, device: torch.device,
             bf16: bool = False) -> dict:
    """{task: {metric: value}} plus 'overall'."""
    results: dict = {}
    for name, split in dev.items():
        results[name] = task_metrics(split.task, predict_split(model, split, batch_size, device, bf16), split.labels)
    results["overall"] = overall(results, {name: split.task for name, split in dev.items()})
    return results
