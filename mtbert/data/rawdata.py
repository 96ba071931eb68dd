"""Read and validate the CS224N tab-separated files.

A malformed file (not UTF-8, unparseable, missing a column) raises RawDataError naming the file and
what was expected. A malformed row is never dropped in silence: it goes to the rejects table with its
row number, id and reason.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from pathlib import Path

import numpy as np
import pandas as pd

from mtbert.data.tasks import Task
from mtbert.inputs import has_visible_text
from mtbert.runtime import UserError

# Checked in this order; a row is rejected for the first reason that applies.
REJECT_REASONS = ("missing_id", "duplicate_id", "empty_text", "missing_label", "label_not_a_number",
                  "label_out_of_range")
REJECT_COLUMNS = ["task", "split", "row", "id", "reason", "detail"]

# SST is PTB-tokenized; these escapes read as noise to a WordPiece vocabulary.
PTB_ESCAPES = {"-LRB-": "(", "-RRB-": ")", "-LSB-": "[", "-RSB-": "]", "-LCB-": "{", "-RCB-": "}",
               "``": '"', "''": '"', "\\/": "/", "\\*": "*"}


class RawDataError(UserError, ValueError):
    """A raw file cannot be read as the expected table."""


@dataclasses.dataclass
class ParsedSplit:
    """The rows of one raw file that passed validation, and the ones that did not."""
    task: Task
    split: str
    path: Path
    rows_read: int
    kept: pd.DataFrame  # id, the task's text columns, and `label` for labeled splits
    rejects: pd.DataFrame  # REJECT_COLUMNS


def read_split(path: Path, task: Task, split: str, *, unescape_ptb: bool = False) -> ParsedSplit:
    table = read_table(path, required_columns=expected_columns(task, split),
                       forbidden_columns=() if task.is_labeled(split) else (task.label_column,))
    texts = {column: clean_text(table[column], unescape_ptb) for column in task.text_columns}
    ids = table["id"].str.strip()
    reasons, details = _row_problems(table, ids, texts, task, split)
    bad = reasons != ""
    kept = pd.DataFrame({"id": ids[~bad], **{c: t[~bad] for c, t in texts.items()}})
    if task.is_labeled(split):
        kept["label"] = parse_labels(table[task.label_column][~bad], task)
    rejects = pd.DataFrame({"task": task.name, "split": split, "row": np.flatnonzero(bad) + 1,
                            "id": ids[bad], "reason": reasons[bad], "detail": details[bad]},
                           columns=REJECT_COLUMNS)
    return ParsedSplit(task, split, path, len(table), kept.reset_index(drop=True),
                       rejects.reset_index(drop=True))


def expected_columns(task: Task, split: str) -> list[str]:
    label = [task.label_column] if task.is_labeled(split) else []
    return ["id", *task.text_columns, *label]


def read_table(path: Path, *, required_columns: list[str], forbidden_columns=()) -> pd.DataFrame:
    """Read a tab-separated file with CSV quoting, every cell as a string, columns checked by name.

    A row with fewer cells than the header is padded with empty cells (validation then rejects it);
    a row with more cells is an error, since there is no telling which cell is which, and so is a file of a
    header alone.
    """
    reader = csv.reader(io.StringIO(_decode_utf8(path)), delimiter="\t", quoting=csv.QUOTE_MINIMAL,
                        strict=True)
    try:
        header = [name.strip() for name in next(reader)]
    except StopIteration:
        raise RawDataError(f"{path}: the file is empty; expected a header with columns "
                           f"{', '.join(required_columns)}") from None
    _check_header(path, header, required_columns, forbidden_columns)
    rows = []
    try:
        for row in reader:
            if len(row) > len(header):
                raise RawDataError(f"{path}: line {reader.line_num} has {len(row)} cells, the header "
                                   f"has {len(header)}; expected tab-separated cells, quoted if they "
                                   "contain tabs or quotes")
            rows.append(row + [""] * (len(header) - len(row)))
    except csv.Error as error:
        raise RawDataError(f"{path}: not a valid tab-separated file at line {reader.line_num}: "
                           f"{error}") from None
    if not rows:  # an empty split trains or scores nothing: never a result
        raise RawDataError(f"{path}: no rows after the header; expected one row per example with "
                           f"{', '.join(required_columns)}")
    return pd.DataFrame(rows, columns=header, dtype=str)


def _check_header(path: Path, header: list[str], required: list[str], forbidden) -> None:
    missing = [column for column in required if column not in header]
    if missing:
        raise RawDataError(f"{path}: missing column(s) {', '.join(map(repr, missing))}; expected a header "
                           f"with {', '.join(required)}; found {', '.join(header)}")
    present = [column for column in forbidden if column in header]
    if present:
        raise RawDataError(f"{path}: a test split must be unlabeled, but it has column(s) "
                           f"{', '.join(map(repr, present))}")


def clean_text(column: pd.Series, unescape_ptb: bool) -> pd.Series:
    text = column.str.strip()
    if unescape_ptb:
        for escape, plain in PTB_ESCAPES.items():
            text = text.str.replace(escape, plain, regex=False)
    return text


def parse_labels(column: pd.Series, task: Task) -> pd.Series:
    """Labels of rows that passed validation: int64 class ids, or float64 scores."""
    return task.kind.parse_labels(pd.to_numeric(column.str.strip()))


def _row_problems(table: pd.DataFrame, ids: pd.Series, texts: dict[str, pd.Series], task: Task,
                  split: str) -> tuple[pd.Series, pd.Series]:
    """For every row, the first reason to reject it ('' if none) and a detail for the reader."""
    reasons = pd.Series("", index=table.index, dtype=object)
    details = pd.Series("", index=table.index, dtype=object)

    def flag(mask: pd.Series, reason: str, detail: pd.Series | str) -> None:
        mask = mask & (reasons == "")
        reasons[mask] = reason
        details[mask] = detail[mask] if isinstance(detail, pd.Series) else detail

    flag(ids == "", "missing_id", "the id column is empty")
    first_row = pd.Series(np.arange(1, len(ids) + 1), index=ids.index).groupby(ids).transform("first")
    flag(ids.duplicated(keep="first") & (ids != ""), "duplicate_id",
         "id already used at row " + first_row.astype(str))
    for column, text in texts.items():
        flag(~text.map(has_visible_text), "empty_text", f"column {column!r} is empty or invisible")
    if task.is_labeled(split):
        _flag_label_problems(table[task.label_column].str.strip(), task, flag)
    return reasons, details


def _flag_label_problems(raw: pd.Series, task: Task, flag) -> None:
    values = pd.to_numeric(raw, errors="coerce")
    flag(raw == "", "missing_label", f"column {task.label_column!r} is empty")
    flag(values.isna() | ~np.isfinite(values), "label_not_a_number", "label " + raw.map(repr))
    low, high, integer = task.kind.label_domain()
    in_range = (values >= low) & (values <= high)
    if integer:
        in_range &= values == np.round(values)
    flag(~in_range, "label_out_of_range", "label " + raw.map(repr) + f", expected {task.kind.describe_domain()}")


def _decode_utf8(path: Path) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RawDataError(f"{path}: file not found; run `dvc pull data/raw.dvc`, or put your own "
                           "CS224N files in data/raw/ and run `dvc add data/raw`") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise RawDataError(f"{path}: not valid UTF-8 at line {line} (byte offset {error.start}: "
                           f"{error.reason}); save the file as UTF-8") from None
