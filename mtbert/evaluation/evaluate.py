"""Predictions over a whole split, dev metrics, and the dumps of a trained model (stages predict and distill)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from mtbert.data.batches import TaskSplit, eval_batches, load_split, on_device
from mtbert.evaluation.metrics import overall, task_metrics
from mtbert.evaluation.predictions import rejected_ids, write_dump, write_submission
from mtbert.model.multitask import MultitaskModel

log = logging.getLogger(__name__)


def predict_split(model: MultitaskModel, split: TaskSplit, batch_size: int, device: torch.device,
                  bf16: bool = False, multiple: int = 1) -> np.ndarray:
    """User-facing predictions in the split's row order ((N, C) class probabilities, else (N,)); each batch
    padded to a multiple of `multiple` columns (a GPU's few static widths)."""
    task = split.task.name
    encoding = model.encoding(task)
    batches = eval_batches(split.lengths(encoding), batch_size)
    outputs: list[np.ndarray] = []
    was_training = model.training
    model.eval()
    with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for rows in batches:
            batch = on_device(split.batch(rows, encoding, multiple), device)
            outputs.append(model.predictions(task, model(task, batch)).float().cpu().numpy())
    model.train(was_training)
    order = np.concatenate(batches)
    result = np.empty((len(split), *outputs[0].shape[1:]), dtype=np.float64)
    result[order] = np.concatenate(outputs)
    return result


def evaluate(model: MultitaskModel, dev: dict[str, TaskSplit], batch_size: int, device: torch.device,
             bf16: bool = False, multiple: int = 1) -> dict:
    """{task: {metric: value}} plus 'overall'."""
    results: dict = {}
    for name, split in dev.items():
        values = predict_split(model, split, batch_size, device, bf16, multiple)
        results[name] = task_metrics(split.task, values, split.labels)
    results["overall"] = overall(results, {name: split.task for name, split in dev.items()})
    return results


def write_predictions(model: MultitaskModel, splits: tuple[str, ...], tokenized_dir: Path, rejects_file: Path,
                      out_dir: Path, batch_size: int, device: torch.device, bf16: bool,
                      transfer_dir: Path | None = None, multiple: int = 1) -> dict:
    """Every task's dumps of the splits into out_dir, with the CS224N files of dev and test; the dev metrics.
    Split `transfer` is read from transfer_dir, and a task without transfer rows gets no dump of it."""
    dev_metrics = {}
    for task in model.tasks.values():
        for split in splits:
            data = load_split(transfer_dir if split == "transfer" else tokenized_dir, task, split)
            if not len(data):
                continue
            values = predict_split(model, data, batch_size, device, bf16, multiple)
            write_dump(out_dir, task, split, data.ids, values)
            if split in ("dev", "test"):  # the grader's files
                write_submission(out_dir, task, split, data.ids, values, rejected_ids(rejects_file, task.name, split))
            if split == "dev":
                dev_metrics[task.name] = task_metrics(task, values, data.labels)
            log.info("%s-%s: %d predictions", task.name, split, len(data))
    dev_metrics["overall"] = overall(dev_metrics, model.tasks)
    return dev_metrics
