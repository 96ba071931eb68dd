"""Multitask fine-tuning of one variant: the loop, keeping the epoch with the best dev overall score.

Read `Trainer.run` top to bottom: resume if a checkpoint of this very run exists, then per epoch the
sampler's schedule of task steps (forward and backward per step, an optimiser update every
`grad_accum` steps, a checkpoint every `runtime.checkpoint_every.train` updates), a dev evaluation, the
best epoch's model saved aside; at the end that model becomes the output folder and the summary the
metrics file.

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

from stages.core.data.batches import load_split
from stages.core.data.sampling import TaskStream, epoch_schedule
from stages.core.data.tasks import tasks_from_params, tokenized_path
from stages.core.evaluation.evaluate import evaluate
from stages.core.evaluation.metrics import headline_summary
from stages.core.model.backbone import load_encoder, load_tokenizer, starting_point
from stages.core.model.multitask import MultitaskModel
from stages.core.model.saved import save_model
from stages.core.params import Params, as_dict
from stages.core.training.distributed import average_tensor, broadcast, setup_process, shard, shutdown, sync_parameters
from stages.core.training.objective import BatchLoss, Objective
from stages.core.training.optim import make_optimizer
from stages.core.training.pcgrad import accumulate, flat_gradient, project_conflicts
from stages.core.training.run import Paths, ResumableRun

log = logging.getLogger("train")

# Per-batch figures of BatchLoss, averaged per epoch.
REGULARISERS = ("smart_loss", "bregman_loss", "delta_ratio", "delta_l2_ratio", "ascended")


class Trainer(ResumableRun):
    """The state of one fine-tuning run; `run()` goes from wherever the state is to the end."""

    def __init__(self, params: Params, variant: str, paths: Paths):
        self.params, self.variant, self.p = params, variant, params.train
        ranks, device = setup_process(self.p.seed, params.runtime.threads)
        super().__init__(paths, ranks, device, run_fingerprint(params, paths.tokenized, paths.pretrained,
                                                              ranks.world_size))
        self.tasks = tasks_from_params(params.tasks)
        start = starting_point(params.model.name, paths.pretrained)
        self.tokenizer = load_tokenizer(start)
        self.model = MultitaskModel(load_encoder(start), self.tasks, params.heads, params.model.arch,
                                    params.model.task_layers).to(self.device)
        sync_parameters(self.model, self.ranks)
        self.train_data = {name: load_split(paths.tokenized, task, "train", self.p.max_examples)
                           for name, task in self.tasks.items()}
        self.dev_data = {name: load_split(paths.tokenized, task, "dev", self.p.max_examples)
                         for name, task in self.tasks.items()}
        self.streams = {name: TaskStream(split.lengths(self.model.encoding(name)), self.p.batch_size[name],
                                         self.p.bucket_batches, self.p.seed, index)
                        for index, (name, split) in enumerate(self.train_data.items())}
        self.steps_per_epoch = len(self.schedule(0))
        updates_per_epoch = math.ceil(self.steps_per_epoch / self.p.grad_accum)
        num_layers = self.model.encoder.config.num_hidden_layers
        self.optimizer, self.scheduler = make_optimizer(self.model, num_layers, self.p,
                                                        updates_per_epoch * self.p.epochs)
        self.objective = Objective(self.model, params.smart, self.device, self.p.bf16, self.p.seed)
        self.epoch, self.step_in_epoch, self.updates = 0, 0, 0
        self.best = {"epoch": -1, "overall": -math.inf}
        self.running = self.empty_running()

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
        return {"streams": {name: stream.state() for name, stream in self.streams.items()}, "epoch": self.epoch,
                "step_in_epoch": self.step_in_epoch, "updates": self.updates, "best": json.dumps(self.best)}

    def load_loop_state(self, state: dict) -> None:
        for name, stream in self.streams.items():
            stream.load_state(state["streams"][name])
        self.epoch, self.step_in_epoch, self.updates = state["epoch"], state["step_in_epoch"], state["updates"]
        self.best = json.loads(state["best"])

    def rank_state(self) -> dict:
        return {"objective": self.objective.state_dict()}  # SMART's noise generator, the teacher

    def load_rank_state(self, state: dict) -> None:
        self.objective.load_state_dict(state["objective"])

    # --- the loop -----------------------------------------------------------------------------------
    def run(self) -> dict:
        if self.resume():
            log.info("resuming from epoch %d step %d", self.epoch + 1, self.step_in_epoch)
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
            shutil.rmtree(self.paths.model_out, ignore_errors=True)
            shutil.copytree(self.paths.checkpoints / "best", self.paths.model_out)
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
        per_task = []
        for task in tasks:
            global_rows = self.streams[task].next()  # the same on every rank
            rows = shard(global_rows, self.ranks)
            # Each rank's batch-mean loss, weighted by its share, so the average over ranks is the global mean.
            share = len(rows) * self.ranks.world_size / len(global_rows)
            loss = self.task_loss(task, rows) * share if len(rows) else None
            if self.p.gradient == "pcgrad":  # each task's gradient now, so only one graph is alive at a time
                gradient = flat_gradient(loss / self.p.grad_accum, self.trainable()) if loss is not None \
                    else torch.zeros(sum(p.numel() for p in self.trainable()), device=self.device)
                per_task.append(average_tensor(gradient, self.ranks))  # project the global gradients
            elif loss is not None:
                per_task.append(loss)
        if self.p.gradient == "pcgrad":
            order = np.random.default_rng([self.p.seed, 4099, self.epoch, self.step_in_epoch])
            accumulate(self.trainable(), sum(project_conflicts(per_task, order)))
        elif per_task:
            (sum(per_task) / self.p.grad_accum).backward()

    def task_loss(self, task: str, rows: np.ndarray) -> torch.Tensor:
        batch = {k: v.to(self.device) for k, v in self.train_data[task].batch(rows, self.model.encoding(task)).items()}
        result = self.objective(self.model, task, batch)
        self.check_finite(result.total, f"{task} loss", f"at epoch {self.epoch + 1} step {self.step_in_epoch + 1}",
                          "Lower train.lr or turn off train.bf16.")
        self.count(task, rows, batch, result)
        return result.total

    def count(self, task: str, rows, batch: dict[str, torch.Tensor], result: BatchLoss) -> None:
        running = self.running
        running["loss_sum"][task] += result.task_loss
        running["batches"][task] += 1
        running["examples"] += len(rows)
        running["tokens"] += int(sum(v.sum() for k, v in batch.items() if k.startswith("attention_mask")))
        for name in REGULARISERS:
            value = getattr(result, name)
            if value is not None:
                total, count = running["regularisers"].get(f"{task}/{name}", (0.0, 0))
                running["regularisers"][f"{task}/{name}"] = (total + value, count + 1)

    def update(self) -> None:
        # pcgrad averaged each task's gradient over the ranks before projecting
        self.optimizer_step(self.p.grad_clip, average=self.p.gradient != "pcgrad")
        self.objective.after_update(self.model)
        self.updates += 1

    def end_epoch(self, live) -> None:
        """Evaluate on dev, keep the model if it is the best epoch so far, log, checkpoint."""
        dev = None  # the main rank evaluates; the others wait for its figures
        if self.ranks.is_main:
            dev = evaluate(self.model, self.dev_data, self.p.eval_batch_size, self.device, self.p.bf16)
        dev = broadcast(dev, self.ranks)
        self.sum_running_over_ranks()
        running = self.running
        record = {"epoch": self.epoch + 1, "dev": dev,
                  "train_loss": {name: running["loss_sum"][name] / max(running["batches"][name], 1)
                                 for name in self.tasks},
                  "task_batches": dict(running["batches"]), "examples": running["examples"],
                  "tokens": running["tokens"], "lr": self.scheduler.get_last_lr()[0],
                  "regularisers": {name: total / count
                                   for name, (total, count) in sorted(running["regularisers"].items())}}
        log.info("epoch %d: dev overall %.4f  %s  batches %s", self.epoch + 1, dev["overall"],
                 headline_summary(dev, self.tasks), record["task_batches"])
        if record["regularisers"]:
            log.info("epoch %d regularisers (batch means): %s", self.epoch + 1,
                     ", ".join(f"{k} {v:.3g}" for k, v in record["regularisers"].items()))
        if dev["overall"] > self.best["overall"]:
            self.best = {"epoch": self.epoch + 1, "overall": dev["overall"]}
            if self.ranks.is_main:
                save_model(self.model, self.tokenizer, self.paths.checkpoints / "best", self.model_config())
        self.history.append(record)
        self.epoch, self.step_in_epoch, self.running = self.epoch + 1, 0, self.empty_running()
        self.checkpoint()
        if live is not None:
            log_epoch(live, record)

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
        config = as_dict(self.params)
        config.pop("models")
        config.pop("runtime")  # how fast it ran, not what it is
        return {"variant": self.variant, "params": config}

    def summary(self) -> dict:
        best_record = self.history[self.best["epoch"] - 1]
        return {"variant": self.variant, "best_epoch": self.best["epoch"], "dev": best_record["dev"],
                "epochs": [{"epoch": r["epoch"], "dev_overall": r["dev"]["overall"],
                            "train_loss": r["train_loss"], "task_batches": r["task_batches"],
                            "examples": r["examples"],
                            **({"regularisers": r["regularisers"]} if r["regularisers"] else {})}
                           for r in self.history],
                "parameters": self.parameter_count(),
                "speed": self.speed(self.steps_per_epoch * self.p.epochs, sum(r["examples"] for r in self.history),
                                    sum(r["tokens"] for r in self.history))}


def log_epoch(live, record: dict) -> None:
    for task, metrics in record["dev"].items():
        if task == "overall":
            continue
        for metric, value in metrics.items():
            live.log_metric(f"dev/{task}/{metric}", value)
        live.log_metric(f"train/{task}/loss", record["train_loss"][task])
    for name, value in record["regularisers"].items():
        live.log_metric(f"train/{name}", value)
    live.log_metric("dev/overall", record["dev"]["overall"])
    live.next_step()


def run_fingerprint(params: Params, tokenized_dir: Path, pretrained: Path | None, world_size: int = 1) -> str:
    """Identifies a run: its params (less `runtime`, which changes no result), the data and the start weights."""
    digest = hashlib.sha256()
    relevant = as_dict(params)
    relevant.pop("models")  # the other variants' overrides; this variant's are already merged in
    relevant.pop("runtime")
    digest.update(json.dumps({**relevant, "world_size": world_size}, sort_keys=True).encode())
    for task in params.tasks:
        for split in ("train", "dev"):
            digest.update(tokenized_path(tokenized_dir, task, split).read_bytes())
    for path in sorted(pretrained.glob("*.safetensors")) if pretrained is not None else []:
        digest.update(path.read_bytes())
    return digest.hexdigest()
