"""Atomic writes: every file appears whole or not at all, so a killed stage leaves nothing half-written.
Checked reads of what stages hand each other (Parquet, JSON): a file cut short, damaged or without what
its reader needs stops the stage with one line naming it, rather than with pyarrow's or json's traceback.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mtbert.runtime import UnreadableInputError

_UMASK = os.umask(0)
os.umask(_UMASK)


def temp_prefix(path: Path) -> str:
    """`.<name>.<pid>.`: a temporary beside `path` names its writer, so that a later write of `path` can
    tell one that a killed writer left (no `finally` runs under SIGKILL) from one still being written."""
    return f".{path.name}.{os.getpid()}."


def remove_abandoned(path: Path) -> None:
    """Delete the temporaries beside `path` whose writer is gone: a killed write's half-copy of a model
    folder would otherwise stay, hidden, for ever."""
    for sibling in path.parent.glob(f".{glob.escape(path.name)}.*"):
        writer = sibling.name[len(path.name) + 2:].split(".", 1)[0]
        if writer.isdigit() and not process_alive(int(writer)):
            if sibling.is_dir():
                shutil.rmtree(sibling, ignore_errors=True)
            else:
                sibling.unlink(missing_ok=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success rename it onto `path`, on failure delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(path)
    handle, temp_name = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
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
    remove_abandoned(path)
    temp = Path(tempfile.mkdtemp(dir=path.parent, prefix=temp_prefix(path)))
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


# The sha256 of a table's content, in its Parquet file's own metadata. Parquet checks its data pages (with
# page checksums on) but not its footer, where a flipped bit can rename a column or change its type.
DIGEST_KEY = b"mtbert.sha256"


def write_parquet(path: Path | str, table: pa.Table) -> None:
    """`table` at `path`, atomically, with page checksums and the digest of its content (read_parquet checks
    both: a file cut or altered anywhere is refused, never read wrongly)."""
    metadata = {**(table.schema.metadata or {}), DIGEST_KEY: content_digest(table).encode()}
    with atomic_path(path) as temp:
        pq.write_table(table.replace_schema_metadata(metadata), temp, write_page_checksum=True)


def content_digest(table: pa.Table) -> str:
    """The sha256 of a table's columns, their types and its metadata (but the digest): the same for the table
    written and the one read back, however Parquet chunks it or names a list's items."""
    fields = [pa.field(field.name, pa.list_(field.type.value_type) if pa.types.is_list(field.type) else field.type,
                       field.nullable) for field in table.schema]
    metadata = {key: value for key, value in (table.schema.metadata or {}).items() if key != DIGEST_KEY}
    canonical = table.cast(pa.schema(fields)).combine_chunks().replace_schema_metadata(metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, canonical.schema) as writer:
        writer.write_table(canonical)
    return hashlib.sha256(sink.getvalue()).hexdigest()


def read_parquet(path: Path | str, columns: tuple[str, ...], remedy: str) -> pa.Table:
    """A Parquet file that write_parquet wrote, with (at least) `columns`; one that is cut short, damaged,
    without its digest or lacks one of them is an UnreadableInputError naming it and ending with `remedy`
    (the caller checks that the file is there)."""
    try:
        table = pq.read_table(path, page_checksum_verification=True)
        recorded = (table.schema.metadata or {}).get(DIGEST_KEY)
        whole = recorded == content_digest(table).encode()
    except (pa.ArrowException, OSError, UnicodeDecodeError) as error:  # the last: a name in a damaged footer
        detail = " ".join(str(error).split()).split(f"'{path}': ", 1)[-1]  # pyarrow repeats the path
        raise UnreadableInputError(f"{path}: not a readable Parquet file ({detail}); {remedy}") from error
    if recorded is None:
        raise UnreadableInputError(f"{path}: holds no {DIGEST_KEY.decode()} digest of its content (written by "
                                   f"another program or an older mtbert, or damaged); {remedy}")
    if not whole:
        raise UnreadableInputError(f"{path}: its content is not what was written (its {DIGEST_KEY.decode()} "
                                   f"digest differs): damaged; {remedy}")
    missing = [name for name in columns if name not in table.column_names]
    if missing:
        raise UnreadableInputError(f"{path}: has no column {missing[0]!r} (expected {', '.join(columns)}; it has "
                                   f"{', '.join(table.column_names)}); {remedy}")
    return table


def read_json(path: Path | str, remedy: str, error_type: type[Exception] = UnreadableInputError) -> Any:
    """A JSON file's content; one that does not parse is an `error_type` (a UserError) naming its line and
    column and ending with `remedy` (the caller checks that the file is there)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise error_type(f"{path}: not UTF-8 text (byte {error.start}); {remedy}") from None
    except json.JSONDecodeError as error:
        raise error_type(f"{path}: not valid JSON at line {error.lineno}, column {error.colno} ({error.msg}); "
                         f"{remedy}") from None
