"""Resume checkpoints that survive a kill: one typed state per loop, written atomically to one torch file.

A loop's checkpoint is a dataclass (fine-tuning's `FineTuningCheckpoint`, masked-LM's
`MaskedLMCheckpoint`). Its tensors and state dicts are saved as they are; its `progress` (counters,
history, running sums) as JSON text, so `torch.load(weights_only=True)` reads the file back. Each carries
the fingerprint of the run that wrote it (params and data), so a stale one from other params is ignored
rather than resumed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, TypeVar

import torch

from mtbert import io
from mtbert.training.distributed import Ranks, gather

log = logging.getLogger(__name__)

State = TypeVar("State")


def rng_state() -> dict:
    """Torch's global generators drive dropout; data order comes from seeded numpy Generators instead."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def every_rank(own: dict, ranks: Ranks) -> list[dict]:
    """Each rank's RNG and `own` state (e.g. SMART's noise generator), in rank order. Call on every rank."""
    return gather({"rng": rng_state(), **own}, ranks)


def save_checkpoint(path: Path, checkpoint: Any) -> None:
    """Write a checkpoint dataclass atomically; a dataclass field (the progress) goes as JSON text."""
    state = {}
    for field in dataclasses.fields(checkpoint):
        value = getattr(checkpoint, field.name)
        state[field.name] = json.dumps(dataclasses.asdict(value)) if dataclasses.is_dataclass(value) else value
    with io.atomic_path(path) as temp:
        torch.save(state, temp)


def load_checkpoint(path: Path, cls: type[State], progress_cls: type, fingerprint: str) -> State | None:
    """The saved checkpoint if this exact run (same params and data) wrote it, else None."""
    path = Path(path)
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("fingerprint") != fingerprint:
        log.warning("ignoring %s: it was written by a run with other params or data", path)
        return None
    try:  # a checkpoint of another layout (an older mtbert) is not resumed, as one of other params is not
        state["progress"] = progress_cls.from_json(json.loads(state["progress"]))
        return cls(**state)
    except (KeyError, TypeError, ValueError):
        log.warning("ignoring %s: it holds no %s (written by another version of mtbert)", path, cls.__name__)
        return None


def restore(state: Any, model: torch.nn.Module, optimizer, scheduler, ranks: Ranks) -> dict:
    """Load a checkpoint's weights, optimiser, scheduler and this rank's RNG; return this rank's own state."""
    model.load_state_dict(state.model)
    optimizer.load_state_dict(state.optimizer)
    scheduler.load_state_dict(state.scheduler)
    own = state.ranks[ranks.rank]
    set_rng_state(own["rng"])
    return own
