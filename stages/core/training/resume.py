"""Resume checkpoints that survive a kill: one torch file, written atomically, loaded with weights_only=True.

A checkpoint carries the fingerprint of the run that wrote it (params and data), so a stale one from
other params is ignored rather than resumed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from stages.core import io

log = logging.getLogger(__name__)


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


def save_checkpoint(path: Path, state: dict) -> None:
    with io.atomic_path(path) as temp:
        torch.save(state, temp)


def load_checkpoint(path: Path, fingerprint: str) -> dict | None:
    """The saved state if it belongs to this exact run (same params and data), else None."""
    path = Path(path)
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("fingerprint") != fingerprint:
        log.warning("ignoring %s: it was written by a run with other params or data", path)
        return None
    return state
