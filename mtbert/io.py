"""Atomic writes: every file appears whole or not at all, so a killed stage leaves nothing half-written."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success rename it onto `path`, on failure delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    temp = Path(temp_name)
    try:
        yield temp
        os.chmod(temp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: Path | str) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path`; on success swap it in for `path`, on failure delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        yield temp
        os.chmod(temp, 0o777 & ~_UMASK)  # mkdtemp creates 0700
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)
        os.replace(temp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def write_text(path: Path | str, text: str) -> None:
    with atomic_path(path) as temp:
        temp.write_text(text, encoding="utf-8")


def write_json(path: Path | str, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


# Metrics are stored to 4 significant digits: a dev accuracy over ~1,000 rows moves by 0.001 per row, and
# the digits beyond are float noise that would show as changes in `git status` and `dvc metrics diff`.
METRIC_DIGITS = 4


def rounded(data: Any, digits: int = METRIC_DIGITS) -> Any:
    """`data` with every float rounded to `digits` significant digits (ints, strings, bools unchanged)."""
    if isinstance(data, float):
        return float(f"{data:.{digits}g}")
    if isinstance(data, dict):
        return {key: rounded(value, digits) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [rounded(value, digits) for value in data]
    return data


def write_metrics(path: Path | str, data: Any) -> None:
    """A git-tracked metrics file, at a precision that means something (see METRIC_DIGITS)."""
    write_json(path, rounded(data))


def write_parquet(path: Path | str, table: pa.Table) -> None:
    with atomic_path(path) as temp:
        pq.write_table(table, temp)
