"""Turn validated rows into token-id tables (one Parquet file per task and split).

Each sentence is encoded alone (bi-encoders read these) and, for pair tasks, jointly as
`[CLS] a [SEP] b [SEP]` with token types and longest-first truncation (cross-encoders read these).
Token counts before truncation come from one extra pass without special tokens, so every truncation
is counted rather than guessed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm

from mtbert.data.tasks import Task

TOKEN_LIST = pa.list_(pa.int32())
PAD_ID_KEY = b"mtbert.pad_id"  # the schema metadata naming the tokenizer's padding id (BERT 0, MPNet 1)
SINGLE_IDS_COLUMNS = ("input_ids_1", "input_ids_2")  # each sentence of a pair alone


@dataclasses.dataclass
class EncodingStats:
    truncated: int  # rows whose model input (the joint pair, or the single sentence) was cut
    truncated_sentences: int  # single sentences of pair tasks that were cut when encoded alone


def encode_rows(tokenizer, rows, task: Task, *, max_length: int, batch_size: int,
                label: str = "") -> tuple[pa.Table, EncodingStats]:
    """Encode the kept rows of one split into an Arrow table; label names the progress bar (none without)."""
    texts = [rows[column].tolist() for column in task.text_columns]
    raw_lengths = [_token_counts(tokenizer, column, batch_size) for column in texts]
    columns = {"id": pa.array(rows["id"].tolist(), pa.string())}
    for name, column in zip(task.text_columns, texts, strict=True):
        columns[name] = pa.array(column, pa.string())
    columns["label"] = _label_array(rows, task)
    encoded = _encode(tokenizer, texts, max_length, batch_size, label)
    columns["input_ids"] = pa.array(encoded["input_ids"], TOKEN_LIST)
    columns["token_type_ids"] = pa.array(encoded["token_type_ids"], TOKEN_LIST)
    stats = EncodingStats(truncated=0, truncated_sentences=0)
    specials_single = tokenizer.num_special_tokens_to_add(pair=False)
    if task.is_pair:
        specials_pair = tokenizer.num_special_tokens_to_add(pair=True)
        stats.truncated = int(np.sum(raw_lengths[0] + raw_lengths[1] + specials_pair > max_length))
        for name, column, lengths in zip(SINGLE_IDS_COLUMNS, texts, raw_lengths, strict=True):
            alone = _encode(tokenizer, [column], max_length, batch_size, label and f"{label} {name}")
            columns[name] = pa.array(alone["input_ids"], TOKEN_LIST)
            stats.truncated_sentences += int(np.sum(lengths + specials_single > max_length))
    else:
        stats.truncated = int(np.sum(raw_lengths[0] + specials_single > max_length))
    return pa.table(columns, metadata={PAD_ID_KEY: str(tokenizer.pad_token_id)}), stats


def retokenized(table: pa.Table, tokenizer, task: Task, *, max_length: int, batch_size: int) -> pa.Table:
    """A tokenized table's rows in another tokenizer's tokens (e.g. the transfer set for a member of another
    encoder); its ids, texts, labels and any other column kept."""
    encoded, _ = encode_rows(tokenizer, table.select(["id", *task.text_columns]).to_pandas(), task,
                             max_length=max_length, batch_size=batch_size)
    encoded = encoded.set_column(encoded.schema.get_field_index("label"), "label", table.column("label"))
    for name in table.column_names:
        if name not in encoded.column_names:
            encoded = encoded.append_column(name, table.column(name))
    return encoded


def _label_array(rows, task: Task) -> pa.Array:
    arrow_type = task.kind.label_type
    if "label" not in rows:
        return pa.nulls(len(rows), arrow_type)
    return pa.array(rows["label"].to_numpy(), arrow_type)


def _encode(tokenizer, texts: Sequence[list[str]], max_length: int, batch_size: int,
            label: str) -> dict[str, list[list[int]]]:
    """One or two aligned text columns through the fast tokenizer, batch by batch."""
    out: dict[str, list[list[int]]] = {"input_ids": [], "token_type_ids": []}
    total = len(texts[0])
    for batch in tqdm(_batches(texts, batch_size), total=-(-total // batch_size),
                             desc=f"tokenize {label}", unit="batch", leave=False, disable=not label):
        encoding = tokenizer(*batch, truncation="longest_first" if len(batch) == 2 else True,
                             max_length=max_length, return_attention_mask=False,
                             return_token_type_ids=True)
        out["input_ids"].extend(encoding["input_ids"])
        out["token_type_ids"].extend(encoding["token_type_ids"])
    return out


def _token_counts(tokenizer, texts: list[str], batch_size: int) -> np.ndarray:
    """Tokens per text without special tokens or truncation."""
    counts: list[int] = []
    for (batch,) in _batches([texts], batch_size):
        encoding = tokenizer(batch, add_special_tokens=False, return_attention_mask=False,
                             return_token_type_ids=False, verbose=False)
        counts.extend(len(ids) for ids in encoding["input_ids"])
    return np.asarray(counts, dtype=np.int64)


def _batches(columns: Sequence[list[str]], batch_size: int) -> Iterator[list[list[str]]]:
    for start in range(0, len(columns[0]), batch_size):
        yield [column[start:start + batch_size] for column in columns]
