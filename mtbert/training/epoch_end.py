"""A fine-tuning epoch's end: the dev evaluation of the model kept (and of the raw weights), the snapshot
dumps, the epoch's record in the log and the curves, the model saved aside when some task is at its best,
the checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from mtbert import io
from mtbert.evaluation.evaluate import evaluate, predict_split
from mtbert.evaluation.metrics import headline_summary, overall, task_metrics
from mtbert.evaluation.predictions import write_dump
from mtbert.evaluation.selection import chosen_epochs
from mtbert.model.saved import epoch_dir, save_model
from mtbert.runtime import release_heap
from mtbert.training.build import FineTuning
from mtbert.training.distributed import Ranks, broadcast
from mtbert.training.progress import EpochTotals, Progress, checkpoint
from mtbert.training.publish import model_config

log = logging.getLogger("train")


def end_epoch(run: FineTuning, progress: Progress, live) -> None:
    """Evaluate and dump the epoch, log it, save the model aside if a task is at its best, checkpoint."""
    dev = dev_raw = None  # the main rank evaluates; the others wait for its figures
    release_heap()  # the steps' freed buffers go back before the dev pass takes its own: its peak is the run's
    if run.ranks.is_main:
        dev = evaluate_and_dump(run, progress.epoch + 1)
        if run.average.separate and run.train.dev_raw:  # the raw weights beside their moving average
            dev_raw = evaluate(run.model, run.dev_data, device=run.device, bf16=run.bf16, **run.split_batches)
    dev, dev_raw = broadcast((dev, dev_raw), run.ranks)
    record = epoch_record(run, progress, dev, dev_raw)
    progress.history.append(record)
    chosen = chosen_epochs(progress.history, run.tasks, run.train.select)
    if record["epoch"] in chosen.values() and run.ranks.is_main:
        with run.whole_model():
            save_model(run.average.model, run.tokenizer, run.saved_epochs / epoch_dir(record["epoch"]),
                       model_config(run))
    progress.epoch, progress.step_in_epoch, progress.totals = progress.epoch + 1, 0, EpochTotals.empty(run.tasks)
    checkpoint(run, progress)
    if run.ranks.is_main:  # only after the checkpoint, which still names what a resumed run needs
        drop_unchosen_epochs(run.saved_epochs, set(chosen.values()))
    release_heap()  # and the dev pass's before the next epoch's steps
    if live is not None:
        log_epoch(live, record)


def evaluate_and_dump(run: FineTuning, epoch: int) -> dict:
    """The epoch's dev metrics of the model kept (the moving average with train.ema); with a snapshots path,
    its predictions of the snapshot splits as dumps, the dev pass's own reused (kept with the checkpoint until
    the run ends: `dvc repro` clears a stage's outputs before it runs)."""
    directory = run.snapshot_dumps / epoch_dir(epoch)
    model = run.average.model
    dev = {}
    for name, split in run.dev_data.items():
        values = predict_split(model, split, device=run.device, bf16=run.bf16, **run.split_batches)
        dev[name] = task_metrics(split.task, values, split.labels)
        for split_name, data in run.snapshot_data.get(name, {}).items():
            if data is not split:
                values = predict_split(model, data, device=run.device, bf16=run.bf16, **run.split_batches)
            write_dump(directory, data.task, split_name, data.ids, values)
    dev["overall"] = overall(dev, run.tasks)
    return dev


def epoch_record(run: FineTuning, progress: Progress, dev: dict, dev_raw: dict | None) -> dict:
    """The finished epoch's record (all ranks' figures), logged."""
    totals, epoch = sum_over_ranks(progress.totals.settle(), run.ranks, run.device), progress.epoch + 1
    record = {"epoch": epoch, "dev": dev,
              "train_loss": {name: totals.loss_sum[name] / max(totals.batches[name], 1) for name in run.tasks},
              "task_batches": dict(totals.batches), "examples": totals.examples, "tokens": totals.tokens,
              "lr": float(run.scheduler.get_last_lr()[0]),
              "regularisers": {name: total / n for name, (total, n) in sorted(totals.regularisers.items())}}
    if dev_raw is not None:
        record["dev_raw"] = dev_raw
        log.info("epoch %d: raw weights' dev overall %.4f  %s", epoch, dev_raw["overall"],
                 headline_summary(dev_raw, run.tasks))
    log.info("epoch %d: dev overall %.4f  %s  batches %s", epoch, dev["overall"], headline_summary(dev, run.tasks),
             record["task_batches"])
    if record["regularisers"]:
        log.info("epoch %d regularisers (batch means): %s", epoch,
                 ", ".join(f"{k} {v:.3g}" for k, v in record["regularisers"].items()))
    return record


def sum_over_ranks(totals: EpochTotals, ranks: Ranks, device: torch.device) -> EpochTotals:
    """Epoch figures of all ranks: examples and tokens summed, per-task losses averaged."""
    if not ranks.distributed:
        return totals
    summed = torch.tensor([totals.examples, totals.tokens, *totals.loss_sum.values()], dtype=torch.float64,
                          device=device)
    dist.all_reduce(summed)
    loss_sum = {task: float(summed[2 + index]) / ranks.world_size for index, task in enumerate(totals.loss_sum)}
    return dataclasses.replace(totals, examples=int(summed[0]), tokens=int(summed[1]), loss_sum=loss_sum)


def drop_unchosen_epochs(saved_epochs: Path, chosen: set[int]) -> None:
    for folder in saved_epochs.glob("epoch-*"):
        if int(folder.name.removeprefix("epoch-")) not in chosen:
            shutil.rmtree(folder, ignore_errors=True)


def log_epoch(live, record: dict) -> None:
    live.step = record["epoch"]  # the x axis counts epochs from 1, as the logs and metrics do
    for task, loss in record["train_loss"].items():
        live.log_metric(f"train/{task}/loss", io.rounded(loss))
    for name, value in record["regularisers"].items():
        live.log_metric(f"train/{name}", io.rounded(value))
    for split in ("dev", "dev_raw"):  # dev_raw: the raw weights beside their moving average (train.ema)
        for task, metrics in record.get(split, {}).items():
            if task == "overall":
                continue
            for metric, value in metrics.items():
                live.log_metric(f"{split}/{task}/{metric}", io.rounded(value))
        if split in record:
            live.log_metric(f"{split}/overall", io.rounded(record[split]["overall"]))
    live.next_step()
