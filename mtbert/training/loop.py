"""What both training loops (fine-tuning and masked-LM) share: their paths, the training clock, the run's
fingerprint, writing and resuming its checkpoint, the non-finite-loss guard, the finish and the speed
record.

Both runs (training/build.py's `FineTuning`, masked_lm.py's `MaskedLM`) carry the fields these read:
`paths`, `fingerprint`, `ranks`, `model`, `optimizer`, `scheduler` and `stopwatch`."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from mtbert import io
from mtbert.runtime import UserError, peak_rss_gib
from mtbert.training.checkpoint import (
    discard_checkpoints,
    load_checkpoint,
    remove_checkpoint_folder,
    restore,
    save_checkpoint,
)
from mtbert.training.distributed import Ranks


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (e.g. a non-finite loss)."""


@dataclasses.dataclass
class Paths:
    tokenized: Path
    model_out: Path
    metrics_out: Path
    live_dir: Path
    checkpoints: Path
    pretrained: Path | None = None  # fine-tuning: the `pretrain` stage's output; None starts from model.name
    snapshots: Path | None = None  # fine-tuning: where each epoch's prediction dumps go


class Stopwatch:
    """Seconds spent training, excluding evaluation and checkpoint writes (run inside `paused()`)."""

    def __init__(self, seconds: float = 0.0):
        self.seconds = seconds
        self._started: float | None = None

    def start(self) -> None:
        self._started = time.perf_counter()

    def stop(self) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        running = self._started is not None
        self.stop()
        try:
            yield
        finally:
            if running:
                self.start()


def fingerprint(settings: dict, files: Iterable[Path]) -> str:
    """Identifies a run by what decides its result: its settings and the bytes of its input files. A checkpoint
    of another fingerprint is not resumed."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in files:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def write_checkpoint(run, progress, checkpoint_type: type, **state: Any) -> None:
    """The run's checkpoint written atomically by the main rank: a `checkpoint_type` (the loop's dataclass) of
    its fingerprint, progress, weights, optimiser and LR schedule, and `state`, the loop's own fields (gathered
    from every rank already). The caller pauses the training clock around the gather and this."""
    progress.train_seconds = run.stopwatch.seconds
    checkpoint = checkpoint_type(fingerprint=run.fingerprint, progress=progress, model=run.model.state_dict(),
                                 optimizer=run.optimizer.state_dict(), scheduler=run.scheduler.state_dict(), **state)
    if run.ranks.is_main:
        save_checkpoint(run.paths.checkpoints, checkpoint)


def load_latest(run, checkpoint_type: type, progress_type: type) -> tuple[Any, dict] | None:
    """This very run's newest whole checkpoint, loaded into the run's weights, optimiser, LR schedule, RNG and
    training clock: (the checkpoint, this rank's own part of it). None when there is none; the checkpoints of
    another run (other params or data) are then removed, as the run starts over."""
    checkpoint = load_checkpoint(run.paths.checkpoints, checkpoint_type, progress_type, run.fingerprint, run.ranks)
    if checkpoint is None:
        if run.ranks.is_main:
            discard_checkpoints(run.paths.checkpoints)
        return None
    own = restore(checkpoint, run.model, run.optimizer, run.scheduler, run.ranks)
    run.stopwatch = Stopwatch(checkpoint.progress.train_seconds)
    return checkpoint, own


def finish(run, result: dict, write_outputs: Callable[[], None]) -> None:
    """The run is complete: the main rank writes its outputs and its metrics, then removes its checkpoints."""
    if run.ranks.is_main:
        write_outputs()
        io.write_metrics(run.paths.metrics_out, result)
        remove_checkpoint_folder(run.paths.checkpoints)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class FiniteWatch:
    """Non-finite losses, caught without making the step wait for the device: each piece's loss is kept (a
    0-dim tensor on the device) and `check` reads them all in one transfer. The loop checks every
    runtime.check_every steps, before every checkpoint and at the epoch's end, so a non-finite loss still
    stops the run, naming its task and step, before any checkpoint holds the weights it spoiled."""

    def __init__(self, checkpoints: Path, hint: str):
        self.checkpoints, self.hint = checkpoints, hint
        self.pending: list[tuple[torch.Tensor, str, str]] = []

    def add(self, loss: torch.Tensor, what: str, where: str) -> None:
        self.pending.append((loss.detach().float(), what, where))

    def check(self) -> None:
        if not self.pending:
            return
        finite = torch.isfinite(torch.stack([loss for loss, _, _ in self.pending])).tolist()  # the one read
        pending, self.pending = self.pending, []
        for ok, (loss, what, where) in zip(finite, pending, strict=True):
            if not ok:
                raise TrainingError(f"non-finite {what} ({loss.item()}) {where}; the last good checkpoint is kept "
                                    f"in {self.checkpoints}. {self.hint}")


def speed(seconds: float, ranks: Ranks, bf16: bool, steps: int, examples: int | None, tokens: int) -> dict:
    """The only part of a summary that differs between identical runs."""
    record = {"processes": ranks.world_size, "bf16": bf16,  # `auto` differs between machines
              "train_seconds": round(seconds, 1)}
    clock = max(seconds, 1e-9)
    if examples is None:
        record["steps_per_second"] = round(steps / clock, 3)
    else:
        record["seconds_per_step"] = round(seconds / steps, 4)
        record["examples_per_second"] = round(examples / clock, 2)
    record["tokens_per_second"] = round(tokens / clock, 1)
    record["peak_rss_gib"] = round(peak_rss_gib(), 2)  # since this process started (after a resume: since it)
    return record
