"""The resumable-run skeleton both training loops share (fine-tuning and masked-LM).

A run owns a model, an optimiser and a scheduler, and keeps its progress (counters, history, running
sums, training seconds) in plain attributes. `checkpoint()` writes all of it, with every rank's RNG,
atomically to <checkpoints>/last.pt together with the run's fingerprint (its params and data);
`resume()` loads it back when the fingerprint matches, so a killed run started again ends exactly as an
uninterrupted one. A loop subclasses `ResumableRun` and says what else its state holds
(`loop_state` / `load_loop_state`, `rank_state` / `load_rank_state`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from stages.core import io
from stages.core.runtime import UserError, open_live, peak_rss_gib, use_bf16
from stages.core.training.distributed import Ranks, average_gradients, gather
from stages.core.training.resume import load_checkpoint, rng_state, save_checkpoint, set_rng_state

log = logging.getLogger(__name__)

# Progress kept as JSON text in the checkpoint, so torch.load(weights_only=True) can read it back.
JSON_STATE = ("history", "running")


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
    snapshots: Path | None = None  # fine-tuning: where each epoch's dev and test prediction dumps go


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


class ResumableRun:
    """State, checkpoints and the optimiser step of one run; subclasses add the loop."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def __init__(self, paths: Paths, ranks: Ranks, device: torch.device, fingerprint: str, bf16: bool | str):
        self.paths, self.ranks, self.device, self.fingerprint = paths, ranks, device, fingerprint
        self.bf16 = use_bf16(bf16, device)  # `auto` decided once, by the device
        log.info("bf16 autocast %s (bf16: %s on %s)", "on" if self.bf16 else "off", bf16, device.type)
        self.history: list[dict] = []
        self.running: dict = {}
        self.stopwatch = Stopwatch()

    # --- what a loop adds to the state --------------------------------------------------------------
    def loop_state(self) -> dict:
        """The loop's own progress (counters, data positions), the same on every rank."""
        return {}

    def load_loop_state(self, state: dict) -> None:
        pass

    def rank_state(self) -> dict:
        """What differs between ranks besides torch's RNG (e.g. a masking generator)."""
        return {}

    def load_rank_state(self, state: dict) -> None:
        pass

    # --- checkpoints --------------------------------------------------------------------------------
    def state(self) -> dict:
        """Everything a resumed run needs; call it on every rank (it gathers each rank's RNG)."""
        return {"fingerprint": self.fingerprint, "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "ranks": gather({"rng": rng_state(), **self.rank_state()}, self.ranks),
                **{name: json.dumps(getattr(self, name)) for name in JSON_STATE},
                "train_seconds": self.stopwatch.seconds, "loop": self.loop_state()}

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        own = state["ranks"][self.ranks.rank]
        self.load_rank_state(own)
        set_rng_state(own["rng"])
        for name in JSON_STATE:
            setattr(self, name, json.loads(state[name]))
        self.stopwatch = Stopwatch(state["train_seconds"])
        self.load_loop_state(state["loop"])

    def checkpoint(self) -> None:
        """Write the state atomically (the main rank); the time it takes is not training time."""
        with self.stopwatch.paused():
            state = self.state()
            if self.ranks.is_main:
                save_checkpoint(self.checkpoint_file, state)

    def resume(self) -> bool:
        """Load the last checkpoint if this very run (same fingerprint) wrote it."""
        state = load_checkpoint(self.checkpoint_file, self.fingerprint)
        if state is not None:
            self.load_state(state)
        return state is not None

    @property
    def checkpoint_file(self) -> Path:
        return self.paths.checkpoints / "last.pt"

    # --- one optimiser step -------------------------------------------------------------------------
    def optimizer_step(self, grad_clip: float, average: bool = True) -> None:
        """Average the gradients over the ranks (unless the loop already did), clip, step, zero."""
        if average:
            average_gradients(self.trainable(), self.ranks)
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def check_finite(self, loss: torch.Tensor, what: str, where: str, hint: str) -> None:
        """Stop on a non-finite loss, keeping the last good checkpoint."""
        if not torch.isfinite(loss):
            raise TrainingError(f"non-finite {what} ({loss.item()}) {where}; the last good checkpoint is kept "
                                f"in {self.paths.checkpoints}. {hint}")

    # --- outputs ------------------------------------------------------------------------------------
    def open_live(self, log_record):
        """DVCLive on the main rank, with the history so far replayed (None on the other ranks)."""
        return open_live(self.paths.live_dir, self.history, log_record) if self.ranks.is_main else None

    def finish(self, summary: dict) -> None:
        """Write the metrics (main rank) and drop the checkpoints: the run is complete."""
        if self.ranks.is_main:
            io.write_metrics(self.paths.metrics_out, summary)
            shutil.rmtree(self.paths.checkpoints, ignore_errors=True)

    def speed(self, steps: int, examples: int | None, tokens: int) -> dict:
        """The only part of a summary that differs between identical runs."""
        seconds = max(self.stopwatch.seconds, 1e-9)
        speed = {"processes": self.ranks.world_size, "bf16": self.bf16,  # `auto` differs between machines
                 "train_seconds": round(self.stopwatch.seconds, 1)}
        if examples is None:
            speed["steps_per_second"] = round(steps / seconds, 3)
        else:
            speed["seconds_per_step"] = round(self.stopwatch.seconds / steps, 4)
            speed["examples_per_second"] = round(examples / seconds, 2)
        speed["tokens_per_second"] = round(tokens / seconds, 1)
        speed["peak_rss_gib"] = round(peak_rss_gib(), 2)  # since this process started (after a resume: since it)
        return speed
