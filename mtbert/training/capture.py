"""Captured training steps: on a GPU, each step shape runs as one CUDA graph (runtime.capture.cuda).

A 22M-parameter encoder on batches of 32 short sentences leaves an H100 waiting for the host: the eager
step launches several hundred small kernels, one Python call each. A CUDA graph records them once and
replays them with one launch. Why CUDA graphs rather than `torch.compile`: a step's shapes are few and
static already (runtime.pad_to_multiple), so one capture per shape costs about one step's time, and the
graph holds the whole step, the optimiser and the moving average included, with no compile time and no
recompilation as widths change.

A step's shape (its key) is the task and the shape of every tensor of each of its pieces
(train.max_batch_tokens cuts a batch into pieces). The first step of a key runs eagerly: it warms up the
kernels and allocates AdamW's state. The second is captured: static input buffers, then, inside the graph,
each piece's forward, loss and backward, the gradient clipping, AdamW and the moving average. From then on
the key's steps copy their batch into the buffers and replay the graph. The graph reads no number from
the host: each group's lr is a view into one device vector, which the host's LR schedule refills with one
copy per step, and the moving average's debiasing weight is computed on the device (averaging.py
`update_on_device`).

What still holds under capture:
- Dropout draws new masks at each replay: PyTorch registers its CUDA generator with the graph, and each
  replay starts from the generator's current offset. A resumed run restores that offset from the
  checkpoint, as the eager loop does.
- A non-finite loss stops the run naming its task and step: each replay's losses are copied out of the
  graph's buffers for `FiniteWatch`, which reads them at the same points as in the eager loop.
- The first step of each key after a resume is eager again; eager and replayed steps run the same kernels
  on the same random offsets.

A step that needs the host cannot be captured: SMART and the Bregman teacher read figures off the device,
PCGrad and distillation choose on the host, gradient accumulation updates every few steps, and several
ranks all-reduce between backward and update. Such a run logs one line and keeps the eager step.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from mtbert.data.batches import micro_batches, on_device, padding_free_tokens
from mtbert.training.distributed import shard
from mtbert.training.losses import BatchLoss, Distilled
from mtbert.training.smart import Regularised

log = logging.getLogger("train")

Key = tuple  # (task, ((tensor name, shape), ...)) per piece


def capture_blocker(run) -> str | None:
    """Why this run's step cannot be captured, or None when it can."""
    if run.train.grad_accum > 1:
        return "train.grad_accum > 1 updates only every few steps"
    if run.train.gradient == "pcgrad":
        return "PCGrad (train.gradient: pcgrad) projects the tasks' gradients on the host"
    if isinstance(run.objective, Regularised):
        return "SMART and the Bregman teacher (smart.lambda, smart.mu) read figures off the device"
    if any(isinstance(loss, Distilled) for loss in run.objective.losses.values()):
        return "distillation splits a batch by its rows' gold labels"
    if run.ranks.world_size > 1:
        return "several ranks all-reduce their gradients between backward and update"
    return None


def captured_steps(run) -> CapturedSteps | None:
    """The captured steps of a run on a GPU that asked for them (runtime.capture.cuda); None (the eager step)
    where something rules capture out, with one log line saying what."""
    blocker = capture_blocker(run)
    if blocker is not None:
        log.info("captured steps off: %s; the eager step runs", blocker)
        return None
    log.info("captured steps on: one CUDA graph per task and batch shape, replayed")
    return CapturedSteps(run)


@dataclasses.dataclass
class Piece:
    """One piece of a step's batch, on the host: what the device computes and what the host counts."""
    task: str
    rows: int
    batch: dict[str, torch.Tensor]
    tokens: int  # non-padding
    share: float  # of the global batch, the loss's scale
    weight: float  # of this rank's batch, for the epoch's mean loss


@dataclasses.dataclass
class Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[dict[str, torch.Tensor]]  # static buffers, one dict per piece
    losses: list[BatchLoss]  # static outputs, one per piece


class CapturedSteps:
    """The step of `finetune.train_epoch` for a run whose step can be captured (`captured_steps`)."""

    def __init__(self, run):
        self.graphs: dict[Key, Graph] = {}
        self.warm: set[Key] = set()  # keys whose eager first step ran
        self.failed = False  # a capture failed: eager steps from then on
        self.replays = self.eager_steps = 0
        run.objective.autocast_cache = False  # a graph must not hold casts cached by another step's pass
        self.lrs: torch.Tensor | None = None  # every group's lr, on the device (`_put_lr_on_device`)

    def step(self, run, progress, tasks: tuple[str, ...], ends_update: bool) -> None:
        """One whole step (its batches, forward, loss, backward, clipping, AdamW, the moving average), then
        the LR schedule's step; the step's losses and counts added to the epoch's totals. Every step ends an
        update (`ends_update` is always true: a captured run has train.grad_accum 1). Its signature is
        `finetune.eager_step`'s, which the loop calls alike (tests/test_capture.py holds them equal)."""
        self._put_lr_on_device(run)
        pieces = []
        for task in tasks:
            global_rows = run.streams[task].next()
            rows = shard(global_rows, run.ranks)
            for piece in micro_batches(rows, run.row_lengths[task], run.train.max_batch_tokens, run.pad_multiple):
                batch = one_width(run.train_data[task].batch(piece, run.model.encoding(task), run.pad_multiple),
                                  run.model.family.pad_id)
                pieces.append(Piece(task, len(piece), batch, padding_free_tokens(batch),
                                    share=len(piece) * run.ranks.world_size / len(global_rows),
                                    weight=len(piece) / len(rows)))
            progress.totals.batches[task] += bool(len(rows))
        losses = self._run(run, pieces)
        self._schedule(run)
        run.average.count_update()
        progress.updates += 1
        where = f"at epoch {progress.epoch + 1} step {progress.step_in_epoch + 1}"
        for piece, loss in zip(pieces, losses, strict=True):
            run.finite.add(loss.total.clone(), f"{piece.task} loss", where)  # the graph's buffer is reused
            progress.totals.add(piece.task, piece.rows, piece.tokens, loss, piece.weight)

    def _run(self, run, pieces: list[Piece]) -> list[BatchLoss]:
        key = tuple((piece.task, tuple((name, tuple(t.shape)) for name, t in piece.batch.items()))
                    for piece in pieces)
        graph = self.graphs.get(key)
        if graph is None and key in self.warm and not self.failed:
            graph = self._capture(run, key, pieces)
        if graph is None:
            self.warm.add(key)
            self.eager_steps += 1
            run.optimizer.zero_grad(set_to_none=True)  # .grad may still be some graph's buffers
            return self._body(run, [(piece.task, on_device(piece.batch, run.device), piece.share)
                                    for piece in pieces])
        for buffers, piece in zip(graph.inputs, pieces, strict=True):
            for name, tensor in piece.batch.items():
                buffers[name].copy_(tensor.pin_memory(), non_blocking=True)
        graph.graph.replay()
        self.replays += 1
        return graph.losses

    def summary(self) -> str:
        return f"{len(self.graphs)} graphs captured, {self.replays} steps replayed, {self.eager_steps} eager"

    def _capture(self, run, key: Key, pieces: list[Piece]) -> Graph | None:
        """The step of this key as a CUDA graph, its input buffers and losses; None if capture fails (then
        every later step is eager, after one log line)."""
        inputs = [{name: torch.empty(t.shape, dtype=t.dtype, device=run.device) for name, t in piece.batch.items()}
                  for piece in pieces]
        run.optimizer.zero_grad(set_to_none=True)  # the graph's backward allocates its own .grad buffers
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                losses = self._body(run, [(piece.task, buffers, piece.share)
                                          for piece, buffers in zip(pieces, inputs, strict=True)])
        except RuntimeError as error:
            self.failed = True
            log.warning("captured steps off from here: capturing a %s step failed (%s); the eager step runs",
                        "+".join(dict.fromkeys(piece.task for piece in pieces)), " ".join(str(error).split())[:200])
            run.optimizer.zero_grad(set_to_none=True)
            return None
        self.graphs[key] = Graph(graph, inputs, losses)
        return self.graphs[key]

    @staticmethod
    def _body(run, pieces: list[tuple[str, dict[str, torch.Tensor], float]]) -> list[BatchLoss]:
        """What a graph holds: each piece's forward, loss and backward, the clipping, AdamW and the moving
        average. The same code runs a key's eager first step."""
        losses = []
        for task, batch, share in pieces:
            loss = run.objective(run.model, task, batch)
            (loss.total * share).backward()
            losses.append(loss)
        if run.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.train.grad_clip)
        run.optimizer.step()
        run.average.update_on_device(run.model)
        return losses

    def _put_lr_on_device(self, run) -> None:
        """Each group's lr as a view into one device vector, which AdamW reads inside the graph; AdamW in
        its capturable form (its step count on the device). Once per process: a checkpoint restores plain
        numbers."""
        if self.lrs is not None:
            return
        groups = run.optimizer.param_groups
        self.lrs = torch.tensor([float(group["lr"]) for group in groups], dtype=torch.float32, device=run.device)
        for index, group in enumerate(groups):
            group["lr"], group["capturable"] = self.lrs[index], True
        for state in run.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].to(run.device, torch.float32)

    def _schedule(self, run) -> None:
        """The LR schedule's step on the host, as in the eager loop; its values reach the graph's lr vector
        in one copy (the scheduler would fill each group's tensor with a launch of its own)."""
        groups = run.optimizer.param_groups
        for group in groups:
            group["lr"] = 0.0  # a number for the scheduler to set
        run.scheduler.step()
        values = torch.tensor([group["lr"] for group in groups], dtype=torch.float32)
        self.lrs.copy_(values.pin_memory(), non_blocking=True)
        for index, group in enumerate(groups):
            group["lr"] = self.lrs[index]


def one_width(batch: dict[str, torch.Tensor], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A bi-encoder batch with both sentences' tensors at the wider one's width, as the model pads them
    anyway (ids with the encoder's pad id, masks with 0): one key per width, not one per pair of widths."""
    if "input_ids_1" not in batch:
        return batch
    width = max(batch["input_ids_1"].shape[1], batch["input_ids_2"].shape[1])
    return {name: F.pad(tensor, (0, width - tensor.shape[1]), value=pad_id if name.startswith("input_ids") else 0)
            if tensor.ndim == 2 else tensor for name, tensor in batch.items()}
