"""Multitask fine-tuning of one variant, keeping each task's model from its best dev epoch.

Read it top to bottom, as the `train` and `distill` stages call it (`fine_tune`):

    run, progress = start(params, variant, paths)  # the process set up; model, data, optimiser; resumed
    summary = train(run, progress)                 # the loop

`train` runs, per epoch, the sampler's schedule of steps. `step` is one step's batches, forward, loss
and backward; `update` one optimiser update (ranks' average, clipping, AdamW, the schedule, the moving
average); `end_epoch` the epoch's dev evaluation, snapshot dumps and the model saved aside when some task
is at its best. The objective (task loss, SMART, the Bregman teacher) is training/objective.py; PCGrad
(`train.gradient: pcgrad`) is training/pcgrad.py; the weights' moving average (the model evaluated and
kept with `train.ema`) is training/averaging.py. The run's counters, running sums and history are its
`Progress`; everything a resumed run needs (those, the weights, optimiser, data positions, RNG) is one
`FineTuningCheckpoint`.
"""

from __future__ import annotations

import dataclasses
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

from mtbert import io
from mtbert.data.batches import TaskSplit, load_split, tokenized_input
from mtbert.data.sampling import TaskStream, epoch_schedule
from mtbert.data.tasks import Task, tasks_from_params
from mtbert.evaluation.evaluate import evaluate, predict_split
from mtbert.evaluation.metrics import headline_summary, overall, task_metrics
from mtbert.evaluation.predictions import write_dump
from mtbert.model.backbone import load_encoder, load_tokenizer, starting_point
from mtbert.model.card import variant_card
from mtbert.model.multitask import MultitaskModel
from mtbert.model.saved import assemble_model, epoch_dir, save_model
from mtbert.params import Params, TrainParams, as_dict
from mtbert.rng import PCGRAD_ORDER, generator
from mtbert.runtime import limit_memory_growth, open_live, use_bf16
from mtbert.training.averaging import MovingAverage, NoAverage, weight_average
from mtbert.training.checkpoint import (
    discard_checkpoints,
    every_rank,
    load_checkpoint,
    remove_checkpoint_folder,
    restore,
    save_checkpoint,
)
from mtbert.training.distillation import Distillation
from mtbert.training.distributed import (
    Ranks,
    average_gradients,
    broadcast,
    setup_process,
    shard,
    shutdown,
    sync_parameters,
)
from mtbert.training.loop import Paths, Stopwatch, check_finite, speed, trainable
from mtbert.training.objective import BatchLoss, Objective, gold_loss
from mtbert.training.optim import make_optimizer
from mtbert.training.pcgrad import PCGrad
from mtbert.training.selection import chosen_epochs, chosen_metrics

log = logging.getLogger("train")

# Sections that do not change what `train` computes: left out of the run's fingerprint and mtbert.json.
NOT_TRAINING = ("models", "runtime", "predict", "ensemble", "stats")

# Per-batch figures of BatchLoss, averaged per epoch.
REGULARISERS = ("smart_loss", "bregman_loss", "delta_ratio", "delta_l2_ratio", "ascended")


# --- the state ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class EpochTotals:
    """Running sums of the epoch so far, for its record."""
    loss_sum: dict[str, float]  # per task, the sum of each batch's mean loss
    batches: dict[str, int]
    examples: int = 0
    tokens: int = 0  # non-padding
    regularisers: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # "task/figure": [sum, count]

    @classmethod
    def empty(cls, tasks) -> EpochTotals:
        return cls(loss_sum={name: 0.0 for name in tasks}, batches={name: 0 for name in tasks})


@dataclasses.dataclass
class Progress:
    """Where the run is, and what it has measured so far (the JSON part of a checkpoint)."""
    epoch: int  # epochs finished
    step_in_epoch: int
    updates: int
    totals: EpochTotals
    history: list[dict]  # one record per finished epoch
    train_seconds: float = 0.0

    @classmethod
    def start(cls, tasks) -> Progress:
        return cls(epoch=0, step_in_epoch=0, updates=0, totals=EpochTotals.empty(tasks), history=[])

    @classmethod
    def from_json(cls, state: dict) -> Progress:
        return cls(**{**state, "totals": EpochTotals(**state["totals"])})


@dataclasses.dataclass
class FineTuningCheckpoint:
    """Everything a resumed run needs to end exactly as an uninterrupted one."""
    fingerprint: str  # the params and data of the run that wrote it
    progress: Progress
    model: dict  # the raw weights' state dict
    optimizer: dict
    scheduler: dict
    streams: dict[str, dict]  # each task's position in its batches
    average: dict  # the weights' moving average (empty without train.ema)
    ranks: list[dict]  # per rank: torch's RNG and the objective's state (SMART's noise generator, the teacher)


@dataclasses.dataclass
class FineTuning:
    """What the loop works with: built by `prepare`, its state loaded by `resume` from a checkpoint."""
    params: Params
    variant: str
    paths: Paths
    fingerprint: str  # the params and data of this run; a checkpoint from another is not resumed
    ranks: Ranks
    device: torch.device
    bf16: bool
    tasks: dict[str, Task]
    tokenizer: object
    model: MultitaskModel
    train_data: dict[str, TaskSplit]
    dev_data: dict[str, TaskSplit]
    snapshot_data: dict[str, dict[str, TaskSplit]]  # per task, the whole splits each epoch dumps
    row_lengths: dict[str, np.ndarray]  # per task, each training row's tokens as the model reads them
    streams: dict[str, TaskStream]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    objective: Objective
    pcgrad: PCGrad | None  # train.gradient pcgrad: the step's gradients kept per task, then projected
    average: MovingAverage | NoAverage
    steps_per_epoch: int
    stopwatch: Stopwatch

    @property
    def p(self) -> TrainParams:
        return self.params.train

    @property
    def saved_epochs(self) -> Path:
        """Whole-model snapshots of the epochs some task keeps, until the run ends."""
        return self.paths.checkpoints / "epochs"

    @property
    def snapshot_dumps(self) -> Path:
        """Every epoch's prediction dumps, until the run ends."""
        return self.paths.checkpoints / "snapshots"


# --- building it --------------------------------------------------------------------------------------
def start(params: Params, variant: str, paths: Paths,
          distillation: Distillation | None = None) -> tuple[FineTuning, Progress]:
    """This process set up (memory caps, torchrun's process group, the seed), then the variant's run
    prepared and resumed from its last checkpoint if this very run (the fingerprint) wrote one. The stages
    `train` and `distill` start here, and so do the benchmarks and tests that drive a run step by step."""
    limit_memory_growth(params.runtime.onednn_cache, params.runtime.malloc_threshold_mb)
    ranks, device = setup_process(params.train.seed, params.runtime.threads)
    fingerprint = run_fingerprint(params, paths.tokenized, paths.pretrained, ranks.world_size)
    if distillation is not None:  # a student's run resumes only with the same teacher
        fingerprint = distillation.fingerprint(fingerprint)
    run = prepare(params, variant, paths, ranks, device, fingerprint, distillation)
    return run, resume(run)


def fine_tune(params: Params, variant: str, paths: Paths,
              distillation: Distillation | None = None) -> tuple[FineTuning, dict]:
    """Train the variant (or, with `distillation`, the student) from its last checkpoint or the start to
    the end; the run and its summary."""
    run, progress = start(params, variant, paths, distillation)
    summary = train(run, progress)
    shutdown(run.ranks)
    return run, summary


def prepare(params: Params, variant: str, paths: Paths, ranks: Ranks, device: torch.device,
            fingerprint: str, distillation: Distillation | None = None) -> FineTuning:
    """The model, data, optimiser and step pieces of one variant. Torch must be seeded already (the heads
    start random). With `distillation` it is a student's: each training row carries the teacher's prediction,
    and the task loss blends it with the gold label (training/distillation.py)."""
    p = params.train
    bf16 = use_bf16(p.bf16, device)  # `auto` decided once, by the device
    log.info("bf16 autocast %s (bf16: %s on %s)", "on" if bf16 else "off", p.bf16, device.type)
    tasks = tasks_from_params(params.tasks)
    start = starting_point(params.model.name, paths.pretrained)
    model = MultitaskModel(load_encoder(start), tasks, params.heads, params.model.arch,
                           params.model.task_layers).to(device)
    sync_parameters(model, ranks)
    average = weight_average(model, p.ema)
    train_data = {name: load_split(paths.tokenized, task, "train", train_rows(p, name)) for name, task in tasks.items()}
    if distillation is not None:
        train_data = {name: distillation.taught(split) for name, split in train_data.items()}
    dev_data = {name: load_split(paths.tokenized, task, "dev", p.max_examples) for name, task in tasks.items()}
    snapshot_data = {name: snapshot_splits(p, paths.tokenized, task, dev_data[name])
                     for name, task in tasks.items()} if paths.snapshots and ranks.is_main else {}
    row_lengths = {name: split.lengths(model.encoding(name)) for name, split in train_data.items()}
    streams = {name: TaskStream(row_lengths[name], p.batch_size[name], p.bucket_batches, p.seed, index)
               for index, name in enumerate(train_data)}
    steps = len(epoch_schedule_for(p, train_data, streams, 0))
    optimizer, scheduler = make_optimizer(model, model.encoder.config.num_hidden_layers, p,
                                          math.ceil(steps / p.grad_accum) * p.epochs)
    objective = Objective(model, params.smart, device, bf16, p.seed,
                          distillation.loss if distillation is not None else gold_loss)
    # after the optimiser froze the LR-0 parameters
    pcgrad = PCGrad(trainable(model), ranks, device) if p.gradient == "pcgrad" else None
    return FineTuning(params, variant, paths, fingerprint, ranks, device, bf16, tasks, load_tokenizer(start), model,
                      train_data, dev_data, snapshot_data, row_lengths, streams, optimizer, scheduler, objective,
                      pcgrad, average, steps, Stopwatch())


def snapshot_splits(p: TrainParams, tokenized: Path, task: Task, dev: TaskSplit) -> dict[str, TaskSplit]:
    """The splits each epoch's snapshot dumps cover, whole so that the ensemble can align them with predict's:
    dev, and test with train.snapshot_test (only `ensemble.snapshots` reads an epoch's test predictions)."""
    splits = {"dev": dev if not p.max_examples else load_split(tokenized, task, "dev")}
    if p.snapshot_test:
        splits["test"] = load_split(tokenized, task, "test")
    return splits


def train_rows(p: TrainParams, task: str) -> int:
    """How many of the task's training rows to train on: the smaller of the caps that are set (0: all)."""
    caps = [cap for cap in (p.max_examples, p.max_train_examples[task]) if cap]
    return min(caps, default=0)


def epoch_schedule_for(p: TrainParams, train_data: dict[str, TaskSplit], streams: dict[str, TaskStream],
                       epoch: int) -> list[tuple[str, ...]]:
    sizes = {name: len(split) for name, split in train_data.items()}
    batches = {name: stream.batches_per_pass for name, stream in streams.items()}
    return epoch_schedule(p.sampler, batches, sizes, seed=p.seed, epoch=epoch, epochs=p.epochs,
                          temperature=p.temperature)


def schedule(run: FineTuning, epoch: int) -> list[tuple[str, ...]]:
    """The tasks of each step of one epoch, by the sampler."""
    return epoch_schedule_for(run.p, run.train_data, run.streams, epoch)


def run_fingerprint(params: Params, tokenized_dir: Path, pretrained: Path | None, world_size: int = 1) -> str:
    """Identifies a run: its params (less `runtime`, which changes no result), the data and the start weights."""
    digest = hashlib.sha256()
    # `models` holds the other variants' overrides; this variant's are already merged in.
    relevant = {key: value for key, value in as_dict(params).items() if key not in NOT_TRAINING}
    digest.update(json.dumps({**relevant, "world_size": world_size}, sort_keys=True).encode())
    for task in params.tasks:
        for split in ("train", "dev", "test"):  # test: train.snapshot_test's dumps predict it
            digest.update(tokenized_input(tokenized_dir, task, split).read_bytes())
    for path in sorted(pretrained.glob("*.safetensors")) if pretrained is not None else []:
        digest.update(path.read_bytes())
    return digest.hexdigest()


# --- checkpoints ----------------------------------------------------------------------------------------
def checkpoint(run: FineTuning, progress: Progress) -> None:
    """Write the state atomically (the main rank; every rank contributes its RNG); not training time."""
    with run.stopwatch.paused():
        progress.train_seconds = run.stopwatch.seconds
        state = FineTuningCheckpoint(
            fingerprint=run.fingerprint, progress=progress, model=run.model.state_dict(),
            optimizer=run.optimizer.state_dict(), scheduler=run.scheduler.state_dict(),
            streams={name: stream.state() for name, stream in run.streams.items()},
            average=run.average.state_dict(),  # the same on every rank, as the weights are
            ranks=every_rank({"objective": run.objective.state_dict()}, run.ranks))
        if run.ranks.is_main:
            save_checkpoint(run.paths.checkpoints, state)


def resume(run: FineTuning) -> Progress:
    """The progress of this very run's newest whole checkpoint, loaded into `run`; else a fresh start (clearing
    what a killed run with other params or data may have left)."""
    state = load_checkpoint(run.paths.checkpoints, FineTuningCheckpoint, Progress, run.fingerprint, run.ranks)
    if state is None:
        if run.ranks.is_main:
            for leftover in (run.saved_epochs, run.snapshot_dumps):
                shutil.rmtree(leftover, ignore_errors=True)
            discard_checkpoints(run.paths.checkpoints)
        return Progress.start(run.tasks)
    own = restore(state, run.model, run.optimizer, run.scheduler, run.ranks)
    run.objective.load_state_dict(own["objective"])
    for name, stream in run.streams.items():
        stream.load_state(state.streams[name])
    run.average.load_state_dict(state.average)
    run.stopwatch = Stopwatch(state.progress.train_seconds)
    log.info("resuming from epoch %d step %d", state.progress.epoch + 1, state.progress.step_in_epoch)
    return state.progress


# --- the loop -------------------------------------------------------------------------------------------
def train(run: FineTuning, progress: Progress) -> dict:
    """From wherever `progress` is to the end: every epoch, then the model folder, dumps and metrics."""
    p = run.p
    live = open_live(run.paths.live_dir, progress.history, log_epoch) if run.ranks.is_main else None
    log.info("%s: arch %s, %d steps per epoch, %d epochs, sampler %s, gradient %s, %s parameters, %d rank(s)",
             run.variant, run.params.model.arch, run.steps_per_epoch, p.epochs, p.sampler, p.gradient,
             f"{parameter_count(run.model):,}", run.ranks.world_size)
    while progress.epoch < p.epochs:
        train_epoch(run, progress)
        end_epoch(run, progress, live)
    if live is not None:
        live.end()
    result = summary(run, progress)
    if run.ranks.is_main:
        publish(run, result)
        io.write_metrics(run.paths.metrics_out, result)
        remove_checkpoint_folder(run.paths.checkpoints)  # the run is complete
    return result


def train_epoch(run: FineTuning, progress: Progress) -> None:
    """The epoch's steps from wherever `progress` is: an update every grad_accum steps, a checkpoint every
    runtime.checkpoint_every.train updates (the epoch's end has its own, after the dev evaluation)."""
    p = run.p
    epoch_steps = schedule(run, progress.epoch)
    run.model.train()
    # a context, so that an error closes the bar first and the error's one line does not run into it
    with tqdm(total=len(epoch_steps), initial=progress.step_in_epoch, desc=f"epoch {progress.epoch + 1}",
              unit="step", mininterval=2.0, disable=not run.ranks.is_main) as bar:
        run.stopwatch.start()
        while progress.step_in_epoch < len(epoch_steps):
            step(run, progress, epoch_steps[progress.step_in_epoch])
            progress.step_in_epoch += 1
            bar.update(1)
            if progress.step_in_epoch % p.grad_accum == 0 or progress.step_in_epoch == len(epoch_steps):
                update(run, progress)
                if (progress.updates % run.params.runtime.checkpoint_every.train == 0
                        and progress.step_in_epoch < len(epoch_steps)):
                    checkpoint(run, progress)
        run.stopwatch.stop()


def step(run: FineTuning, progress: Progress, tasks: tuple[str, ...]) -> None:
    """One step's gradients: for each task, its next batch (this rank's share) in pieces, forward, loss,
    backward. Each piece's loss is scaled by its share of the global batch and by 1 / grad_accum, so the
    gradients summed over pieces, ranks and accumulated steps are the global batch's mean. With PCGrad each
    task's gradient is kept apart, and the step's end removes their conflicts."""
    p = run.p
    for task in tasks:
        global_rows = run.streams[task].next()  # the same on every rank
        rows = shard(global_rows, run.ranks)
        for piece in micro_batches(rows, run.row_lengths[task], p.max_batch_tokens):
            batch = run.train_data[task].batch(piece, run.model.encoding(task))
            batch = {k: v.to(run.device) for k, v in batch.items()}
            loss = run.objective(run.model, task, batch)  # the task's loss plus each regulariser's, weighted
            check_finite(loss.total, f"{task} loss",
                         f"at epoch {progress.epoch + 1} step {progress.step_in_epoch + 1}", run.paths.checkpoints,
                         "Lower train.lr or turn off train.bf16.")
            count(progress.totals, task, piece, batch, loss, weight=len(piece) / len(rows))
            share = len(piece) * run.ranks.world_size / len(global_rows)  # of the global batch
            if run.pcgrad is None:
                (loss.total * share / p.grad_accum).backward()  # frees the piece's activations
            else:
                run.pcgrad.backward(loss.total * share / p.grad_accum)
        if len(rows):
            progress.totals.batches[task] += 1
        if run.pcgrad is not None:
            run.pcgrad.end_task()
    if run.pcgrad is not None:
        run.pcgrad.end_step(generator(p.seed, PCGRAD_ORDER, progress.epoch, progress.step_in_epoch))


def micro_batches(rows: np.ndarray, lengths: np.ndarray, max_batch_tokens: int) -> list[np.ndarray]:
    """`rows` in pieces of at most `max_batch_tokens` padded tokens (0: one piece). A batch of long sentences
    otherwise holds all its activations at once, and those few batches set training's memory peak. The
    pieces' gradients add up to the batch's; only the dropout masks are drawn differently."""
    if not max_batch_tokens or len(rows) <= 1:
        return [rows] if len(rows) else []
    padded_tokens = len(rows) * int(lengths[rows].max())
    return np.array_split(rows, min(len(rows), math.ceil(padded_tokens / max_batch_tokens)))


def count(totals: EpochTotals, task: str, rows: np.ndarray, batch: dict[str, torch.Tensor], result: BatchLoss,
          weight: float) -> None:
    """Add a piece's figures to the epoch's sums; `weight` is its share of this rank's batch."""
    totals.loss_sum[task] += result.task_loss * weight
    totals.examples += len(rows)
    totals.tokens += int(sum(v.sum() for k, v in batch.items() if k.startswith("attention_mask")))
    for name in REGULARISERS:
        value = getattr(result, name)
        if value is not None:
            total, n = totals.regularisers.get(f"{task}/{name}", (0.0, 0))
            totals.regularisers[f"{task}/{name}"] = [total + value * weight, n + weight]


def update(run: FineTuning, progress: Progress) -> None:
    """One optimiser update: the gradients averaged over the ranks, clipped, AdamW and the LR schedule's
    step; then what follows the weights: SMART's Bregman teacher and the weights' moving average."""
    if run.pcgrad is None:  # PCGrad averaged each task's gradient over the ranks already
        average_gradients(trainable(run.model), run.ranks)
    if run.p.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.p.grad_clip)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.objective.after_update(run.model)  # the Bregman teacher (smart.mu > 0)
    run.average.update(run.model)  # the moving average (train.ema > 0)
    progress.updates += 1


def end_epoch(run: FineTuning, progress: Progress, live) -> None:
    """Evaluate and dump the epoch, log it, save the model aside if a task is at its best, checkpoint."""
    dev = dev_raw = None  # the main rank evaluates; the others wait for its figures
    if run.ranks.is_main:
        dev = evaluate_and_dump(run, progress.epoch + 1)
        if run.average.separate and run.p.dev_raw:  # the raw weights beside their moving average
            dev_raw = evaluate(run.model, run.dev_data, run.p.eval_batch_size, run.device, run.bf16)
    dev, dev_raw = broadcast((dev, dev_raw), run.ranks)
    record = epoch_record(run, progress, dev, dev_raw)
    progress.history.append(record)
    chosen = chosen_epochs(progress.history, run.tasks, run.p.select)
    if record["epoch"] in chosen.values() and run.ranks.is_main:
        save_model(run.average.model, run.tokenizer, run.saved_epochs / epoch_dir(record["epoch"]), model_config(run))
    progress.epoch, progress.step_in_epoch, progress.totals = progress.epoch + 1, 0, EpochTotals.empty(run.tasks)
    checkpoint(run, progress)
    if run.ranks.is_main:  # only after the checkpoint, which still names what a resumed run needs
        drop_unchosen_epochs(run.saved_epochs, set(chosen.values()))
    if live is not None:
        log_epoch(live, record)


def evaluate_and_dump(run: FineTuning, epoch: int) -> dict:
    """The epoch's dev metrics of the model kept (the moving average with train.ema); with a snapshots path,
    its predictions of the snapshot splits as dumps, the dev pass's own reused (kept with the checkpoint until
    the run ends: `dvc repro` clears a stage's outputs before it runs)."""
    directory = run.snapshot_dumps / epoch_dir(epoch)
    model, p = run.average.model, run.p
    dev = {}
    for name, split in run.dev_data.items():
        values = predict_split(model, split, p.eval_batch_size, run.device, run.bf16)
        dev[name] = task_metrics(split.task, values, split.labels)
        for split_name, data in run.snapshot_data.get(name, {}).items():
            if data is not split:
                values = predict_split(model, data, p.eval_batch_size, run.device, run.bf16)
            write_dump(directory, data.task, split_name, data.ids, values)
    dev["overall"] = overall(dev, run.tasks)
    return dev


def epoch_record(run: FineTuning, progress: Progress, dev: dict, dev_raw: dict | None) -> dict:
    """The finished epoch's record (all ranks' figures), logged."""
    totals, epoch = sum_over_ranks(progress.totals, run.ranks, run.device), progress.epoch + 1
    record = {"epoch": epoch, "dev": dev,
              "train_loss": {name: totals.loss_sum[name] / max(totals.batches[name], 1) for name in run.tasks},
              "task_batches": dict(totals.batches), "examples": totals.examples, "tokens": totals.tokens,
              "lr": run.scheduler.get_last_lr()[0],
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


# --- outputs ----------------------------------------------------------------------------------------------
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
    task_epochs = chosen_epochs(history, run.tasks, run.p.select)
    return {"variant": run.variant, "select": run.p.select, "task_epochs": task_epochs,
            "dev": chosen_metrics(history, run.tasks, task_epochs),
            "epochs": [{"epoch": r["epoch"], "dev": r["dev"], "train_loss": r["train_loss"],
                        "task_batches": r["task_batches"], "examples": r["examples"],
                        **({"dev_raw": r["dev_raw"]} if "dev_raw" in r else {}),
                        **({"regularisers": r["regularisers"]} if r["regularisers"] else {})}
                       for r in history],
            "parameters": parameter_count(run.model),
            "speed": speed(run.stopwatch.seconds, run.ranks, run.bf16, run.steps_per_epoch * run.p.epochs,
                           sum(r["examples"] for r in history), sum(r["tokens"] for r in history))}


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
