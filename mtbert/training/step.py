"""One step of fine-tuning, read top to bottom: what `train_epoch` (training/finetune.py) runs for every step
of the sampler's schedule.

    pieces = next_pieces(run, tasks)                         # host: each task's next batch, cut in pieces
    losses = run.compute(run, progress, pieces, ends_update)  # device: forward, loss, backward; the update
    count(run, progress, pieces, losses)                     # host: the epoch's sums, the non-finite guard
    run.scheduler.step()                                     # host: the LR schedule, after an update

`compute` is the step's device work, the same function on every path: `run.compute` is `compute` itself, or
on a GPU (runtime.capture.cuda) `compute` recorded once per batch shape as a CUDA graph and replayed
(training/capture.py, which holds no step logic of its own). The step has two branches, both taken by
default: `ends_update` (an update every train.grad_accum steps and at the epoch's last step; by default
every step) and the clipping (train.grad_clip > 0). What else a run's params change in the step are
objects chosen once, by training/build.py's `prepare`, not branches:
- `run.objective`: the task loss (training/losses.py's `Objective`), or with smart.lambda / smart.mu the
  loss plus SMART's and the Bregman teacher's terms (training/smart.py's `Regularised`);
- `run.gradients`: how the pieces' and tasks' gradients combine into `.grad`: `Summed` (below, the
  default), `RankAveraged` (several ranks), or PCGrad (training/pcgrad.py, train.gradient: pcgrad);
- `run.average`: the weights' moving average (train.ema; training/averaging.py), `NoAverage` at 0;
- `run.objective.after_update`: what follows the weights besides it (the Bregman teacher; by default nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from mtbert.data.batches import micro_batches, on_device, padding_free_tokens
from mtbert.training.distributed import Ranks, average_gradients, shard
from mtbert.training.losses import BatchLoss


@dataclasses.dataclass
class Piece:
    """One piece of a task's batch (train.max_batch_tokens cuts a batch into pieces), on the host."""
    batch: dict[str, torch.Tensor]  # the model's inputs and the labels
    rows: int
    tokens: int  # non-padding, counted on the host before the copy to the device
    share: float  # of the global batch (every rank's rows): the loss's scale, so gradients add up to its mean
    weight: float  # of this rank's batch: the piece's part of the epoch's mean loss


Pieces = dict[str, list[Piece]]  # per task of the step, in order; an empty list where this rank has no rows


def step(run, progress, tasks: tuple[str, ...], ends_update: bool) -> None:
    """One sampler step: its tasks' gradients, then the optimiser update where the step ends one (every
    train.grad_accum steps)."""
    pieces = next_pieces(run, tasks)
    losses = run.compute(run, progress, pieces, ends_update)
    count(run, progress, pieces, losses)
    if ends_update:
        run.scheduler.step()
        progress.updates += 1


def next_pieces(run, tasks: tuple[str, ...]) -> Pieces:
    """Each task's next batch from its stream (the same on every rank), this rank's share of its rows, cut in
    pieces of at most train.max_batch_tokens and collated, as the task's encoding reads them (cross: a pair as
    one sequence; bi: each sentence on its own)."""
    pieces: Pieces = {}
    for task in tasks:
        global_rows = run.streams[task].next()
        rows = shard(global_rows, run.ranks)  # every world_size-th row: all of them in one process
        encoding = run.model.encoding(task)
        pieces[task] = []
        for part in micro_batches(rows, run.row_lengths[task], run.train.max_batch_tokens, run.pad_multiple):
            batch = run.train_data[task].batch(part, encoding, run.pad_multiple)
            pieces[task].append(Piece(batch, len(part), padding_free_tokens(batch),
                                      share=len(part) * run.ranks.world_size / len(global_rows),
                                      weight=len(part) / len(rows)))
    return pieces


def compute(run, progress, pieces: Pieces, ends_update: bool) -> list[BatchLoss]:
    """The step's device work: each piece's forward, loss and backward, task by task; then, where the step ends
    an update, the gradients clipped to a global norm (train.grad_clip), AdamW's step, the gradients freed, and
    what follows the weights. Each piece's loss is scaled by its share of the global batch and by
    1 / train.grad_accum, so the gradients summed over pieces, ranks and accumulated steps are the global
    batch's mean. The losses stay on the device, unread: the step never waits for it."""
    losses = []
    for task, task_pieces in pieces.items():
        for piece in task_pieces:
            loss = run.objective(run.model, task, on_device(piece.batch, run.device))
            run.gradients.backward(loss.total * piece.share / run.train.grad_accum)  # frees the activations
            losses.append(loss)
        run.gradients.end_task()
    run.gradients.end_step(progress)
    if ends_update:
        run.gradients.before_update()
        if run.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.train.grad_clip)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.objective.after_update(run.model)  # the Bregman teacher (smart.mu); nothing by default
        run.average.update(run.model)  # train.ema: avg += (1 - d) / (1 - d^t) * (w - avg)
    return losses


def count(run, progress, pieces: Pieces, losses: list[BatchLoss]) -> None:
    """The step's figures added to the epoch's running sums (on the device, for its record), and its losses to
    the non-finite guard, which `train_epoch` reads every runtime.check_every steps."""
    where = f"at epoch {progress.epoch + 1} step {progress.step_in_epoch + 1}"
    results = iter(losses)
    for task, task_pieces in pieces.items():
        for piece in task_pieces:
            loss = next(results)
            run.finite.add(loss.total, f"{task} loss", where)
            progress.totals.add(task, piece.rows, piece.tokens, loss, weight=piece.weight)
        progress.totals.batches[task] += bool(task_pieces)


# --- how the gradients combine (run.gradients) ------------------------------------------------------------
class Gradients(Protocol):
    """What `compute` asks of a gradient combination, in this order within a step."""

    def backward(self, loss: torch.Tensor) -> None: ...  # a piece's scaled loss
    def end_task(self) -> None: ...  # after each task's pieces
    def end_step(self, progress) -> None: ...  # after every task of the step
    def before_update(self) -> None: ...  # before the clipping, where the step ends an update


class Summed:
    """The default: each piece's backward adds its gradient into the parameters' `.grad`, across tasks and
    accumulated steps alike."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def end_task(self) -> None:
        pass

    def end_step(self, progress) -> None:
        pass

    def before_update(self) -> None:
        pass


class RankAveraged(Summed):
    """Several ranks (train.nproc): each rank sums its own rows' gradients, then `.grad` is averaged over the
    ranks before each update."""

    def __init__(self, parameters: list[torch.nn.Parameter], ranks: Ranks):
        self.parameters, self.ranks = parameters, ranks

    def before_update(self) -> None:
        average_gradients(self.parameters, self.ranks)
