"""Stage `train@<variant>`: multitask fine-tuning of one variant, keeping the best epoch by dev overall.

Resume: a checkpoint (model, optimiser, scheduler, RNG, sampler position, history) is written every
train.checkpoint_every optimiser steps and at every epoch end to checkpoints/<variant>/; a killed run
started again continues from it and ends as an uninterrupted run would. The folder is not a DVC
output, so `dvc repro` does not wipe it; it is removed when the run finishes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import typer
from tqdm.auto import tqdm

from stages.core import io
from stages.core.data.batches import load_split
from stages.core.data.sampling import TaskStream, epoch_schedule
from stages.core.data.tasks import TASK_NAMES, tokenized_path
from stages.core.evaluation.evaluate import evaluate
from stages.core.model.backbone import load_encoder, load_tokenizer, starting_point
from stages.core.model.multitask import MultitaskModel
from stages.core.model.saved import save_model
from stages.core.params import Params, as_dict, variant_params
from stages.core.runtime import open_live, setup_logging
from stages.core.training.distributed import (
    average_gradients,
    average_tensor,
    broadcast,
    gather,
    relaunch_with_torchrun,
    setup_process,
    shard,
    shutdown,
    sync_parameters,
    under_torchrun,
)
from stages.core.training.objective import BatchLoss, Objective
from stages.core.training.optim import make_optimizer
from stages.core.training.pcgrad import accumulate, flat_gradient, project_conflicts
from stages.core.training.resume import load_checkpoint, rng_state, save_checkpoint, set_rng_state

log = logging.getLogger("train")
app = typer.Typer(add_completion=False)


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss)."""


@dataclasses.dataclass
class Paths:
    tokenized: Path
    model_out: Path
    metrics_out: Path
    live_dir: Path
    checkpoints: Path
    pretrained: Path | None = None  # the `pretrain` stage's output; None starts from model.name itself


@app.command()
def main(variant: str = typer.Option(..., "--variant", help="a key of `models:` in params.yaml"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized")),
         models_dir: Path = typer.Option(Path("models")),
         metrics_dir: Path = typer.Option(Path("metrics/train")),
         checkpoints_dir: Path = typer.Option(Path("checkpoints")),
         pretrained_dir: Path = typer.Option(Path("models/pretrained"), help="the encoder to start from")) -> None:
    setup_logging()
    params = variant_params(params_file, variant)
    if params.train.nproc > 1 and not under_torchrun():
        relaunch_with_torchrun(params.train.nproc, "stages.train", sys.argv[1:])
    paths = Paths(tokenized=tokenized_dir, model_out=models_dir / variant,
                  metrics_out=metrics_dir / f"{variant}.json", live_dir=metrics_dir / variant,
                  checkpoints=checkpoints_dir / variant, pretrained=pretrained_dir)
    summary = train(params, variant, paths)
    log.info("done: best epoch %d, dev overall %.4f", summary["best_epoch"], summary["dev"]["overall"])


class Trainer:
    """The state of one run; `run()` goes from wherever the state is to the end."""

    def __init__(self, params: Params, variant: str, paths: Paths):
        self.params, self.variant, self.paths = params, variant, paths
        self.p = params.train
        self.ranks, self.device = setup_process(self.p.seed, self.p.threads)
        start = starting_point(params.model.name, paths.pretrained)
        self.tokenizer = load_tokenizer(start)
        self.model = MultitaskModel(load_encoder(start), params.heads, params.model.arch,
                                    params.model.task_layers).to(self.device)
        sync_parameters(self.model, self.ranks)
        self.train_data = {t: load_split(paths.tokenized, t, "train", self.p.max_examples) for t in TASK_NAMES}
        self.dev_data = {t: load_split(paths.tokenized, t, "dev", self.p.max_examples) for t in TASK_NAMES}
        self.streams = {t: TaskStream(split.lengths(self.model.encoding(t)), getattr(self.p.batch_size, t),
                                      self.p.bucket_batches, self.p.seed, index)
                        for index, (t, split) in enumerate(self.train_data.items())}
        self.steps_per_epoch = len(self.schedule(0))
        updates_per_epoch = math.ceil(self.steps_per_epoch / self.p.grad_accum)
        num_layers = self.model.encoder.config.num_hidden_layers
        self.optimizer, self.scheduler = make_optimizer(self.model, num_layers, self.p,
                                                        updates_per_epoch * self.p.epochs)
        self.objective = Objective(self.model, params.smart, self.device, self.p.bf16, self.p.seed)
        self.fingerprint = run_fingerprint(params, paths.tokenized, paths.pretrained, self.ranks.world_size)
        self.epoch, self.step_in_epoch, self.updates = 0, 0, 0
        self.history: list[dict] = []
        self.best = {"epoch": -1, "overall": -math.inf}
        self.running = self._empty_running()
        self.train_seconds = 0.0

    def schedule(self, epoch: int) -> list[tuple[str, ...]]:
        sizes = {t: len(split) for t, split in self.train_data.items()}
        batches = {t: stream.batches_per_pass for t, stream in self.streams.items()}
        return epoch_schedule(self.p.sampler, batches, sizes, seed=self.p.seed, epoch=epoch,
                              epochs=self.p.epochs, temperature=self.p.temperature)

    @staticmethod
    def _empty_running() -> dict:
        return {"loss_sum": {t: 0.0 for t in TASK_NAMES}, "batches": {t: 0 for t in TASK_NAMES},
                "examples": 0, "tokens": 0, "regularisers": {}}

    # --- resume ---------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"fingerprint": self.fingerprint, "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "ranks": gather({"rng": rng_state(), "objective": self.objective.state_dict()}, self.ranks),
                "streams": {t: s.state() for t, s in self.streams.items()},
                "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "updates": self.updates,
                "history": json.dumps(self.history), "best": json.dumps(self.best),
                "running": json.dumps(self.running), "train_seconds": self.train_seconds}

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        own = state["ranks"][self.ranks.rank]  # what differs between ranks: dropout RNG, SMART's noise
        self.objective.load_state_dict(own["objective"])
        set_rng_state(own["rng"])
        for task, stream in self.streams.items():
            stream.load_state(state["streams"][task])
        self.epoch, self.step_in_epoch, self.updates = state["epoch"], state["step_in_epoch"], state["updates"]
        self.history, self.best = json.loads(state["history"]), json.loads(state["best"])
        self.running, self.train_seconds = json.loads(state["running"]), state["train_seconds"]

    def checkpoint(self) -> None:
        state = self.state()  # on every rank: it gathers each rank's RNG
        if self.ranks.is_main:
            save_checkpoint(self.paths.checkpoints / "last.pt", state)

    # --- training -------------------------------------------------------------------------------
    def run(self) -> dict:
        state = load_checkpoint(self.paths.checkpoints / "last.pt", self.fingerprint)
        if state is not None:
            self.load_state(state)
            log.info("resuming from epoch %d step %d", self.epoch + 1, self.step_in_epoch)
        live = self._open_live()
        log.info("%s: arch %s, %d steps per epoch, %d epochs, sampler %s, gradient %s, %s parameters, %d rank(s)",
                 self.variant, self.params.model.arch, self.steps_per_epoch, self.p.epochs, self.p.sampler,
                 self.p.gradient, f"{self.parameter_count():,}", self.ranks.world_size)
        while self.epoch < self.p.epochs:
            self._train_epoch()
            self._end_epoch(live)
        if live is not None:
            live.end()
        summary = self._finish()
        shutdown(self.ranks)
        return summary

    def _train_epoch(self) -> None:
        schedule = self.schedule(self.epoch)
        self.model.train()
        started = time.perf_counter()
        progress = tqdm(total=len(schedule), initial=self.step_in_epoch, desc=f"epoch {self.epoch + 1}",
                        unit="step", mininterval=2.0, disable=not self.ranks.is_main)
        while self.step_in_epoch < len(schedule):
            tasks = schedule[self.step_in_epoch]
            self.forward_backward(tasks)
            self.step_in_epoch += 1
            progress.update(1)
            if self.step_in_epoch % self.p.grad_accum == 0 or self.step_in_epoch == len(schedule):
                self.update()
                if self.updates % self.p.checkpoint_every == 0 and self.step_in_epoch < len(schedule):
                    self.train_seconds += time.perf_counter() - started
                    started = time.perf_counter()
                    self.checkpoint()
        progress.close()
        self.train_seconds += time.perf_counter() - started

    def forward_backward(self, tasks: tuple[str, ...]) -> None:
        """One step's losses, backpropagated (scaled for gradient accumulation) into the .grad fields."""
        per_task = []
        for task in tasks:
            global_rows = self.streams[task].next()  # the same on every rank
            rows = shard(global_rows, self.ranks)
            # Each rank's batch-mean loss, weighted by its share, so the average over ranks is the global mean.
            share = len(rows) * self.ranks.world_size / len(global_rows)
            loss = self._task_loss(task, rows) * share if len(rows) else None
            if self.p.gradient == "pcgrad":  # each task's gradient now, so only one graph is alive at a time
                gradient = flat_gradient(loss / self.p.grad_accum, self._trainable()) if loss is not None \
                    else torch.zeros(sum(p.numel() for p in self._trainable()), device=self.device)
                per_task.append(average_tensor(gradient, self.ranks))  # project the global gradients
            elif loss is not None:
                per_task.append(loss)
        if self.p.gradient == "pcgrad":
            order = np.random.default_rng([self.p.seed, 4099, self.epoch, self.step_in_epoch])
            accumulate(self._trainable(), sum(project_conflicts(per_task, order)))
        elif per_task:
            (sum(per_task) / self.p.grad_accum).backward()

    def _task_loss(self, task: str, rows: np.ndarray) -> torch.Tensor:
        batch = {k: v.to(self.device) for k, v in self.train_data[task].batch(rows, self.model.encoding(task)).items()}
        result = self.objective(self.model, task, batch)
        if not torch.isfinite(result.total):
            raise TrainingError(f"non-finite {task} loss ({result.total.item()}) at epoch {self.epoch + 1} "
                                f"step {self.step_in_epoch + 1}; the last good checkpoint is kept in "
                                f"{self.paths.checkpoints}. Lower train.lr or turn off train.bf16.")
        self._count(task, rows, batch, result)
        return result.total

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _count(self, task: str, rows, batch: dict[str, torch.Tensor], result: BatchLoss) -> None:
        running = self.running
        running["loss_sum"][task] += result.task_loss
        running["batches"][task] += 1
        running["examples"] += len(rows)
        running["tokens"] += int(sum(v.sum() for k, v in batch.items() if k.startswith("attention_mask")))
        for name in ("smart_loss", "bregman_loss", "delta_ratio"):
            value = getattr(result, name)
            if value is not None:
                total, count = running["regularisers"].get(f"{task}/{name}", (0.0, 0))
                running["regularisers"][f"{task}/{name}"] = (total + value, count + 1)

    def update(self) -> None:
        if self.p.gradient != "pcgrad":  # pcgrad averaged each task's gradient before projecting
            average_gradients(self._trainable(), self.ranks)
        if self.p.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.p.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.objective.after_update(self.model)
        self.updates += 1

    def _end_epoch(self, live) -> None:
        dev = None  # the main rank evaluates; the others wait for its figures
        if self.ranks.is_main:
            dev = evaluate(self.model, self.dev_data, self.p.eval_batch_size, self.device, self.p.bf16)
        dev = broadcast(dev, self.ranks)
        self._sum_running_over_ranks()
        record = {"epoch": self.epoch + 1, "dev": dev,
                  "train_loss": {t: self.running["loss_sum"][t] / max(self.running["batches"][t], 1)
                                 for t in TASK_NAMES},
                  "task_batches": dict(self.running["batches"]), "examples": self.running["examples"],
                  "tokens": self.running["tokens"], "lr": self.scheduler.get_last_lr()[0],
                  "regularisers": {name: total / count
                                   for name, (total, count) in sorted(self.running["regularisers"].items())}}
        log.info("epoch %d: dev overall %.4f  sst acc %.4f  qqp acc %.4f  sts r %.4f  batches %s",
                 self.epoch + 1, dev["overall"], dev["sst"]["accuracy"], dev["qqp"]["accuracy"],
                 dev["sts"]["pearson"], record["task_batches"])
        if record["regularisers"]:
            log.info("epoch %d regularisers (batch means): %s", self.epoch + 1,
                     ", ".join(f"{k} {v:.3g}" for k, v in record["regularisers"].items()))
        if dev["overall"] > self.best["overall"]:
            self.best = {"epoch": self.epoch + 1, "overall": dev["overall"]}
            if self.ranks.is_main:
                save_model(self.model, self.tokenizer, self.paths.checkpoints / "best", self.model_config())
        self.history.append(record)
        self.epoch, self.step_in_epoch, self.running = self.epoch + 1, 0, self._empty_running()
        self.checkpoint()
        if live is not None:
            log_epoch(live, record)

    def _sum_running_over_ranks(self) -> None:
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

    # --- outputs --------------------------------------------------------------------------------
    def _open_live(self):
        return open_live(self.paths.live_dir, self.history, log_epoch) if self.ranks.is_main else None

    def model_config(self) -> dict:
        config = as_dict(self.params)
        config.pop("models")
        return {"variant": self.variant, "params": config}

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _finish(self) -> dict:
        best_record = self.history[self.best["epoch"] - 1]
        examples = sum(r["examples"] for r in self.history)
        summary = {"variant": self.variant, "best_epoch": self.best["epoch"], "dev": best_record["dev"],
                   "epochs": [{"epoch": r["epoch"], "dev_overall": r["dev"]["overall"],
                               "train_loss": r["train_loss"], "task_batches": r["task_batches"],
                               "examples": r["examples"],
                               **({"regularisers": r["regularisers"]} if r["regularisers"] else {})}
                              for r in self.history],
                   "parameters": self.parameter_count(),
                   # The only part that differs between identical runs:
                   "speed": {"processes": self.ranks.world_size, "train_seconds": round(self.train_seconds, 1),
                             "seconds_per_step": round(self.train_seconds / (self.steps_per_epoch * self.p.epochs),
                                                       4),
                             "examples_per_second": round(examples / max(self.train_seconds, 1e-9), 2),
                             "tokens_per_second": round(sum(r["tokens"] for r in self.history)
                                                        / max(self.train_seconds, 1e-9), 1)}}
        if self.ranks.is_main:
            shutil.rmtree(self.paths.model_out, ignore_errors=True)
            shutil.copytree(self.paths.checkpoints / "best", self.paths.model_out)
            io.write_json(self.paths.metrics_out, summary)
            shutil.rmtree(self.paths.checkpoints, ignore_errors=True)
        return summary


def log_epoch(live, record: dict) -> None:
    for task in TASK_NAMES:
        for metric, value in record["dev"][task].items():
            live.log_metric(f"dev/{task}/{metric}", value)
        live.log_metric(f"train/{task}/loss", record["train_loss"][task])
    for name, value in record["regularisers"].items():
        live.log_metric(f"train/{name}", value)
    live.log_metric("dev/overall", record["dev"]["overall"])
    live.next_step()


def run_fingerprint(params: Params, tokenized_dir: Path, pretrained: Path | None, world_size: int = 1) -> str:
    """Identifies a run: params (less the ones that do not change results), the data and the start weights."""
    digest = hashlib.sha256()
    relevant = as_dict(params)
    relevant.pop("models")  # the other variants' overrides; this variant's are already merged in
    relevant["train"] = {k: v for k, v in relevant["train"].items() if k not in ("threads", "checkpoint_every")}
    digest.update(json.dumps({**relevant, "world_size": world_size}, sort_keys=True).encode())
    for task in TASK_NAMES:
        for split in ("train", "dev"):
            digest.update(tokenized_path(tokenized_dir, task, split).read_bytes())
    for path in sorted(pretrained.glob("*.safetensors")) if pretrained is not None else []:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def train(params: Params, variant: str, paths: Paths) -> dict:
    return Trainer(params, variant, paths).run()


if __name__ == "__main__":
    app()
