"""What both prediction engines (PyTorch's mtbert/inference.py, ONNX Runtime's mtbert/deploy/engine.py) read
besides a model: the texts, checked and cleaned (the ensemble of member predictors is
mtbert/deploy/members.py's).

Imports nothing heavy, so the ONNX engine's command starts fast. A task here is anything with a `name` and
`text_columns` (a data.tasks.Task, or an exported task).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

from mtbert.runtime import UserError

Text = str | Sequence[str]  # one sentence, or a pair


class InputError(UserError, ValueError):
    """A text to predict is empty, a pair lacks a side, or an input file cannot be read."""


def check_texts(task, texts: Sequence[Text], where: str = "input") -> list[tuple[str, ...]]:
    """Each text as a tuple of the task's text columns; an empty text or a missing side is an InputError."""
    if not texts:
        raise InputError(f"{where}: no texts to predict")
    width = len(task.text_columns)
    rows = []
    for index, text in enumerate(texts, start=1):
        row = (text,) if isinstance(text, str) else tuple(text)
        if len(row) != width:
            kind = "a pair of sentences" if width == 2 else "one sentence"
            raise InputError(f"{where} row {index}: task {task.name} reads {kind} "
                             f"({', '.join(task.text_columns)}), got {len(row)} text(s)")
        for column, value in zip(task.text_columns, row, strict=True):
            if not isinstance(value, str):
                raise InputError(f"{where} row {index}: {column} is not text (a JSON {json_type(value)}); "
                                 "expected a string")
            broken = first_surrogate(value)
            if broken is not None:
                raise InputError(f"{where} row {index}: {column} holds a lone surrogate ({broken}), which is not a "
                                 "character; expected valid Unicode text")
            if not has_visible_text(value):
                raise InputError(f"{where} row {index}: {column} is empty or invisible; expected a text with "
                                 "at least one visible character")
        rows.append(row)
    return rows


def first_surrogate(text: str) -> str | None:
    """Where `text` holds half of a UTF-16 pair, which JSON can carry ("\\ud800") and no tokenizer can take,
    e.g. "U+D800 at character 4"; None for valid text."""
    try:
        text.encode("utf-8")  # fails exactly on surrogates, at C speed
    except UnicodeEncodeError as error:
        return f"U+{ord(text[error.start]):04X} at character {error.start + 1}"
    return None


def json_type(value) -> str:
    """The JSON name of a value's type, as a user wrote it in a JSON-lines file."""
    names = {bool: "boolean", int: "number", float: "number", list: "array", tuple: "array", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


# Unicode categories that show nothing: separators (Z*: spaces, line and paragraph separators) and "other"
# (C*: controls, format characters such as U+200B ZERO WIDTH SPACE and U+FEFF, unassigned, private use).
INVISIBLE_CATEGORIES = ("Z", "C")


def has_visible_text(text: str) -> bool:
    """Whether `text`, NFKC-normalised, holds a character that shows: a text of only spaces, zero-width or
    other format characters is empty to a reader, and the tokenizer would see nothing (or [UNK]) in it."""
    return any(not unicodedata.category(char).startswith(INVISIBLE_CATEGORIES)
               for char in unicodedata.normalize("NFKC", text))


def clean(text: str, replacements: Sequence[Sequence[str]]) -> str:
    """One text as `tokenize` cleaned the training text (rawdata.clean_text): whitespace stripped, then each
    (escape, plain) replacement in order."""
    text = text.strip()
    for escape, plain in replacements:
        text = text.replace(escape, plain)
    return text
