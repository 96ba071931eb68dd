"""Where a fine-tuning run is (`Progress`, with the epoch's running sums) and the checkpoint a killed run
resumes from: everything it needs to end exactly as an uninterrupted run would."""

from __future__ import annotations

import dataclasses
import logging
import shutil

from mtbert.training.build import FineTuning
from mtbert.training.checkpoint import every_rank
from mtbert.training.loop import load_latest, write_checkpoint
from mtbert.training.losses import BatchLoss

log = logging.getLogger("train")

# Per-batch figures of BatchLoss, averaged per epoch.
REGULARISERS = ("smart_loss", "bregman_loss", "delta_ratio", "delta_l2_ratio", "ascended")


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

    def add(self, task: str, examples: int, tokens: int, result: BatchLoss, weight: float) -> None:
        """A piece's figures added to the sums; `weight` is its share of this rank's batch. The loss is summed
        on the device (in float64, as the host summed it), so that the step never waits for it."""
        self.loss_sum[task] = self.loss_sum[task] + result.task_loss.double() * weight
        self.examples += examples
        self.tokens += tokens
        for name in REGULARISERS:
            value = getattr(result, name)
            if value is not None:
                total, n = self.regularisers.get(f"{task}/{name}", (0.0, 0))
                self.regularisers[f"{task}/{name}"] = [total + value * weight, n + weight]

    def settle(self) -> EpochTotals:
        """The loss sums, which the steps keep on the device, read as numbers (for a checkpoint or the epoch's
        record)."""
        self.loss_sum = {name: float(value) for name, value in self.loss_sum.items()}
        return self


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


def checkpoint(run: FineTuning, progress: Progress) -> None:
    """Write the state atomically (the main rank; every rank contributes its RNG); not training time."""
    with run.stopwatch.paused():
        progress.totals.settle()
        write_checkpoint(run, progress, FineTuningCheckpoint,
                         streams={name: stream.state() for name, stream in run.streams.items()},
                         average=run.average.state_dict(),  # the same on every rank, as the weights are
                         ranks=every_rank({"objective": run.objective.state_dict()}, run.ranks))


def resume(run: FineTuning) -> Progress:
    """The progress of this very run's newest whole checkpoint, loaded into `run`; else a fresh start (clearing
    what a killed run with other params or data may have left)."""
    latest = load_latest(run, FineTuningCheckpoint, Progress)
    if latest is None:
        if run.ranks.is_main:
            for leftover in (run.saved_epochs, run.snapshot_dumps):
                shutil.rmtree(leftover, ignore_errors=True)
        return Progress.start(run.tasks)
    state, own = latest
    run.objective.load_state_dict(own["objective"])
    for name, stream in run.streams.items():
        stream.load_state(state.streams[name])
    run.average.load_state_dict(state.average)
    log.info("resuming from epoch %d step %d", state.progress.epoch + 1, state.progress.step_in_epoch)
    return state.progress
