"""Captured training steps: on a GPU, the step's device work runs as one CUDA graph per step shape
(runtime.capture.cuda, on by default).

A 22M-parameter encoder on batches of 32 short sentences leaves an H100 waiting for the host: the eager
step launches several hundred small kernels, one Python call each. A CUDA graph records them once and
replays them with one launch. Why CUDA graphs rather than `torch.compile`: a step's shapes are few and
static already (runtime.pad_to_multiple), so one capture per shape costs about one step's time, and the
graph holds the whole device step, the optimiser and the moving average included, with no compile time
and no recompilation as widths change.

`CapturedSteps` holds no step logic: it records training/step.py's `compute`, the function the eager step
runs, and replays it. A step's shape (its key) is its tasks and the shape of every tensor of each of their
pieces. The first step of a key runs `compute` eagerly: it warms up the kernels and allocates AdamW's
state. The second is recorded, reading its batch from static input buffers; from then on the key's steps
copy their batch into the buffers and replay. What the graph machinery adds around `compute`:
- the lr: a graph cannot read the host's numbers, so while a graph is recorded each group's lr is a view
  into one device vector, which is refilled from the LR schedule's numbers with one copy before each
  replay (`DeviceLrs`); AdamW runs in its capturable form (its step count on the device);
- the moving average counts its updates on the device, captured or not (training/averaging.py);
- a bi-encoder batch has both sentences at one width (`one_width`): one key per width, not per pair;
- the losses are copied out of the graph's buffers, which the next replay overwrites.

What still holds under capture:
- Dropout draws new masks at each replay: PyTorch registers its CUDA generator with the graph, and each
  replay starts from the generator's current offset. A resumed run restores that offset from the
  checkpoint, as the eager loop does.
- A non-finite loss stops the run naming its task and step: the replayed losses go to `FiniteWatch` as the
  eager step's do.
- The first step of each key after a resume is eager again; eager and replayed steps run the same kernels
  on the same random offsets.

A step that needs the host cannot be captured: SMART and the Bregman teacher read figures off the device,
PCGrad and distillation choose on the host, gradient accumulation updates every few steps, and several
ranks all-reduce between backward and update. Such a run logs one line and keeps the eager step.

The recorder has two calls, `record(function)` and `replay(recorded)`: `CudaGraphs` on a GPU, and on a CPU
`Reruns`, a stand-in that runs the function at each replay, so that tests on a CPU run every line of this
module but the CUDA calls (tests/test_capture.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from mtbert.training.losses import BatchLoss, Distilled
from mtbert.training.smart import Regularised
from mtbert.training.step import Pieces, compute

log = logging.getLogger("train")


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
    if run.model.states_depth:
        return "the frozen layers' states (runtime.frozen_states) are not widened to a captured shape"
    return None


def device_work(run) -> Callable:
    """The step's device work for this run, chosen once: `compute` (training/step.py), or on a GPU that asked
    for it (runtime.capture.cuda) the same function captured as CUDA graphs; where something rules capture
    out, `compute`, with one log line saying what."""
    if run.device.type != "cuda" or not run.params.runtime.capture.cuda:
        return compute
    blocker = capture_blocker(run)
    if blocker is not None:
        log.info("captured steps off: %s; the eager step runs", blocker)
        return compute
    log.info("captured steps on: one CUDA graph per task and batch shape, replayed")
    return CapturedSteps(run, CudaGraphs)


@dataclasses.dataclass
class Graph:
    recorded: object  # what the recorder replays (a torch.cuda.CUDAGraph, or a `Rerun`)
    pieces: Pieces  # its static input buffers, on the device
    losses: list[BatchLoss]  # its static outputs, one per piece, which each replay overwrites


class CapturedSteps:
    """`compute` recorded once per step shape and replayed (`device_work`); called as `compute` is."""

    def __init__(self, run, recorder_type: type):
        self.recorder_type = recorder_type  # CudaGraphs, or on a CPU the stand-in Reruns
        self.recorder = None  # made at the first step: after any resume (AdamW's restored state goes to the GPU)
        self.graphs: dict[tuple, Graph] = {}
        self.warm: set[tuple] = set()  # keys whose eager first step ran
        self.failed = False  # a recording failed: eager steps from then on
        self.replays = self.eager_steps = 0
        run.objective.autocast_cache = False  # a graph must not hold casts cached by another step's pass

    def __call__(self, run, progress, pieces: Pieces, ends_update: bool) -> list[BatchLoss]:
        """The step's device work (`compute`'s): eager at a key's first step, recorded at its second, replayed
        from then on. Every step ends an update: a captured run has train.grad_accum 1."""
        if self.recorder is None:
            self.recorder = self.recorder_type(run)
        pieces = {task: [dataclasses.replace(piece, batch=one_width(piece.batch, run.model.family.pad_id))
                         for piece in task_pieces] for task, task_pieces in pieces.items()}
        key = tuple((task, tuple(tuple((name, tuple(t.shape)) for name, t in piece.batch.items())
                                 for piece in task_pieces)) for task, task_pieces in pieces.items())
        graph = self.graphs.get(key)
        if graph is None and key in self.warm and not self.failed:
            graph = self._record(run, progress, key, pieces, ends_update)
        if graph is None:
            self.warm.add(key)
            self.eager_steps += 1
            return compute(run, progress, pieces, ends_update)
        for buffers, batch in zip(batches(graph.pieces), batches(pieces), strict=True):
            for name, tensor in batch.items():
                buffers[name].copy_(tensor.pin_memory() if buffers[name].is_cuda else tensor, non_blocking=True)
        self.recorder.replay(graph.recorded)
        self.replays += 1
        return [copied(loss) for loss in graph.losses]  # the next replay overwrites the graph's

    def summary(self) -> str:
        return f"{len(self.graphs)} graphs captured, {self.replays} steps replayed, {self.eager_steps} eager"

    def _record(self, run, progress, key: tuple, pieces: Pieces, ends_update: bool) -> Graph | None:
        """The step of this key recorded on static input buffers (recording runs nothing: the replay that
        follows does); None if recording fails (then every later step is eager, after one log line)."""
        static = {task: [dataclasses.replace(piece, batch={name: torch.empty(t.shape, dtype=t.dtype, device=run.device)
                                                          for name, t in piece.batch.items()})
                         for piece in task_pieces] for task, task_pieces in pieces.items()}
        try:
            recorded, losses = self.recorder.record(lambda: compute(run, progress, static, ends_update))
        except RuntimeError as error:
            self.failed = True
            log.warning("captured steps off from here: capturing a %s step failed (%s); the eager step runs",
                        "+".join(pieces), " ".join(str(error).split())[:200])
            run.optimizer.zero_grad(set_to_none=True)
            return None
        self.graphs[key] = Graph(recorded, static, losses)
        log.info("captured steps: a %s step recorded, %d graph(s)", "+".join(pieces), len(self.graphs))
        return self.graphs[key]


def batches(pieces: Pieces) -> Iterator[dict[str, torch.Tensor]]:
    return (piece.batch for task_pieces in pieces.values() for piece in task_pieces)


def copied(loss: BatchLoss) -> BatchLoss:
    return dataclasses.replace(loss, total=loss.total.detach().clone(), task_loss=loss.task_loss.clone())


# --- the recorder: CUDA graphs, or a CPU stand-in with the same two calls -----------------------------------
class CudaGraphs:
    """Records a function's kernels as a CUDA graph (running none of them) and replays them on the same
    buffers, the lr read from one device vector."""

    def __init__(self, run):
        self.lrs = DeviceLrs(run.optimizer, run.device)

    def record(self, function: Callable[[], list[BatchLoss]]) -> tuple[torch.cuda.CUDAGraph, list[BatchLoss]]:
        graph = torch.cuda.CUDAGraph()
        with self.lrs.as_views(), torch.cuda.graph(graph):
            outputs = function()
        return graph, outputs

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        self.lrs.refill()
        graph.replay()


@dataclasses.dataclass
class Rerun:
    function: Callable[[], list[BatchLoss]]
    outputs: list[BatchLoss]


class Reruns:
    """The CPU stand-in for `CudaGraphs`: recording keeps the function and runs nothing, as a CUDA graph's
    recording runs no kernel; a replay runs it and writes its losses into the ones recording returned, in
    place, as a graph's replay overwrites its output buffers."""

    def __init__(self, run):
        pass

    def record(self, function: Callable[[], list[BatchLoss]]) -> tuple[Rerun, list[BatchLoss]]:
        rerun = Rerun(function, [])
        return rerun, rerun.outputs

    def replay(self, rerun: Rerun) -> None:
        fresh = rerun.function()
        if not rerun.outputs:  # the first replay: the outputs' buffers are made
            rerun.outputs.extend(dataclasses.replace(loss, total=loss.total.detach()) for loss in fresh)
            return
        for kept, loss in zip(rerun.outputs, fresh, strict=True):  # overwritten in place, as a graph's are
            kept.total.copy_(loss.total.detach())
            kept.task_loss.copy_(loss.task_loss)


class DeviceLrs:
    """Each param group's lr as AdamW reads it inside a graph: one device vector, which the groups' lrs are
    views into while a graph is recorded, refilled from the LR schedule's numbers with one copy before each
    replay (the scheduler would fill each group's tensor with a launch of its own). Outside a recording the
    groups hold numbers, as in the eager step, so the schedule and a checkpoint see numbers. AdamW runs in its
    capturable form: its step count on the device."""

    def __init__(self, optimizer, device: torch.device):
        self.groups = optimizer.param_groups
        self.values = torch.zeros(len(self.groups), dtype=torch.float32, device=device)
        for group in self.groups:
            group["capturable"] = True
        for state in optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].to(device, torch.float32)

    def refill(self) -> None:
        numbers = torch.tensor([float(group["lr"]) for group in self.groups], dtype=torch.float32)
        self.values.copy_(numbers.pin_memory() if self.values.is_cuda else numbers, non_blocking=True)

    @contextlib.contextmanager
    def as_views(self) -> Iterator[None]:
        numbers = [group["lr"] for group in self.groups]
        for index, group in enumerate(self.groups):
            group["lr"] = self.values[index]
        try:
            yield
        finally:
            for group, number in zip(self.groups, numbers, strict=True):
                group["lr"] = number


def one_width(batch: dict[str, torch.Tensor], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A bi-encoder batch with both sentences' tensors at the wider one's width, as the model pads them
    anyway (ids with the encoder's pad id, masks with 0): one key per width, not one per pair of widths."""
    if "input_ids_1" not in batch:
        return batch
    width = max(batch["input_ids_1"].shape[1], batch["input_ids_2"].shape[1])
    return {name: F.pad(tensor, (0, width - tensor.shape[1]), value=pad_id if name.startswith("input_ids") else 0)
            if tensor.ndim == 2 else tensor for name, tensor in batch.items()}
