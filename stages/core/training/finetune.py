"""Multitask fine-tuning of one variant: the loop, keeping each task's model from its best dev epoch.

Read `Trainer.run` top to bottom: resume if a checkpoint of this very run exists, then per epoch the
sampler's schedule of task steps (forward and backward per step, an optimiser update every
`grad_accum` steps, a checkpoint every `runtime.checkpoint_every.train` updates), then the epoch's dev and
test predictions (the snapshot dumps the ensemble may use), and the model saved aside if some task's
dev metric is now at its best (`train.select: task`; `overall` keeps one epoch for all tasks). At the
end the saved epochs that some task chose become the model folder, the snapshot dumps are published,
and the summary becomes the metrics file. With `train.ema`, "the model" evaluated, dumped and saved is the
moving average of the weights, updated after every optimiser step; the raw weights' dev metrics are logged
beside it (`dev_raw`), so one run compares the two on the same trajectory.

Public interface (the `train` stage, bench/ and the tests use these): `Trainer(params, variant, paths)`,
`run()`, `schedule(epoch)`, `forward_backward(tasks)`, `update()`, `checkpoint()`, `parameter_count()`,
and the attributes `model`, `objective`, `tasks`, `train_data`, `dev_data`, `device`, `params`, `p`
(= params.train).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from stages.core import io
from stages.core.data.batches import load_split
from stages.core.data.sampling import TaskStream, epoch_schedule
from stages.core.data.tasks import tasks_from_params, tokenized_path
from stages.core.evaluation.evaluate import evaluate, predict_split
from stages.core.evaluation.metrics import headline_summary, overall, task_metrics
from stages.core.evaluation.predictions import write_dump
from stages.core.model.backbone import load_encoder, load_tokenizer, starting_point
from stages.core.model.card import variant_card
from stages.core.model.multitask import MultitaskModel
from stages.core.model.saved import assemble_model, epoch_dir, save_model
from stages.core.params import Params, as_dict
from stages.core.runtime import limit_memory_growth
from stages.core.training.averaging import MovingAverage
from stages.core.training.distributed import average_tensor, broadcast, setup_process, shard, shutdown, sync_parameters
from stages.core.training.objective import BatchLoss, Objective
from stages.core.training.optim import make_optimizer
from stages.core.training.pcgrad import accumulate, flat_gradient, project_conflicts
from stages.core.training.run import Paths, ResumableRun
from stages.core.training.selection import chosen_epochs, chosen_metrics

log = logging.getLogger("train")

# Sections that do not change what `train` computes: left out of the run's fingerprint and mtbert.json.
NOT_TRAINING = ("models", "runtime", "predict", "ensemble", "stats")

# Per-batch figures of BatchLoss, averaged per epoch.
REGULARISERS = ("smart_loss", "bregman_loss", "delta_ratio", "delta_l2_ratio", "ascended")


class Trainer(ResumableRun):
    """The state of one fine-tuning run; `run()` goes from wherever the state is to the end."""

    def __init__(self, params: Params, variant: str, paths: Paths):
        self.params, self.variant, self.p = params, variant, params.train
        limit_memory_growth(params.runtime.onednn_cache, params.runtime.malloc_threshold_mb)
        ranks, device = setup_process(self.p.seed, params.runtime.threads)
        super().__init__(paths, ranks, device, run_fingerprint(params, paths.tokenized, paths.pretrained,
                                                              ranks.world_size), self.p.bf16)
        self.tasks = tasks_from_params(params.tasks)
        start = starting_point(params.model.name, paths.pretrained)
        self.tokenizer = load_tokenizer(start)
        self.model = MultitaskModel(load_encoder(start), self.tasks, params.heads, params.model.arch,
                                    params.model.task_layers).to(self.device)
        sync_parameters(self.model, self.ranks)
        self.average = MovingAverage(self.model, self.p.ema) if self.p.ema > 0 else None
        self.train_data = {name: load_split(paths.tokenized, task, "train", self.train_rows(name))
                           for name, task in self.tasks.items()}
        self.dev_data = {name: load_split(paths.tokenized, task, "dev", self.p.max_examples)
                         for name, task in self.tasks.items()}
        # Snapshot dumps cover the whole dev and test splits, so the ensemble can align them with predict's.
        self.snapshot_data = {name: {"dev": self.dev_data[name] if not self.p.max_examples
                                     else load_split(paths.tokenized, task, "dev"),
                                     "test": load_split(paths.tokenized, task, "test")}
                              for name, task in self.tasks.items()} if paths.snapshots and self.ranks.is_main else {}
        self.row_lengths = {name: split.lengths(self.model.encoding(name)) for name, split in self.train_data.items()}
        self.streams = {name: TaskStream(self.row_lengths[name], self.p.batch_size[name],
                                         self.p.bucket_batches, self.p.seed, index)
                        for index, name in enumerate(self.train_data)}
        self.steps_per_epoch = len(self.schedule(0))
        updates_per_epoch = math.ceil(self.steps_per_epoch / self.p.grad_accum)
        num_layers = self.model.encoder.config.num_hidden_layers
        self.optimizer, self.scheduler = make_optimizer(self.model, num_layers, self.p,
                                                        updates_per_epoch * self.p.epochs)
        self.objective = Objective(self.model, params.smart, self.device, self.bf16, self.p.seed)
        self.epoch, self.step_in_epoch, self.updates = 0, 0, 0
        self.running = self.empty_running()

    def train_rows(self, task: str) -> int:
        """How many of the task's training rows to train on: the smaller of the caps that are set (0: all)."""
        caps = [cap for cap in (self.p.max_examples, self.p.max_train_examples[task]) if cap]
        return min(caps, default=0)

    def schedule(self, epoch: int) -> list[tuple[str, ...]]:
        """The tasks of each step of one epoch, by the sampler."""
        sizes = {name: len(split) for name, split in self.train_data.items()}
        batches = {name: stream.batches_per_pass for name, stream in self.streams.items()}
        return epoch_schedule(self.p.sampler, batches, sizes, seed=self.p.seed, epoch=epoch,
                              epochs=self.p.epochs, temperature=self.p.temperature)

    def empty_running(self) -> dict:
        return {"loss_sum": {name: 0.0 for name in self.tasks}, "batches": {name: 0 for name in self.tasks},
                "examples": 0, "tokens": 0, "regularisers": {}}

    # --- the state beyond the skeleton's ------------------------------------------------------------
    def loop_state(self) -> dict:
        state = {"streams": {name: stream.state() for name, stream in self.streams.items()}, "epoch": self.epoch,
                 "step_in_epoch": self.step_in_epoch, "updates": self.updates}
        if self.average is not None:  # the same on every rank, as the weights are
            state["average"] = self.average.state_dict()
        return state

    def load_loop_state(self, state: dict) -> None:
        for name, stream in self.streams.items():
            stream.load_state(state["streams"][name])
        self.epoch, self.step_in_epoch, self.updates = state["epoch"], state["step_in_epoch"], state["updates"]
        if self.average is not None:
            self.average.load_state_dict(state["average"])

    def rank_state(self) -> dict:
        return {"objective": self.objective.state_dict()}  # SMART's noise generator, the teacher

    def load_rank_state(self, state: dict) -> None:
        self.objective.load_state_dict(state["objective"])

    # --- the loop -----------------------------------------------------------------------------------
    def run(self) -> dict:
        if self.resume():
            log.info("resuming from epoch %d step %d", self.epoch + 1, self.step_in_epoch)
        elif self.ranks.is_main:  # a killed run with other params or data may have left its epochs here
            for leftover in (self.saved_epochs, self.snapshot_dumps):
                shutil.rmtree(leftover, ignore_errors=True)
        live = self.open_live(log_epoch)
        log.info("%s: arch %s, %d steps per epoch, %d epochs, sampler %s, gradient %s, %s parameters, %d rank(s)",
                 self.variant, self.params.model.arch, self.steps_per_epoch, self.p.epochs, self.p.sampler,
                 self.p.gradient, f"{self.parameter_count():,}", self.ranks.world_size)
        while self.epoch < self.p.epochs:
            self.train_epoch()
            self.end_epoch(live)
        if live is not None:
            live.end()
        summary = self.summary()
        if self.ranks.is_main:
            self.publish(summary)
        self.finish(summary)
        shutdown(self.ranks)
        return summary

    def train_epoch(self) -> None:
        schedule = self.schedule(self.epoch)
        self.model.train()
        progress = tqdm(total=len(schedule), initial=self.step_in_epoch, desc=f"epoch {self.epoch + 1}",
                        unit="step", mininterval=2.0, disable=not self.ranks.is_main)
        self.stopwatch.start()
        while self.step_in_epoch < len(schedule):
            self.forward_backward(schedule[self.step_in_epoch])
            self.step_in_epoch += 1
            progress.update(1)
            if self.step_in_epoch % self.p.grad_accum == 0 or self.step_in_epoch == len(schedule):
                self.update()
                if (self.updates % self.params.runtime.checkpoint_every.train == 0
                        and self.step_in_epoch < len(schedule)):
                    self.checkpoint()
        progress.close()
        self.stopwatch.stop()

    def forward_backward(self, tasks: tuple[str, ...]) -> None:
        """One step's losses, backpropagated (scaled for gradient accumulation) into the .grad fields."""
        per_task = []  # pcgrad: each task's gradient, averaged over the ranks
        for task in tasks:
            global_rows = self.streams[task].next()  # the same on every rank
            rows = shard(global_rows, self.ranks)
            gradient = None
            for piece in self.micro_batches(task, rows):
                # Each piece's mean loss, weighted by its share of the global batch, so that the sum over
                # pieces and ranks is the global batch mean.
                share = len(piece) * self.ranks.world_size / len(global_rows)
                loss = self.task_loss(task, piece, len(piece) / len(rows)) * share / self.p.grad_accum
                if self.p.gradient == "pcgrad":  # one graph alive at a time
                    piece_gradient = flat_gradient(loss, self.trainable())
                    gradient = piece_gradient if gradient is None else gradient + piece_gradient
                else:
                    loss.backward()  # frees the piece's activations before the next piece runs
            if len(rows):
                self.running["batches"][task] += 1
            if self.p.gradient == "pcgrad":
                if gradient is None:  # this rank's shard of the batch is empty
                    gradient = torch.zeros(sum(p.numel() for p in self.trainable()), device=self.device)
                per_task.append(average_tensor(gradient, self.ranks))  # project the global gradients
        if self.p.gradient == "pcgrad":
            order = np.random.default_rng([self.p.seed, 4099, self.epoch, self.step_in_epoch])
            accumulate(self.trainable(), sum(project_conflicts(per_task, order)))

    def micro_batches(self, task: str, rows: np.ndarray) -> list[np.ndarray]:
        """`rows` in pieces of at most `train.max_batch_tokens` padded tokens (0: one piece). A batch of long
        sentences otherwise holds all its activations at once, and those few batches set training's memory
        peak. The pieces' gradients add up to the batch's; only the dropout masks are drawn differently."""
        if not self.p.max_batch_tokens or len(rows) <= 1:
            return [rows] if len(rows) else []
        padded_tokens = len(rows) * int(self.row_lengths[task][rows].max())
        return np.array_split(rows, min(len(rows), math.ceil(padded_tokens / self.p.max_batch_tokens)))

    def task_loss(self, task: str, rows: np.ndarray, weight: float) -> torch.Tensor:
        """The mean loss of `rows` of a task; `weight` is their share of this rank's batch, for the
        running means."""
        batch = {k: v.to(self.device) for k, v in self.train_data[task].batch(rows, self.model.encoding(task)).items()}
        result = self.objective(self.model, task, batch)
        self.check_finite(result.total, f"{task} loss", f"at epoch {self.epoch + 1} step {self.step_in_epoch + 1}",
                          "Lower train.lr or turn off train.bf16.")
        self.count(task, rows, batch, result, weight)
        return result.total

    def count(self, task: str, rows, batch: dict[str, torch.Tensor], result: BatchLoss, weight: float) -> None:
        running = self.running
        running["loss_sum"][task] += result.task_loss * weight
        running["examples"] += len(rows)
        running["tokens"] += int(sum(v.sum() for k, v in batch.items() if k.startswith("attention_mask")))
        for name in REGULARISERS:
            value = getattr(result, name)
            if value is not None:
                total, count = running["regularisers"].get(f"{task}/{name}", (0.0, 0))
                running["regularisers"][f"{task}/{name}"] = (total + value * weight, count + weight)

    def update(self) -> None:
        # pcgrad averaged each task's gradient over the ranks before projecting
        self.optimizer_step(self.p.grad_clip, average=self.p.gradient != "pcgrad")
        self.objective.after_update(self.model)
        if self.average is not None:
            self.average.update(self.model)
        self.updates += 1

    @property
    def evaluated_model(self) -> MultitaskModel:
        """The model each epoch evaluates, dumps and keeps: the weights' moving average with `train.ema`."""
        return self.average.model if self.average is not None else self.model

    def end_epoch(self, live) -> None:
        """Predict dev (and test, for the snapshot dumps), keep the model if a task is at its best, log,
        checkpoint."""
        dev = dev_raw = None  # the main rank evaluates; the others wait for its figures
        if self.ranks.is_main:
            dev = self.evaluate_and_dump()
            if self.average is not None:
                dev_raw = evaluate(self.model, self.dev_data, self.p.eval_batch_size, self.device, self.bf16)
        dev, dev_raw = broadcast((dev, dev_raw), self.ranks)
        self.sum_running_over_ranks()
        running = self.running
        record = {"epoch": self.epoch + 1, "dev": dev,
                  "train_loss": {name: running["loss_sum"][name] / max(running["batches"][name], 1)
                                 for name in self.tasks},
                  "task_batches": dict(running["batches"]), "examples": running["examples"],
                  "tokens": running["tokens"], "lr": self.scheduler.get_last_lr()[0],
                  "regularisers": {name: total / count
                                   for name, (total, count) in sorted(running["regularisers"].items())}}
        if dev_raw is not None:
            record["dev_raw"] = dev_raw
            log.info("epoch %d: raw weights' dev overall %.4f  %s", self.epoch + 1, dev_raw["overall"],
                     headline_summary(dev_raw, self.tasks))
        log.info("epoch %d: dev overall %.4f  %s  batches %s", self.epoch + 1, dev["overall"],
                 headline_summary(dev, self.tasks), record["task_batches"])
        if record["regularisers"]:
            log.info("epoch %d regularisers (batch means): %s", self.epoch + 1,
                     ", ".join(f"{k} {v:.3g}" for k, v in record["regularisers"].items()))
        self.history.append(record)
        chosen = chosen_epochs(self.history, self.tasks, self.p.select)
        if self.epoch + 1 in chosen.values() and self.ranks.is_main:
            save_model(self.evaluated_model, self.tokenizer, self.saved_epochs / epoch_dir(self.epoch + 1),
                       self.model_config())
        self.epoch, self.step_in_epoch, self.running = self.epoch + 1, 0, self.empty_running()
        self.checkpoint()
        if self.ranks.is_main:  # only after the checkpoint, which still names what a resumed run needs
            self.drop_unchosen_epochs(set(chosen.values()))
        if live is not None:
            log_epoch(live, record)

    def evaluate_and_dump(self) -> dict:
        """The epoch's dev metrics; with a snapshots path, its dev and test predictions as snapshot dumps
        (kept with the checkpoint until the run ends: `dvc repro` clears a stage's outputs before it runs)."""
        directory = self.snapshot_dumps / epoch_dir(self.epoch + 1)
        dev = {}
        model = self.evaluated_model
        for name, split in self.dev_data.items():
            values = predict_split(model, split, self.p.eval_batch_size, self.device, self.bf16)
            dev[name] = task_metrics(split.task, values, split.labels)
            for split_name, data in self.snapshot_data.get(name, {}).items():
                if data is not split:
                    values = predict_split(model, data, self.p.eval_batch_size, self.device, self.bf16)
                write_dump(directory, data.task, split_name, data.ids, values)
        dev["overall"] = overall(dev, self.tasks)
        return dev

    @property
    def saved_epochs(self) -> Path:
        """Whole-model snapshots of the epochs some task keeps, until the run ends."""
        return self.paths.checkpoints / "epochs"

    @property
    def snapshot_dumps(self) -> Path:
        """Every epoch's prediction dumps, until the run ends."""
        return self.paths.checkpoints / "snapshots"

    def drop_unchosen_epochs(self, chosen: set[int]) -> None:
        for folder in self.saved_epochs.glob("epoch-*"):
            if int(folder.name.removeprefix("epoch-")) not in chosen:
                shutil.rmtree(folder, ignore_errors=True)

    def publish(self, summary: dict) -> None:
        """The chosen epochs' saved models become the model folder, with its model card; the snapshot dumps,
        with the epoch each task chose, are published for the ensemble."""
        task_epochs, config = summary["task_epochs"], self.model_config()
        card = variant_card(summary, config["params"], self.tasks, str(self.paths.model_out))
        assemble_model(self.paths.model_out, self.saved_epochs, task_epochs, config, card)
        if self.paths.snapshots is not None:
            with io.atomic_dir(self.paths.snapshots) as temp:
                shutil.copytree(self.snapshot_dumps, temp, dirs_exist_ok=True)
                io.write_json(temp / "chosen.json", task_epochs)

    def sum_running_over_ranks(self) -> None:
        """Epoch figures of all ranks: examples and tokens summed, per-task losses averaged."""
        if not self.ranks.distributed:
            return
        running = self.running
        totals = torch.tensor([running["examples"], running["tokens"], *running["loss_sum"].values()],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        running["examples"], running["tokens"] = int(totals[0]), int(totals[1])
        for index, task in enumerate(running["loss_sum"]):
            running["loss_sum"][task] = float(totals[2 + index]) / self.ranks.world_size

    # --- outputs ------------------------------------------------------------------------------------
    def model_config(self) -> dict:
        """What the model folder records (mtbert.json): the variant and its merged params."""
        config = {key: value for key, value in as_dict(self.params).items() if key not in NOT_TRAINING}
        return {"variant": self.variant, "params": config}

    def summary(self) -> dict:
        task_epochs = chosen_epochs(self.history, self.tasks, self.p.select)
        return {"variant": self.variant, "select": self.p.select, "task_epochs": task_epochs,
                "dev": chosen_metrics(self.history, self.tasks, task_epochs),
                "epochs": [{"epoch": r["epoch"], "dev": r["dev"],
                            "train_loss": r["train_loss"], "task_batches": r["task_batches"],
                            "examples": r["examples"],
                            **({"dev_raw": r["dev_raw"]} if "dev_raw" in r else {}),
                            **({"regularisers": r["regularisers"]} if r["regularisers"] else {})}
                           for r in self.history],
                "parameters": self.parameter_count(),
                "speed": self.speed(self.steps_per_epoch * self.p.epochs, sum(r["examples"] for r in self.history),
                                    sum(r["tokens"] for r in self.history))}


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


def run_fingerprint(params: Params, tokenized_dir: Path, pretrained: Path | None, world_size: int = 1) -> str:
    """Identifies a run: its params (less `runtime`, which changes no result), the data and the start weights."""
    digest = hashlib.sha256()
    # `models` holds the other variants' overrides; this variant's are already merged in.
    relevant = {key: value for key, value in as_dict(params).items() if key not in NOT_TRAINING}
    digest.update(json.dumps({**relevant, "world_size": world_size}, sort_keys=True).encode())
    for task in params.tasks:
        for split in ("train", "dev", "test"):  # test: the snapshot dumps predict it
            digest.update(tokenized_path(tokenized_dir, task, split).read_bytes())
    for path in sorted(pretrained.glob("*.safetensors")) if pretrained is not None else []:
        digest.update(path.read_bytes())
    return digest.hexdigest()
