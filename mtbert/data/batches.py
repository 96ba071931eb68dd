"""Tokenized splits in memory, length-bucketed batches and dynamic padding.

Token lists stay as Arrow's flat values + offsets (no Python object per example); a batch is cut out
and padded only to its own longest member, or (`multiple` > 1) up to the next multiple of `multiple`, so
that a GPU sees a few static shapes (runtime.pad_to_multiple).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import torch

from mtbert import io
from mtbert.data.tasks import Task, tokenized_path
from mtbert.data.tokenization import PAD_ID_KEY
from mtbert.runtime import MissingInputError, UnreadableInputError


def padded_width(longest: int, multiple: int = 1) -> int:
    """A batch's width: its longest row's length rounded up to a multiple of `multiple`."""
    return -(-longest // multiple) * multiple


def micro_batches(rows: np.ndarray, lengths: np.ndarray, max_batch_tokens: int,
                  multiple: int = 1) -> list[np.ndarray]:
    """`rows` in pieces of at most `max_batch_tokens` padded tokens (0: one piece), widths padded to a multiple
    of `multiple`. A batch of long sentences otherwise holds all its activations at once, and those few
    batches set training's memory peak. The pieces' gradients add up to the batch's; only the dropout masks
    are drawn differently."""
    if not max_batch_tokens or len(rows) <= 1:
        return [rows] if len(rows) else []
    padded_tokens = len(rows) * padded_width(int(lengths[rows].max()), multiple)
    return np.array_split(rows, min(len(rows), math.ceil(padded_tokens / max_batch_tokens)))


def padding_free_tokens(batch: dict[str, torch.Tensor]) -> int:
    """A batch's tokens that are not padding, counted on the host."""
    return int(sum(v.sum() for k, v in batch.items() if k.startswith("attention_mask")))


@dataclasses.dataclass
class TokenColumn:
    """A list<int32> column as flat values and offsets."""
    values: np.ndarray
    offsets: np.ndarray

    @classmethod
    def from_arrow(cls, column: pa.ChunkedArray) -> TokenColumn:
        array = column.combine_chunks()
        offsets = array.offsets.to_numpy().astype(np.int64)
        # flatten() honours a slice; the offsets of a sliced array still count from the unsliced start.
        return cls(array.flatten().to_numpy().astype(np.int64), offsets - offsets[0])

    @classmethod
    def concat(cls, columns: list[TokenColumn]) -> TokenColumn:
        """One column holding the rows of `columns` one after another."""
        starts = np.cumsum([0] + [len(c.values) for c in columns[:-1]])
        offsets = [np.zeros(1, dtype=np.int64)] + [c.offsets[1:] + start
                                                   for c, start in zip(columns, starts, strict=True)]
        return cls(np.concatenate([c.values for c in columns]), np.concatenate(offsets))

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def take(self, rows: np.ndarray) -> TokenColumn:
        """A column of the given rows, in that order."""
        lengths = self.lengths()[rows]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        gather = np.repeat(self.offsets[rows] - offsets[:-1], lengths) + np.arange(offsets[-1])
        return TokenColumn(self.values[gather], offsets)

    def padded_to(self, rows: np.ndarray, max_length: int, pad_value: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `padded`, but rows longer than max_length are cut and keep their last token (e.g. [SEP])."""
        ids, mask = self.padded(rows, pad_value)
        if ids.shape[1] <= max_length:
            return ids, mask
        ids, mask = ids[:, :max_length].clone(), mask[:, :max_length]
        cut = torch.from_numpy(self.lengths()[rows] > max_length)
        ids[cut, max_length - 1] = torch.from_numpy(self.values[self.offsets[rows + 1] - 1])[cut]
        return ids, mask

    def padded(self, rows: np.ndarray, pad_value: int = 0, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention mask), each (len(rows), the longest row rounded up to a multiple of `multiple`)."""
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        lengths = ends - starts
        width = padded_width(int(lengths.max()), multiple)
        positions = np.arange(width)
        mask = positions[None, :] < lengths[:, None]
        gather = np.where(mask, starts[:, None] + positions[None, :], 0)
        ids = np.where(mask, self.values[gather] if len(self.values) else 0, pad_value)
        return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))


class RowStates(Protocol):
    """What a split's batches carry beside the tokens: training/frozen_states.py's `FrozenStates`."""

    def add_to(self, batch: dict[str, torch.Tensor], rows: np.ndarray) -> None: ...


@dataclasses.dataclass
class TaskSplit:
    """One task's split: ids, labels (NaN when unlabeled), token columns and the id they are padded with."""
    task: Task
    ids: np.ndarray
    labels: np.ndarray
    tokens: dict[str, TokenColumn]
    pad_id: int = 0
    states: RowStates | None = None  # the frozen bottom's output of each row (training/frozen_states.py)

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self, encoding: str) -> np.ndarray:
        """Tokens per example as the model reads it (bi-encoders: the longer sentence)."""
        if encoding == "bi":
            return np.maximum(self.tokens["input_ids_1"].lengths(), self.tokens["input_ids_2"].lengths())
        return self.tokens["input_ids"].lengths()

    def batch(self, rows: np.ndarray, encoding: str, multiple: int = 1) -> dict[str, torch.Tensor]:
        """The rows' labels and token tensors, padded to a multiple of `multiple` columns."""
        rows = np.asarray(rows, dtype=np.int64)
        batch = {"labels": torch.from_numpy(self.labels[rows])}
        if encoding == "bi":
            for side in ("1", "2"):
                ids, mask = self.tokens[f"input_ids_{side}"].padded(rows, self.pad_id, multiple)
                batch[f"input_ids_{side}"], batch[f"attention_mask_{side}"] = ids, mask
        else:
            batch["input_ids"], batch["attention_mask"] = self.tokens["input_ids"].padded(rows, self.pad_id, multiple)
            batch["token_type_ids"], _ = self.tokens["token_type_ids"].padded(rows, multiple=multiple)
        if self.states is not None:
            self.states.add_to(batch, rows)
        return batch


def on_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch on `device`. To a CUDA GPU each tensor goes through pinned memory, copied without the host
    waiting for it (the copy is queued behind the kernels before it); on a CPU, and a batch on the GPU already
    (a captured step's buffers), the tensors are used as they are."""
    if device.type == "cpu":
        return batch
    if device.type == "cuda":
        return {name: tensor if tensor.is_cuda else tensor.pin_memory().to(device, non_blocking=True)
                for name, tensor in batch.items()}
    return {name: tensor.to(device) for name, tensor in batch.items()}


def tokenized_input(tokenized_dir: Path | str, task: str, split: str) -> Path:
    """The path of a tokenized split, which must be there."""
    path = tokenized_path(tokenized_dir, task, split)
    if not path.is_file():
        stage = "transfer" if split == "transfer" else "tokenize"  # the transfer set is the stage `transfer`'s
        raise MissingInputError(f"{path} is missing; run `dvc repro {stage}` first")
    return path


def load_split(tokenized_dir: Path | str, task: Task, split: str, max_examples: int = 0) -> TaskSplit:
    path = tokenized_input(tokenized_dir, task.name, split)
    table = io.read_parquet(path, split_columns(task), "expected a split `tokenize` writes: run `dvc repro "
                            "tokenize` again (or `dvc checkout tokenize` to restore it)")
    if max_examples:
        table = table.slice(0, max_examples)
    labels = table.column("label").to_numpy(zero_copy_only=False).astype(np.float64)  # null -> NaN
    return split_of_table(table, task, labels, path)


def split_of_table(table: pa.Table, task: Task, labels: np.ndarray, where: Path | str = "") -> TaskSplit:
    """A tokenized table (as `encode_rows` makes it) as a TaskSplit, padded with the id its tokenizer pads
    with (0 for a table written before that was recorded: every such table is BERT's)."""
    token_columns = [name for name in ("input_ids", "token_type_ids", "input_ids_1", "input_ids_2")
                     if name in table.column_names]
    recorded = (table.schema.metadata or {}).get(PAD_ID_KEY, b"0")
    if not recorded.isdigit():
        raise UnreadableInputError(f"{where or 'a tokenized table'}: its {PAD_ID_KEY.decode()} is {recorded!r}, "
                                   "expected the tokenizer's pad id; run `dvc repro tokenize` again")
    return TaskSplit(task=task, ids=np.asarray(table.column("id").to_pylist(), dtype=object), labels=labels,
                     tokens={name: TokenColumn.from_arrow(table.column(name)) for name in token_columns},
                     pad_id=int(recorded))


def split_columns(task: Task) -> tuple[str, ...]:
    """The columns `tokenize` writes that a TaskSplit reads."""
    return ("id", "label", "input_ids", "token_type_ids", *(("input_ids_1", "input_ids_2") if task.is_pair else ()))


def bucketed_batches(lengths: np.ndarray, batch_size: int, bucket_batches: int,
                     rng: np.random.Generator) -> list[np.ndarray]:
    """One pass over the examples in shuffled batches of similar length.

    Shuffle, cut into windows of `bucket_batches` batches, sort each window by length, cut it into
    batches, then shuffle the batch order: little padding, yet every pass is a different mix.
    """
    order = rng.permutation(len(lengths))
    window = batch_size * bucket_batches
    batches = []
    for start in range(0, len(order), window):
        chunk = order[start:start + window]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches.extend(chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size))
    return [batches[i] for i in rng.permutation(len(batches))]


def eval_batches(lengths: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Batches of similar length in a fixed order, for evaluation."""
    order = np.argsort(lengths, kind="stable")
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
