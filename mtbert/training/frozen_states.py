"""The frozen bottom's output for every row a run reads, computed once (train.freeze_layers,
runtime.frozen_states).

With the embeddings and the bottom N layers frozen and their dropout off (training/build.py), what they give
for a row is the same in every epoch. So the run computes it once, before its first step, for its training and
dev rows, and every batch brings its rows' states: a step, and the dev pass, run only the layers above
(mtbert/model/frozen.py). The result is the same network's, up to float rounding: the bottom runs on other
batches than the step's.

The states live in files in the run's checkpoint folder, float32 as the layer gave them, one file per task's
token column, each row's states at its tokens' offsets in that column. A batch reads its rows' states, one read
each, so the process holds a batch's states only (the kernel's page cache holds the files). With several ranks
(train.nproc) each rank computes and keeps its own. A resumed run
reuses the files where their record names the same run (fingerprint), depth, precision and sizes; otherwise
they are computed again. They go with the checkpoint folder at the run's end.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from mtbert import io
from mtbert.data.batches import TaskSplit, eval_batches
from mtbert.model.frozen import bottom_states
from mtbert.model.multitask import MultitaskModel
from mtbert.params import Params
from mtbert.runtime import UnreadableInputError

log = logging.getLogger("train")

STATE_KEYS = {"input_ids": "states", "input_ids_1": "states_1", "input_ids_2": "states_2"}  # a batch's keys
COLUMNS = {"cross": ("input_ids",), "bi": ("input_ids_1", "input_ids_2")}  # the columns an encoding reads
BYTES = 4  # float32


def states_depth(params: Params, model: MultitaskModel, device: torch.device) -> int:
    """How many bottom layers' output the run computes once: the frozen layers that every task's encoder shares.
    0 where runtime.frozen_states is off on this device, where smart.* turns a term on (SMART perturbs the
    embeddings below them; the Bregman teacher alone is left out with it, untried), or where no layer is both
    frozen and shared (an arch whose heads read two encoders, or one per task)."""
    if not params.runtime.frozen_states.on(device.type) or params.smart.turns_a_term_on(model.tasks):
        return 0
    return min(params.train.freeze_layers, model.encoders.shared_depth)


@dataclasses.dataclass
class StatesFile:
    """One token column's states: float32 (tokens, hidden) in a file, row r's from the column's offsets[r]."""
    path: Path
    offsets: np.ndarray
    hidden: int

    def padded(self, rows: np.ndarray, width: int) -> torch.Tensor:
        """The rows' states, (len(rows), width, hidden), zero past each row's tokens (masked out anyway)."""
        out = np.zeros((len(rows), width, self.hidden), dtype=np.float32)
        descriptor = os.open(self.path, os.O_RDONLY)
        try:
            for index, row in enumerate(rows):
                tokens = int(self.offsets[row + 1] - self.offsets[row])
                target = memoryview(out[index, :tokens]).cast("B")
                read = os.preadv(descriptor, [target], int(self.offsets[row]) * self.hidden * BYTES)
                if read != len(target):
                    raise UnreadableInputError(f"{self.path}: cut short at row {row}; delete the file and run "
                                                  "the training again")
        finally:
            os.close(descriptor)
        return torch.from_numpy(out)


@dataclasses.dataclass
class FrozenStates:
    """A split's states, per token column its encoding reads; added to each of its batches."""
    files: dict[str, StatesFile]

    def add_to(self, batch: dict[str, torch.Tensor], rows: np.ndarray) -> None:
        for column, states in self.files.items():
            batch[STATE_KEYS[column]] = states.padded(rows, batch[column].shape[1])


def with_frozen_states(model: MultitaskModel, splits: dict[str, TaskSplit], split_name: str, folder: Path,
                       fingerprint: str, bf16: bool, batch_size: int, device: torch.device) -> dict[str, TaskSplit]:
    """The splits with their rows' states, from the files in `folder` where a record says they are this run's,
    else computed now. The model computes them in eval mode, whose attention is the fastest (mtbert/model/
    architectures.py); the frozen layers' dropout is off, so training mode would compute the same."""
    files = {task: {column: StatesFile(folder / f"{split_name}-{task}-{column}.f32", split.tokens[column].offsets,
                                       model.encoder.config.hidden_size)
                    for column in COLUMNS[model.encoding(task)]} for task, split in splits.items()}
    record_path = folder / f"{split_name}.json"
    record = {"fingerprint": fingerprint, "depth": model.states_depth, "bf16": bf16,
              "bytes": {states.path.name: int(states.offsets[-1]) * states.hidden * BYTES
                        for columns in files.values() for states in columns.values()}}
    gigabytes = sum(record["bytes"].values()) / 1e9
    if is_recorded(record_path, record):
        log.info("frozen states of the %s rows: reused from %s (%.2f GB)", split_name, folder, gigabytes)
    else:
        log.info("frozen states of the %s rows: computing the bottom %d layers' output once, %.2f GB in %s",
                 split_name, model.states_depth, gigabytes, folder)
        record_path.unlink(missing_ok=True)  # a kill while the files are rewritten leaves no record
        folder.mkdir(parents=True, exist_ok=True)
        mode = model.training
        model.eval()
        for task, split in splits.items():
            compute(model, task, split, files[task], bf16, batch_size, device)
        model.train(mode)
        io.write_json(record_path, record)
    return {task: dataclasses.replace(split, states=FrozenStates(files[task])) for task, split in splits.items()}


def is_recorded(record_path: Path, record: dict) -> bool:
    """Whether the files were written whole for this very record (the record is written after them)."""
    if not record_path.is_file():
        return False
    try:
        written = io.read_json(record_path, "")
    except UnreadableInputError:
        return False
    return written == record and all((record_path.parent / name).is_file() and
                                     (record_path.parent / name).stat().st_size == size
                                     for name, size in record["bytes"].items())


def compute(model: MultitaskModel, task: str, split: TaskSplit, files: dict[str, StatesFile], bf16: bool,
            batch_size: int, device: torch.device) -> None:
    """Every row's states of each column, written at its offsets, batch by batch in order of length."""
    encoding = model.encoding(task)
    descriptors = {column: os.open(states.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                   for column, states in files.items()}
    try:
        batches = eval_batches(split.lengths(encoding), batch_size)
        for rows in tqdm(batches, desc=f"frozen states {task}", unit="batch", leave=False):
            batch = split.batch(rows, encoding)
            for column, states in files.items():
                values = bottom_of(model, batch, column, bf16, device)
                for index, row in enumerate(rows):
                    tokens = int(states.offsets[row + 1] - states.offsets[row])
                    data = values[index, :tokens].tobytes()
                    if os.pwrite(descriptors[column], data, int(states.offsets[row]) * states.hidden * BYTES) \
                            != len(data):
                        raise OSError(f"{states.path}: row {row} written short (is the disk full?)")
        for descriptor in descriptors.values():
            os.fsync(descriptor)  # on disk before the record that says they are whole
    finally:
        for descriptor in descriptors.values():
            os.close(descriptor)


def bottom_of(model: MultitaskModel, batch: dict[str, torch.Tensor], column: str, bf16: bool,
              device: torch.device) -> np.ndarray:
    """The frozen bottom's output of one column of a batch, as the step's forward would compute it: float32
    (rows, width, hidden) on the host."""
    mask = batch[column.replace("input_ids", "attention_mask")]
    types = model.family.encoder_inputs(batch.get("token_type_ids") if column == "input_ids" else None)
    types = {name: value.to(device) for name, value in types.items() if value is not None}
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        states = bottom_states(model.encoder, model.states_depth, batch[column].to(device), mask.to(device), **types)
    return states.float().cpu().numpy()
