"""The readers of what users hand in, fuzzed with Hypothesis: raw task files, params.yaml, `mtbert predict
--input` and an export's folder. Each generated input either works, or is refused with one line naming the
file, row or key; nothing bad is accepted silently. Examples are drawn deterministically (derandomize), so a
failure repeats; `HYPOTHESIS_PROFILE=deep` draws many more."""

from __future__ import annotations

import copy
import csv
import gc
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mtbert.data.rawdata import REJECT_REASONS, RawDataError, read_split
from mtbert.data.tasks import tasks_from_params
from mtbert.inputs import has_visible_text
from mtbert.params import ParamsError
from mtbert.params_file import parse_params
from mtbert.runtime import UserError
from tests.conftest import REPO_ROOT

settings.register_profile("bounded", derandomize=True, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("deep", parent=settings.get_profile("bounded"), derandomize=False)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "bounded")
settings.load_profile(PROFILE)


def examples(bounded: int) -> int:
    """A test's examples: `bounded` in `make test`, ten times as many, new ones each run, in the deep run."""
    return bounded * (10 if PROFILE == "deep" else 1)

PARAMS = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
TASKS = tasks_from_params(parse_params(PARAMS).tasks)


def one_line(error: Exception, *names: str) -> None:
    """A refusal as users get it: one line, naming what it is about."""
    message = str(error)
    assert message and "\n" not in message, message
    assert any(name in message for name in names), (message, names)


# --- raw task files (`tokenize`) ------------------------------------------------------------------------------
CELL = st.one_of(
    st.sampled_from(["A film.", "q1", "q2", "x9", "0", "1", "4"]),  # cells that are fine in most columns
    st.lists(st.sampled_from(list("ab \t\"'\n\r\\") + ["\u200b", "\u00a0", "\ufeff", "é", "-LRB-"]),
             max_size=12).map("".join),
    st.sampled_from(["", " ", "0", "1", "4", "5", "5.0", "-1", "2.5", "7", "nan", "inf", "1e309", "x", "3 "]),
    st.text(max_size=6))


# a text that shows (letters, digits, punctuation, inner spaces and non-ASCII letters), with no tab or newline
VISIBLE_TEXT = st.text(st.characters(categories=("L", "N", "P", "S", "Zs"), exclude_characters="\t\n\r"),
                       min_size=1, max_size=20).filter(lambda text: has_visible_text(text.strip()))


def good_label(task):
    low, high, integer = task.kind.label_domain()
    if integer:
        return st.integers(int(low), int(high)).map(str)
    return st.floats(low, high, allow_nan=False).map(lambda value: f"{value:.3g}")


@st.composite
def good_rows(draw, task, header: list[str]) -> list[list[str]]:
    """Rows every reader must keep: unique ids, texts that show, labels in the task's domain."""
    count = draw(st.integers(1, 8))
    cells = {"id": [f"row-{i}" for i in range(count)], task.label_column: [draw(good_label(task))
                                                                       for _ in range(count)]}
    for column in task.text_columns:
        cells[column] = [draw(VISIBLE_TEXT) for _ in range(count)]
    return [[cells[column][i] for column in header] for i in range(count)]


@st.composite
def raw_files(draw):
    """A task's split as a user might leave it: the expected header (perhaps reordered, a column missing or
    extra), rows of awkward cells (quotes, tabs, newlines, invisible characters, any label), written with or
    without quoting, now and then with bytes that are not UTF-8. One in three is well formed instead (any
    column order, quoted, any visible text): then every row must be kept, so a reader that refused good
    rows fails too. Returns the task, the split, the bytes and, for a well-formed file, its ids."""
    task = TASKS[draw(st.sampled_from(sorted(TASKS)))]
    split = draw(st.sampled_from(["train", "dev", "test"]))
    header = ["id", *task.text_columns, *([task.label_column] if split != "test" else [])]
    header = draw(st.permutations(header))
    if draw(st.integers(0, 2)) == 0:
        rows = draw(good_rows(task, header))
        buffer = io.StringIO()
        csv.writer(buffer, delimiter="\t", lineterminator="\n").writerows([header, *rows])
        return task, split, buffer.getvalue().encode("utf-8"), [row[header.index("id")] for row in rows]
    change = draw(st.sampled_from(["none", "none", "none", "drop", "extra", "label_in_test"]))
    if change == "drop":
        header = header[1:]
    elif change == "extra":
        header = [*header, "extra"]
    elif change == "label_in_test" and split == "test":
        header = [*header, task.label_column]
    rows = draw(st.lists(st.lists(CELL, min_size=len(header) - 1, max_size=len(header) + 1), max_size=8))
    buffer = io.StringIO()
    if draw(st.booleans()):
        csv.writer(buffer, delimiter="\t", lineterminator="\n").writerows([header, *rows])
    else:  # unquoted: a tab or a newline inside a cell breaks the row
        buffer.write("\n".join("\t".join(row) for row in [header, *rows]) + "\n")
    data = buffer.getvalue().encode("utf-8")
    if draw(st.integers(0, 9)) == 0:
        cut = draw(st.integers(0, len(data)))
        data = data[:cut] + b"\xff" + data[cut:]
    return task, split, data, None


@given(raw=raw_files())
@settings(max_examples=examples(150))
def test_a_raw_file_is_read_whole_or_refused_in_one_line(tmp_path, raw):
    task, split, data, good_ids = raw
    path = tmp_path / f"{task.name}-{split}.csv"
    path.write_bytes(data)
    try:
        parsed = read_split(path, task, split)
    except RawDataError as error:
        assert good_ids is None, f"a well-formed file was refused: {error}"
        one_line(error, str(path))
        event("refused in one line")
        return
    if good_ids is not None:
        assert list(parsed.kept["id"]) == good_ids and not len(parsed.rejects), parsed.rejects
    event("read, with rejected rows" if len(parsed.rejects) else "read, every row kept")
    assert len(parsed.kept) + len(parsed.rejects) == parsed.rows_read  # no row lost
    assert set(parsed.rejects["reason"]) <= set(REJECT_REASONS)
    assert (parsed.kept["id"] != "").all() and parsed.kept["id"].is_unique
    for column in task.text_columns:
        assert parsed.kept[column].map(has_visible_text).all()
    if task.is_labeled(split) and len(parsed.kept):
        low, high, integer = task.kind.label_domain()
        labels = parsed.kept["label"].to_numpy(dtype=float)
        assert np.isfinite(labels).all() and (labels >= low).all() and (labels <= high).all()
        assert not integer or (labels == np.round(labels)).all()


# --- params.yaml ----------------------------------------------------------------------------------------------
def leaf_keys(tree, prefix=()) -> list[tuple]:
    if isinstance(tree, dict) and tree:
        return [key for name, value in tree.items() for key in leaf_keys(value, (*prefix, name))]
    return [prefix]


KEYS = [key for key in leaf_keys(PARAMS) if key]
VALUE = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                  st.text(max_size=8), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3),
                                                                                            st.integers(), max_size=2))


@st.composite
def changed_params(draw):
    """params.yaml with one key changed: a leaf given another value (any type), a key removed, or a key added."""
    raw = copy.deepcopy(PARAMS)
    key = draw(st.sampled_from(KEYS))
    *parents, leaf = key
    holder = raw
    for name in parents:
        holder = holder[name]
    change = draw(st.sampled_from(["value", "value", "value", "remove", "add"]))
    if change == "value":
        holder[leaf] = draw(VALUE)
    elif change == "remove":
        del holder[leaf]
    else:
        holder[f"{leaf}_typo"] = draw(VALUE)
    return raw, key, change


@given(changed=changed_params())
@settings(max_examples=examples(200))
def test_params_with_a_key_changed_validate_or_are_refused_naming_it(changed):
    raw, key, change = changed
    try:
        params = parse_params(raw, source="params.yaml")
    except ParamsError as error:
        message = str(error)
        one_line(error, "params.yaml")
        # named by its section at least (a cross-field rule names the section it checks)
        assert str(key[0]) in message or any(str(name) in message for name in key), (message, key)
        event("refused in one line")
        return
    event(f"accepted ({change})")
    assert change != "add", key  # an unknown key is always refused (a removed one may have a default)
    assert params is not None


# --- `mtbert predict --input` ---------------------------------------------------------------------------------
GOOD_TEXT = st.sampled_from(["A fine film.", "Dull and long.", "ok", "Witty, warm; \u00e9l\u00e9gant."])
INPUT_CELL = st.one_of(GOOD_TEXT, GOOD_TEXT,
                       st.lists(st.sampled_from(list("ab \t\"\n{}[]:,") + ["\u200b", "\ud800"]), max_size=10)
                       .map("".join), st.sampled_from(["", " ", "null"]))


@st.composite
def good_input_file(draw) -> tuple[bytes, list[str]]:
    """An --input file every row of which must be predicted: TSV or JSON lines of texts that show."""
    texts = draw(st.lists(VISIBLE_TEXT.map(str.strip).filter(lambda text: '"' not in text), min_size=1, max_size=5))
    if draw(st.booleans()):
        text = "\n".join(["sentence", *texts]) + "\n"
    else:
        text = "\n".join(json.dumps({"sentence": sentence}) for sentence in texts)
    return text.encode("utf-8"), texts


@st.composite
def input_files(draw):
    """An --input file: TSV (a header, rows of cells) or JSON lines (objects, maybe with missing, null or
    non-string values), sometimes not UTF-8. One in three is well formed instead: its texts come back too."""
    if draw(st.integers(0, 2)) == 0:
        return draw(good_input_file())
    if draw(st.booleans()):
        header = draw(st.sampled_from([["sentence"], ["id", "sentence"], ["text"], ["sentence", "extra"]]))
        rows = draw(st.lists(st.lists(INPUT_CELL, min_size=len(header) - 1, max_size=len(header) + 1), max_size=5))
        text = "\n".join("\t".join(row) for row in [header, *rows]) + "\n"
    else:
        value = st.one_of(INPUT_CELL, st.none(), st.integers(), st.lists(st.text(max_size=2), max_size=2))
        lines = draw(st.lists(st.one_of(
            st.fixed_dictionaries({"sentence": value}, optional={"id": value}).map(json.dumps),
            st.sampled_from(["", "{", "[]", '{"other": "x"}', "not json"])), max_size=5))
        text = "\n".join(lines)
    data = text.encode("utf-8", "surrogatepass")
    if draw(st.integers(0, 9)) == 0:
        data = b"\xfe" + data
    return data, None


@pytest.fixture(scope="module")
def export_predictor(deployed):
    from mtbert.predictors import load_predictor

    return load_predictor(model=deployed.exports / "bi", ensemble=None, models_dir=Path("models"), engine="onnx",
                          threads=1)


@pytest.mark.slow(reason="the small export's predictor on every example")
@given(file=input_files(), skip=st.booleans())
@settings(max_examples=examples(120))
def test_a_predict_input_file_is_predicted_or_refused_in_one_line(tmp_path, monkeypatch, export_predictor, file,
                                                                  skip):
    from typer.testing import CliRunner

    from mtbert import cli, predictors

    data, good_texts = file
    monkeypatch.setattr(predictors, "load_predictor", lambda **options: export_predictor)  # loaded once
    path = tmp_path / "input.tsv"
    path.write_bytes(data)
    result = CliRunner().invoke(cli.app, ["predict", "--model", "unused", "--task", "sst", "--input", str(path),
                                          *(["--skip-bad-rows"] if skip else [])])
    if good_texts is not None:  # well formed: every row predicted, in order
        assert result.exit_code == 0 and result.exception is None, (result.output, result.exception)
        assert [json.loads(line)["sentence"] for line in result.stdout.splitlines()] == good_texts
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        assert isinstance(result.exception, UserError), repr(result.exception)
        one_line(result.exception, str(path))
        event("refused in one line")
        return
    event("predicted" + (", bad rows skipped and listed" if skip and result.stderr else ""))
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert all(isinstance(line["sst"], dict) and has_visible_text(line["sentence"]) for line in lines)
    if skip:  # every row predicted or reported skipped, in one line each naming the file and row
        skipped = [line for line in result.stderr.splitlines() if line.startswith(f"{path} row ")]
        assert lines or skipped


# --- an export's folder ---------------------------------------------------------------------------------------
def refusal(folder: Path, engine: str) -> str | None:
    """The one-line refusal of loading the export and predicting every task with `engine`, or None if it
    worked. The predictor is gone on return: its graphs' memory is not Python's, so none may pile up."""
    from mtbert.predictors import load_predictor

    try:
        predictor = load_predictor(model=folder, ensemble=None, models_dir=Path("models"), engine=engine, threads=1)
        predictor.warm()
        for task, spec in predictor.tasks.items():
            predictor.predict(task, [tuple("A fine film." for _ in spec.text_columns)])
    except UserError as error:
        return str(error)
    finally:
        gc.collect()  # a refused load's half-built sessions sit in reference cycles
    return None


@pytest.mark.slow(reason="loads the small export on every example")
@given(choice=st.data())
@settings(max_examples=examples(25))
def test_an_export_with_a_file_missing_cut_or_altered_is_refused_naming_it(deployed, choice):
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "bi"
        shutil.copytree(deployed.exports / "bi", folder, copy_function=os.link)  # links: the graphs are large
        listed = json.loads((folder / "manifest.json").read_text())["files"]
        name = choice.draw(st.sampled_from(sorted([*listed, "manifest.json"])))
        # an int8 graph is read by the int8 engine only; the manifest and the tokenizer by both
        engine = "int8" if ".int8." in name else "onnx" if name.endswith(".onnx") else \
            choice.draw(st.sampled_from(["onnx", "int8"]))
        path = folder / name
        data = path.read_bytes()
        path.unlink()  # the changed file is a new one: the link's target, the shared export, stays whole
        change = choice.draw(st.sampled_from(["remove", "cut", "flip"]))
        if change == "cut":
            path.write_bytes(data[:choice.draw(st.integers(0, max(len(data) - 1, 0)))])
        elif change == "flip":
            at = choice.draw(st.integers(0, len(data) - 1))
            path.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:])
        del data
        message = refusal(folder, engine)
    assert message is not None, f"{name} ({change}): the {engine} engine loaded the export and predicted"
    assert "\n" not in message and name in message, message
    event("refused in one line")
