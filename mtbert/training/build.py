"""A fine-tuning run built: `FineTuning` (what the loop works with) and `prepare`, which builds it from the
params, choosing once each object the step asks (training/step.py): the objective, how gradients combine,
the moving average, and the device work (eager, or captured on a GPU); the epoch's schedule of steps; the
run's fingerprint, which a checkpoint must match to be resumed."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mtbert.data.batches import TaskSplit, load_split, tokenized_input
from mtbert.data.sampling import TaskStream, epoch_schedule
from mtbert.data.tasks import Task, tasks_from_params
from mtbert.model.backbone import load_encoder, load_tokenizer, starting_point
from mtbert.model.dropout import without_dropout_where_frozen
from mtbert.model.frozen import ReleasedBottom
from mtbert.model.multitask import MultitaskModel
from mtbert.params import Params, SmartParams, TrainParams, as_dict
from mtbert.runtime import UnreadableInputError, release_heap, use_bf16
from mtbert.training.averaging import MovingAverage, NoAverage, weight_average
from mtbert.training.capture import device_work
from mtbert.training.distillation import GoldLabels
from mtbert.training.distributed import Ranks, sync_parameters
from mtbert.training.frozen_states import states_depth, with_frozen_states
from mtbert.training.loop import FiniteWatch, Paths, Stopwatch, fingerprint, trainable
from mtbert.training.losses import Objective, kind_losses
from mtbert.training.optim import make_optimizer
from mtbert.training.pcgrad import PCGrad
from mtbert.training.smart import Regularised
from mtbert.training.step import Gradients, RankAveraged, Summed, compute

log = logging.getLogger("train")


# Sections that do not change what `train` computes: left out of the run's fingerprint and mtbert.json.
NOT_TRAINING = ("models", "runtime", "predict", "ensemble", "stats")


@dataclasses.dataclass
class FineTuning:
    """What the loop works with: built by `prepare`, its state loaded from a checkpoint by
    training/progress.py's `resume`."""
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
    objective: Objective  # the task losses, weighted; with smart.lambda or smart.mu, their terms added
    gradients: Gradients  # how the pieces' and tasks' gradients combine: summed, PCGrad, averaged over ranks
    average: MovingAverage | NoAverage  # the weights' moving average (train.ema)
    steps_per_epoch: int
    stopwatch: Stopwatch
    finite: FiniteWatch  # the step's losses, checked for non-finite values without waiting for the device
    bottom: ReleasedBottom | None = None  # the frozen bottom's weights, released while the run reads its states
    compute: Callable = compute  # the step's device work: training/step.py's `compute`, or captured on a GPU

    @property
    def train(self) -> TrainParams:
        return self.params.train

    @property
    def pad_multiple(self) -> int:
        """Training batches' widths are multiples of this (runtime.pad_to_multiple on this device)."""
        return self.params.runtime.pad_to_multiple.on(self.device.type)

    @property
    def split_batches(self) -> dict[str, int]:
        """How the dev evaluation batches a split on this device (runtime.eval_batch_size, pad_to_multiple)."""
        return self.params.runtime.split_batches(self.device.type, self.train.eval_batch_size)

    @property
    def saved_epochs(self) -> Path:
        """Whole-model snapshots of the epochs some task keeps, until the run ends."""
        return self.paths.checkpoints / "epochs"

    def whole_model(self) -> contextlib.AbstractContextManager:
        """Within: every weight in memory, for a save of the whole model (the frozen bottom's read back where
        the run released it)."""
        return self.bottom.restored() if self.bottom else contextlib.nullcontext()

    @property
    def snapshot_dumps(self) -> Path:
        """Every epoch's prediction dumps, until the run ends."""
        return self.paths.checkpoints / "snapshots"


def prepare(params: Params, variant: str, paths: Paths, ranks: Ranks, device: torch.device,
            fingerprint: str, labels: GoldLabels) -> FineTuning:
    """The model, data, optimiser and step pieces of one variant. Torch must be seeded already (the heads
    start random). `labels` are what the rows are trained on: the gold labels, or a student's `Distillation`
    (each training row carries the teacher's prediction, and the task loss blends it with the gold label;
    training/distillation.py)."""
    p = params.train
    bf16 = use_bf16(p.bf16, device)  # `auto`: on where the device computes bf16 natively (AMX, AVX512-BF16, GPU)
    log.info("bf16 autocast %s (bf16: %s on %s)", "on" if bf16 else "off", p.bf16, device.type)
    tasks = tasks_from_params(params.tasks)
    start = starting_point(params.model.name, paths.pretrained)
    model = MultitaskModel(load_encoder(start), tasks, params.heads, params.model.arch,
                           params.model.task_layers).to(device)
    model.states_depth = states_depth(params, model, device)  # before the average copies the model
    sync_parameters(model, ranks)
    average = weight_average(model, p.ema)
    train_data = {name: load_split(paths.tokenized, task, "train", train_rows(p, name)) for name, task in tasks.items()}
    check_padding(train_data, model, paths.tokenized)
    train_data = {name: labels.taught(split) for name, split in train_data.items()}
    dev_data = {name: load_split(paths.tokenized, task, "dev", p.max_examples) for name, task in tasks.items()}
    row_lengths = {name: split.lengths(model.encoding(name)) for name, split in train_data.items()}
    streams = {name: TaskStream(row_lengths[name], p.batch_size[name], p.bucket_batches, p.seed, index)
               for index, name in enumerate(train_data)}
    steps = len(epoch_schedule_for(p, train_data, streams, 0))
    optimizer, scheduler = make_optimizer(model, model.encoder.config.num_hidden_layers, p,
                                          math.ceil(steps / p.grad_accum) * p.epochs)
    average.share_frozen(model)  # after the optimiser froze the LR-0 weights
    if p.freeze_layers:
        without_dropout_where_frozen(model)
    folder = paths.checkpoints / f"frozen-states-{ranks.rank}"
    if model.states_depth:  # the frozen bottom's output of every row, once (training/frozen_states.py)
        add_states = functools.partial(with_frozen_states, model, folder=folder, fingerprint=fingerprint, bf16=bf16,
                                       batch_size=params.runtime.split_batches(device.type, p.eval_batch_size)[
                                           "batch_size"], device=device)
        train_data, dev_data = add_states(train_data, "train"), add_states(dev_data, "dev")
    snapshot_data = {name: snapshot_splits(p, paths.tokenized, task, dev_data[name])
                     for name, task in tasks.items()} if paths.snapshots and ranks.is_main else {}
    bottom = None
    if model.states_depth:  # every split the run reads has its states now: the bottom's weights can go
        snapshot_data = with_snapshot_states(snapshot_data, dev_data, add_states)
        bottom = ReleasedBottom.release([model, average.model], model.states_depth, folder / "bottom.safetensors")
        release_heap()
    objective = make_objective(model, params.smart, device, bf16, p.seed, labels.losses(kind_losses(model)))
    run = FineTuning(params, variant, paths, fingerprint, ranks, device, bf16, tasks, load_tokenizer(start), model,
                     train_data, dev_data, snapshot_data, row_lengths, streams, optimizer, scheduler, objective,
                     gradient_combination(p, model, ranks, device), average, steps, Stopwatch(),
                     FiniteWatch(paths.checkpoints, "Lower train.lr or turn off train.bf16."), bottom)
    run.compute = device_work(run)  # `compute`, or on a GPU (runtime.capture.cuda) its CUDA graphs
    return run


def with_snapshot_states(snapshot_data: dict[str, dict[str, TaskSplit]], dev_data: dict[str, TaskSplit],
                         add_states: Callable) -> dict[str, dict[str, TaskSplit]]:
    """The snapshot splits with their states: the dev splits the run evaluates are the same objects (their dumps
    reuse the dev pass), the others (test with train.snapshot_test, the whole dev under train.max_examples) get
    their own."""
    names = {split_name for splits in snapshot_data.values() for split_name in splits}
    for split_name in sorted(names):
        others = {task: splits[split_name] for task, splits in snapshot_data.items()
                  if split_name in splits and splits[split_name] is not dev_data[task]}
        for task, split in (add_states(others, f"snapshot-{split_name}") if others else {}).items():
            snapshot_data[task][split_name] = split
    return snapshot_data


def gradient_combination(p: TrainParams, model: MultitaskModel, ranks: Ranks, device: torch.device) -> Gradients:
    """How the step combines its gradients (training/step.py). Built after the optimiser froze the LR-0
    parameters."""
    if p.gradient == "pcgrad":  # PCGrad averages each task's gradient over the ranks itself
        return PCGrad(trainable(model), ranks, device, p.seed)
    if ranks.distributed:
        return RankAveraged(trainable(model), ranks)
    return Summed()


def make_objective(model: MultitaskModel, params: SmartParams, device: torch.device, bf16: bool, seed: int,
                   losses: dict | None = None) -> Objective:
    """The plain objective, or the regularised one where smart.* turns a term on (a task's lambda, or mu)."""
    if not params.turns_a_term_on(model.tasks):
        return Objective(model, device, bf16, losses)
    return Regularised(model, params, device, bf16, seed, losses)  # builds only the terms that are on


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


def check_padding(splits: dict[str, TaskSplit], model: MultitaskModel, tokenized: Path) -> None:
    """The splits were tokenized for the model's encoder family: they pad with its pad id."""
    for name, split in splits.items():
        if split.pad_id != model.family.pad_id:
            raise UnreadableInputError(
                f"{tokenized_input(tokenized, name, 'train')}: padded with id {split.pad_id}, but the "
                f"{model.family.model_type} encoder pads with {model.family.pad_id}: tokenized for another "
                "backbone; run `dvc repro tokenize`")


def schedule(run: FineTuning, epoch: int) -> list[tuple[str, ...]]:
    """The tasks of each step of one epoch, by the sampler."""
    return epoch_schedule_for(run.train, run.train_data, run.streams, epoch)


def run_fingerprint(params: Params, tokenized_dir: Path, pretrained: Path | None, world_size: int = 1) -> str:
    """Identifies a run: its params (less `runtime`, which changes no result), the data and the start weights."""
    # `models` holds the other variants' overrides; this variant's are already merged in.
    relevant = {key: value for key, value in as_dict(params).items() if key not in NOT_TRAINING}
    data = [tokenized_input(tokenized_dir, task, split) for task in params.tasks
            for split in ("train", "dev", "test")]  # test: train.snapshot_test's dumps predict it
    weights = sorted(pretrained.glob("*.safetensors")) if pretrained is not None else []
    return fingerprint({**relevant, "world_size": world_size}, [*data, *weights])
