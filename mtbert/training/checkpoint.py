"""Resume checkpoints that survive a kill, a full disk and a damaged file: one typed state per loop.

A loop's checkpoint is a dataclass (fine-tuning's `FineTuningCheckpoint`, masked-LM's
`MaskedLMCheckpoint`). Its tensors and state dicts are saved as they are; its `progress` (counters,
history, running sums) as JSON text, so `torch.load(weights_only=True)` reads the file back. Each carries
the fingerprint of the run that wrote it (params and data), so a stale one from other params is ignored
rather than resumed.

A run's checkpoint folder keeps at most two checkpoints: `last.pt`, the newest, and `previous.pt`, the
one before it. Two rather than one, because a checkpoint can be damaged after it was written (a disk or
copy that lost the end of the file), and the one before it still resumes the run, losing only the
updates between them. Two rather than more, because each is large (544 MB for the default variant: the
weights, the optimiser's moments, the moving average) and an older one would only lose more updates
than `previous.pt` does.

A write checks the free disk space first, then drops `previous.pt` (when `last.pt` is there to take its
place), writes the new checkpoint beside `last.pt`, fsyncs it, and renames `last.pt` to `previous.pt` and
the new file to `last.pt`. The folder never holds more than two checkpoints, even while writing, and a
kill or a failed write at any moment leaves the checkpoint before it whole.

A read takes the newest checkpoint that is whole (every zip record passes its CRC-32 check, and torch
reads it back). One that is not is set aside as `<name>.unreadable-<time>` (renamed, not deleted: it is
the evidence of what went wrong) with one warning line, and the one before it is tried; with none left,
the run starts over.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import re
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any, TypeVar

import torch

from mtbert import io
from mtbert.runtime import UserError
from mtbert.training.distributed import Ranks, broadcast, gather

log = logging.getLogger(__name__)

State = TypeVar("State")

LAST, PREVIOUS = "last.pt", "previous.pt"
SET_ASIDE = ".unreadable-"  # in the name of a checkpoint that could not be read
# Beyond the tensors' bytes: the pickled structure, the JSON progress and the zip records' headers.
SIZE_MARGIN = 1 << 20

# What torch.load and zipfile raise on a file cut short or damaged.
READ_ERRORS = (zipfile.BadZipFile, RuntimeError, EOFError, pickle.UnpicklingError, ValueError, OSError)


class CheckpointWriteError(UserError, OSError):
    """A checkpoint cannot be written (too little disk space, a failed write); the one before it is kept."""


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


# --- writing ----------------------------------------------------------------------------------------------
def save_checkpoint(folder: Path, checkpoint: Any) -> None:
    """Write a checkpoint dataclass as the folder's `last.pt`, keeping the one it replaces as `previous.pt`."""
    state = as_state(checkpoint)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    last, previous = folder / LAST, folder / PREVIOUS
    rotating = last.is_file()  # else previous.pt (if any) stays as the one before the new checkpoint
    check_free_space(folder, expected_size(state, last), reclaimable=size_of(previous) if rotating else 0)
    if rotating:
        previous.unlink(missing_ok=True)  # so the folder never holds three
    try:
        with io.atomic_path(last) as temp:
            torch.save(state, temp)
            fsync(temp)
            if rotating:
                os.replace(last, previous)
    except (OSError, RuntimeError) as error:
        raise write_failed(folder, error) from error
    fsync(folder)  # the renames


def as_state(checkpoint: Any) -> dict:
    """The dataclass as a dict torch saves; a dataclass field (the progress) goes as JSON text."""
    state = {}
    for field in dataclasses.fields(checkpoint):
        value = getattr(checkpoint, field.name)
        state[field.name] = json.dumps(dataclasses.asdict(value)) if dataclasses.is_dataclass(value) else value
    return state


def expected_size(state: Any, last: Path) -> int:
    """Bytes the checkpoint will take: its tensors plus a margin, or the last one's size if larger."""
    return max(tensor_bytes(state) + SIZE_MARGIN, size_of(last))


def tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):  # a meta tensor (a released weight) is written without data
        return 0 if value.is_meta else value.nelement() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def size_of(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def check_free_space(folder: Path, needed: int, reclaimable: int) -> None:
    """Refuse to start a write that cannot finish: it would fail anyway, after filling the disk."""
    free = shutil.disk_usage(folder).free + reclaimable
    if free < needed:
        raise CheckpointWriteError(
            f"{folder}: not enough free disk space for the next checkpoint: it needs about {needed:,} bytes and "
            f"{free:,} are free (counting {PREVIOUS}, which it replaces); {kept(folder)}. Free some space and "
            "run the stage again to resume")


def write_failed(folder: Path, error: BaseException) -> CheckpointWriteError:
    free = shutil.disk_usage(folder).free
    return CheckpointWriteError(f"{folder / LAST}: writing the checkpoint failed ({reason(error)}; {free:,} bytes "
                                f"free in {folder}); {kept(folder)}. Free some space and run the stage again to resume")


def kept(folder: Path) -> str:
    """What a resumed run would start from, for a message about a write that did not happen."""
    whole = [name for name in (LAST, PREVIOUS) if (folder / name).is_file()]
    return f"the checkpoint before it is kept ({whole[0]})" if whole else "no checkpoint is kept yet"


def fsync(path: Path) -> None:
    """Make a file's bytes (or a folder's renames) durable before relying on them."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


# --- reading ----------------------------------------------------------------------------------------------
def load_checkpoint(folder: Path, cls: type[State], progress_cls: type, fingerprint: str,
                    ranks: Ranks = Ranks()) -> State | None:
    """The newest whole checkpoint in `folder` if this exact run (same params and data) wrote it, else None.
    Call on every rank: the main rank picks the file (setting aside those it cannot read), the others load it."""
    found = newest_whole(Path(folder)) if ranks.is_main else None
    path = broadcast(None if found is None else str(found[0]), ranks)
    if path is None:
        return None
    state = found[1] if ranks.is_main else torch.load(path, map_location="cpu", weights_only=True)
    return typed(Path(path), state, cls, progress_cls, fingerprint)


def newest_whole(folder: Path) -> tuple[Path, dict] | None:
    """`last.pt`, else `previous.pt`, with its state: the first that reads back whole. One that does not is
    set aside, with a line saying so."""
    io.remove_abandoned(folder / LAST)  # a killed write's temporary, as large as a checkpoint
    candidates = [folder / name for name in (LAST, PREVIOUS) if (folder / name).is_file()]
    for index, path in enumerate(candidates):
        try:
            return path, read_state(path)
        except UnreadableCheckpoint as error:
            aside = set_aside(path)
            then = f"trying {candidates[index + 1].name}" if index + 1 < len(candidates) else "starting over"
            log.warning("checkpoint %s cannot be read (%s): set aside as %s; %s", path, error, aside.name, then)
    return None


class UnreadableCheckpoint(Exception):
    """A checkpoint file cut short or damaged (internal: it is set aside, never shown as an error)."""


def read_state(path: Path) -> Any:
    """The saved state; UnreadableCheckpoint if the file is cut short or any record fails its CRC-32
    (torch.load alone reads damaged tensor bytes without a word)."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        state = None if damaged else torch.load(path, map_location="cpu", weights_only=True)
    except READ_ERRORS as error:
        raise UnreadableCheckpoint(reason(error)) from error
    if damaged:
        raise UnreadableCheckpoint(f"its record {damaged} fails its CRC-32 check")
    return state


def set_aside(path: Path) -> Path:
    """Rename an unreadable checkpoint out of the way, keeping it (never overwriting an earlier one)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside = path.with_name(f"{path.name}{SET_ASIDE}{stamp}")
    number = 1
    while aside.exists():
        number += 1
        aside = path.with_name(f"{path.name}{SET_ASIDE}{stamp}-{number}")
    os.replace(path, aside)
    return aside


def typed(path: Path, state: Any, cls: type[State], progress_cls: type, fingerprint: str) -> State | None:
    """The state as `cls` if this run wrote it; None (with a warning) if another run or mtbert did."""
    if not isinstance(state, dict) or state.get("fingerprint") != fingerprint:
        log.warning("ignoring %s: it was written by a run with other params or data; starting over", path)
        return None
    try:  # a checkpoint of another layout (an older mtbert) is not resumed, as one of other params is not
        state["progress"] = progress_cls.from_json(json.loads(state["progress"]))
        return cls(**state)
    except (KeyError, TypeError, ValueError):
        log.warning("ignoring %s: it holds no %s (written by another version of mtbert); starting over",
                    path, cls.__name__)
        return None


def reason(error: BaseException) -> str:
    """An exception as a short phrase: its type and the first sentence of its message (torch's messages go
    on with advice for developers, and name the C++ line that raised)."""
    message = re.sub(r"\[enforce fail at [^\]]*\][\s.]*", "", " ".join(str(error).split()))
    message = message.split(". ")[0]
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


# --- starting over and finishing --------------------------------------------------------------------------
def discard_checkpoints(folder: Path) -> None:
    """Remove the checkpoints of another run (other params or data) when this one starts over, so that
    `previous.pt` always belongs to the same run as `last.pt`. Set-aside files stay."""
    for name in (LAST, PREVIOUS):
        (Path(folder) / name).unlink(missing_ok=True)
    io.remove_abandoned(Path(folder) / LAST)


def remove_checkpoint_folder(folder: Path) -> None:
    """The run is complete: remove its checkpoint folder, except the checkpoints set aside as unreadable,
    which are the user's to look at and delete."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    kept_aside = []
    for entry in folder.iterdir():
        if SET_ASIDE in entry.name:
            kept_aside.append(entry.name)
        elif entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    if kept_aside:
        log.warning("%s keeps %d checkpoint(s) set aside as unreadable (%s): delete them when done with them",
                    folder, len(kept_aside), ", ".join(sorted(kept_aside)))
    else:
        shutil.rmtree(folder, ignore_errors=True)


def own_where_released(state: dict, module: torch.nn.Module) -> dict:
    """A saved state_dict to load into `module`: each weight saved released (a meta tensor, training/build.py's
    frozen bottom) keeps the module's own, which is the same frozen weight, in memory or released."""
    own = module.state_dict()
    return {key: own[key] if isinstance(value, torch.Tensor) and value.is_meta and key in own else value
            for key, value in state.items()}


def restore(state: Any, model: torch.nn.Module, optimizer, scheduler, ranks: Ranks) -> dict:
    """Load a checkpoint's weights, optimiser, scheduler and this rank's RNG; return this rank's own state."""
    model.load_state_dict(own_where_released(state.model, model))
    capturable = [group.get("capturable", False) for group in optimizer.param_groups]
    optimizer.load_state_dict(state.optimizer)
    for group, was_capturable in zip(optimizer.param_groups, capturable, strict=True):
        # a run with captured steps saved each lr as a device tensor: a number again, made a tensor again by
        # training/capture.py if this run captures its steps too
        group["lr"], group["capturable"] = float(group["lr"]), was_capturable
    scheduler.load_state_dict(state.scheduler)
    own = state.ranks[ranks.rank]
    set_rng_state(own["rng"])
    return own
