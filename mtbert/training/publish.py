"""A finished fine-tuning run's outputs: the summary (metrics/train/<variant>.json), the model folder
assembled from the epochs each task chose, with its card, and the published snapshot dumps."""

from __future__ import annotations

import shutil

import torch

from mtbert import io
from mtbert.evaluation.selection import chosen_epochs, chosen_metrics
from mtbert.model.card import variant_card
from mtbert.model.saved import assemble_model
from mtbert.params import as_dict
from mtbert.training.build import NOT_TRAINING, FineTuning
from mtbert.training.loop import speed
from mtbert.training.progress import Progress


def publish(run: FineTuning, result: dict) -> None:
    """The chosen epochs' saved models become the model folder, with its model card; the snapshot dumps,
    with the epoch each task chose, are published for the ensemble."""
    task_epochs, config = result["task_epochs"], model_config(run)
    card = variant_card(result, config["params"], run.tasks, str(run.paths.model_out))
    assemble_model(run.paths.model_out, run.saved_epochs, task_epochs, config, card)
    if run.paths.snapshots is not None:
        with io.atomic_dir(run.paths.snapshots) as temp:
            shutil.copytree(run.snapshot_dumps, temp, dirs_exist_ok=True)
            io.write_json(temp / "chosen.json", task_epochs)


def model_config(run: FineTuning) -> dict:
    """What the model folder records (mtbert.json): the variant and its merged params."""
    config = {key: value for key, value in as_dict(run.params).items() if key not in NOT_TRAINING}
    return {"variant": run.variant, "params": config}


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def summary(run: FineTuning, progress: Progress) -> dict:
    history = progress.history
    task_epochs = chosen_epochs(history, run.tasks, run.train.select)
    return {"variant": run.variant, "select": run.train.select, "task_epochs": task_epochs,
            "dev": chosen_metrics(history, run.tasks, task_epochs),
            "epochs": [{"epoch": r["epoch"], "dev": r["dev"], "train_loss": r["train_loss"],
                        "task_batches": r["task_batches"], "examples": r["examples"],
                        **({"dev_raw": r["dev_raw"]} if "dev_raw" in r else {}),
                        **({"regularisers": r["regularisers"]} if r["regularisers"] else {})}
                       for r in history],
            "parameters": parameter_count(run.model),
            "speed": speed(run.stopwatch.seconds, run.ranks, run.bf16, run.steps_per_epoch * run.train.epochs,
                           sum(r["examples"] for r in history), sum(r["tokens"] for r in history))}
