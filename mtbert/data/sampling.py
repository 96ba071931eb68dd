"""Which task each training step draws from, and each task's endless stream of batches.

An epoch is defined as the sum over tasks of the batches in one pass over that task (so every sampler
processes about the same number of examples per epoch); `joint` takes one batch of every task per
step, so its epoch has that sum divided by the number of tasks steps. `round_robin_smallest` is the
exception: every task is down-sampled to the smallest task's batches, so its epoch is one pass over the
smallest task, and the larger tasks' streams go on where the last epoch left them (other rows each
epoch; over the epochs, every row). Schedules and batch orders are pure functions of (seed, epoch,
pass), which is what lets a resumed run continue exactly.
"""

from __future__ import annotations

import math

import numpy as np

from mtbert.data.batches import bucketed_batches
from mtbert.rng import TASK_ORDER, generator


class TaskStream:
    """Endless length-bucketed batches over one task, pass after pass; its position is resumable."""

    def __init__(self, lengths: np.ndarray, batch_size: int, bucket_batches: int, seed: int, stream_id: int):
        self.lengths, self.batch_size, self.bucket_batches = lengths, batch_size, bucket_batches
        self.seed, self.stream_id = seed, stream_id
        self.pass_index, self.position = 0, 0
        self._batches = self._make_pass(0)

    @property
    def batches_per_pass(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)

    def next(self) -> np.ndarray:
        if self.position == len(self._batches):
            self.pass_index, self.position = self.pass_index + 1, 0
            self._batches = self._make_pass(self.pass_index)
        rows = self._batches[self.position]
        self.position += 1
        return rows

    def state(self) -> dict:
        return {"pass": self.pass_index, "position": self.position}

    def load_state(self, state: dict) -> None:
        self.pass_index, self.position = state["pass"], state["position"]
        self._batches = self._make_pass(self.pass_index)

    def _make_pass(self, pass_index: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, self.stream_id, pass_index])
        return bucketed_batches(self.lengths, self.batch_size, self.bucket_batches, rng)


def sampling_weights(sampler: str, sizes: dict[str, int], *, epoch: int, epochs: int,
                     temperature: float) -> dict[str, float]:
    """Probabilities of drawing each task for the random samplers."""
    if sampler == "proportional":
        exponent = 1.0
    elif sampler == "temperature":
        exponent = 1.0 / temperature
    elif sampler == "annealed":  # Stickland & Murray: from proportional (alpha=1) to nearly uniform
        exponent = 1.0 - 0.8 * epoch / (epochs - 1) if epochs > 1 else 1.0
    else:
        raise ValueError(f"sampler {sampler!r} has no sampling weights")
    raw = {task: size ** exponent for task, size in sizes.items()}
    total = sum(raw.values())
    return {task: value / total for task, value in raw.items()}


def epoch_schedule(sampler: str, batches_per_pass: dict[str, int], sizes: dict[str, int], *, seed: int,
                   epoch: int, epochs: int, temperature: float) -> list[tuple[str, ...]]:
    """The tasks of every step of one epoch; each step is one task, or every task for `joint`."""
    tasks = list(batches_per_pass)
    steps = sum(batches_per_pass.values())
    rng = generator(seed, TASK_ORDER, epoch)
    if sampler == "round_robin":
        return [(tasks[i % len(tasks)],) for i in range(steps)]
    if sampler == "round_robin_smallest":  # each TaskStream keeps its place across epochs: new rows each epoch
        return [(task,) for _ in range(min(batches_per_pass.values())) for task in tasks]
    if sampler == "shuffled":
        pool = np.repeat(np.arange(len(tasks)), [batches_per_pass[t] for t in tasks])
        return [(tasks[i],) for i in rng.permutation(pool)]
    if sampler == "joint":
        return [tuple(tasks)] * max(1, round(steps / len(tasks)))
    weights = sampling_weights(sampler, sizes, epoch=epoch, epochs=epochs, temperature=temperature)
    draws = rng.choice(len(tasks), size=steps, p=[weights[t] for t in tasks])
    return [(tasks[i],) for i in draws]
