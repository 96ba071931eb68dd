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
import pyarrow as pa
import pytest
import torch
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mtbert.data.rawdata import REJECT_REASONS, RawDataError, read_split
from mtbert.data.tasks import tasks_from_params
from mtbert.inputs import has_visible_text
from mtbert.params import Params, ParamsError
from mtbert.params_file import load_params, parse_params, read_yaml
from mtbert.per_task import PER_TASK_KNOBS
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
# The committed params.yaml as the pipeline reads it (YAML 1.2), and the JSON Schema of its sections
# (mtbert/params.py, strict: no "128" for an integer), from which each key's bad values are drawn.
RAW_PARAMS = read_yaml(REPO_ROOT / "params.yaml")
SCHEMA = Params.model_json_schema(by_alias=True)
JSON_TYPES = {"integer": 7, "number": 0.5, "string": "word", "boolean": True, "array": [1], "object": {"k": 1},
              "null": None}


def leaf_keys(tree, prefix=()) -> list[tuple]:
    if isinstance(tree, dict) and tree:
        return [key for name, value in tree.items() for key in leaf_keys(value, (*prefix, name))]
    return [prefix]


def resolved(node: dict) -> dict:
    while "$ref" in node:
        node = SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return node


def schema_of(key: tuple) -> dict | None:
    """The JSON Schema of the value at `key` (a per-task mapping's entry through its additionalProperties)."""
    node = SCHEMA
    for name in key:
        options = [resolved(option) for option in resolved(node).get("anyOf", [resolved(node)])]
        inner = [option["properties"][name] if name in option.get("properties", {}) else
                 option.get("additionalProperties") for option in options]
        inner = [option for option in inner if isinstance(option, dict)]
        if not inner:
            return None
        node = inner[0]
    node = resolved(node)
    if key[-1] in PER_TASK_KNOBS.get(key[0], ()):  # one value for every task, or {task: value} (every_task)
        return {"anyOf": [node, resolved(node["additionalProperties"])]}
    return node


def alternatives(schema: dict) -> list[dict]:
    return [resolved(option) for option in schema.get("anyOf", [schema])]


def accepts_type(option: dict, value) -> bool:
    kinds = {type(value)} if value is not None else {type(None)}
    allowed = {"integer": {int}, "number": {int, float}, "string": {str}, "boolean": {bool}, "array": {list},
               "object": {dict}, "null": {type(None)}}[option["type"]] if "type" in option else None
    return allowed is None or bool(kinds & allowed)


def bad_values(schema: dict) -> list[tuple[str, object]]:
    """(what is wrong, a value) that every alternative of `schema` refuses: a wrong type, a value out of
    bounds, an unknown choice, an empty string (every string of params.yaml has one character at least)."""
    options = alternatives(schema)
    if any("type" not in option and "enum" not in option for option in options):
        return []  # a value checked by a validator of its own (bf16): the schema cannot say what it refuses
    found = [("wrong type", value) for value in JSON_TYPES.values()
             if not any(accepts_type(option, value) for option in options)]
    for option in options:
        candidates = []
        if option.get("type") in ("integer", "number"):
            step = 1 if option["type"] == "integer" else 0.5
            candidates += [option["minimum"] - step] if "minimum" in option else []
            candidates += [option["exclusiveMinimum"]] if "exclusiveMinimum" in option else []
            candidates += [option["maximum"] + step] if "maximum" in option else []
            candidates += [option["exclusiveMaximum"]] if "exclusiveMaximum" in option else []
            found += [("out of bounds", value) for value in candidates if refused_by_all(options, value)]
        if option.get("type") == "string" and refused_by_all(options, ""):
            found.append(("empty string", ""))
        if "enum" in option and refused_by_all(options, "not-a-choice"):
            found.append(("unknown choice", "not-a-choice"))
    return found


def refused_by_all(options: list[dict], value) -> bool:
    def accepted(option: dict) -> bool:
        if not accepts_type(option, value) or ("enum" in option and value not in option["enum"]):
            return False
        if isinstance(value, str):
            return bool(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return (value >= option.get("minimum", value) and value > option.get("exclusiveMinimum", value - 1)
                    and value <= option.get("maximum", value) and value < option.get("exclusiveMaximum", value + 1))
        return True
    return not any(accepted(option) for option in options)


# each key of the committed file (the variants' overrides aside) with a value its schema refuses
BAD_VALUES = [(key, wrong, value) for key in leaf_keys(RAW_PARAMS) if key and key[0] != "models"
              for wrong, value in bad_values(schema_of(key) or {})]


def yaml_text(tree: dict, *, flow: st.DataObject | None = None, duplicate: tuple | None = None, indent: str = "",
              prefix: tuple = ()) -> str:
    """`tree` as YAML text: block mappings, each value in JSON (a subset of YAML 1.2); with `flow`, some
    mappings written inline, some strings single-quoted and some lines commented; with `duplicate`, that key
    written twice in its mapping."""
    lines = []
    for name, value in tree.items():
        key = (*prefix, name)
        if isinstance(value, dict) and value and not (flow and flow.draw(st.booleans(), label="inline")):
            text = f"{indent}{name}:\n" + yaml_text(value, flow=flow, duplicate=duplicate, indent=indent + "  ",
                                                    prefix=key)
            lines.append(text.rstrip("\n"))
        else:
            quoted = isinstance(value, str) and "'" not in value and flow and flow.draw(st.booleans(), label="quote")
            written = f"'{value}'" if quoted else json.dumps(value)
            comment = "  # a comment" if flow and flow.draw(st.booleans(), label="comment") else ""
            lines.append(f"{indent}{name}: {written}{comment}")
            lines += [f"{indent}{name}: {written}  # again"] if key == duplicate else []
    return "\n".join(lines) + "\n"


def with_value(tree: dict, key: tuple, value) -> dict:
    changed = copy.deepcopy(tree)
    holder = changed
    for name in key[:-1]:
        holder = holder[name]
    holder[key[-1]] = value
    return changed


def params_refusal(text: str) -> str:
    """The one-line refusal of `text` as a params.yaml file."""
    path = Path(tempfile.mkdtemp()) / "params.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_params(path)
    except ParamsError as error:
        message = str(error)
        assert "\n" not in message and message.startswith(f"{path}: "), message
        return message
    finally:
        shutil.rmtree(path.parent)
    raise AssertionError(f"accepted:\n{text}")


@given(bad=st.sampled_from(BAD_VALUES))
@settings(max_examples=examples(150))
def test_params_yaml_with_a_bad_value_is_refused_in_one_line_naming_its_key(bad):
    key, wrong, value = bad
    message = params_refusal(yaml_text(with_value(RAW_PARAMS, key, value)))
    assert ".".join(key) in message, (wrong, value, message)
    event(wrong)


@given(key=st.sampled_from([key for key in leaf_keys(RAW_PARAMS) if key]))
@settings(max_examples=examples(40))
def test_params_yaml_with_a_key_written_twice_is_refused_naming_it_and_its_line(key):
    text = yaml_text(RAW_PARAMS, duplicate=key)
    line = next(number for number, line in enumerate(text.splitlines(), start=1) if line.endswith("# again"))
    message = params_refusal(text)
    assert f'duplicate key "{key[-1]}"' in message and f"line {line}," in message, (key, message)


@given(style=st.data())
@settings(max_examples=examples(40))
def test_params_yaml_however_written_is_read_as_written(style):
    """The committed values, each mapping in block or flow style, strings quoted either way, comments: the
    same parameters as the committed file's."""
    path = Path(tempfile.mkdtemp()) / "params.yaml"
    try:
        path.write_text(yaml_text(RAW_PARAMS, flow=style), encoding="utf-8")
        assert load_params(path) == parse_params(RAW_PARAMS, source="params.yaml")
    finally:
        shutil.rmtree(path.parent)


# --- `mtbert predict --input` ---------------------------------------------------------------------------------
GOOD_TEXT = st.sampled_from(["A fine film.", "Dull and long.", "ok", "Witty, warm; \u00e9l\u00e9gant."])
INPUT_CELL = st.one_of(GOOD_TEXT, GOOD_TEXT,
                       st.lists(st.sampled_from(list("ab \t\"\n{}[]:,") + ["\u200b", "\ud800"]), max_size=10)
                       .map("".join), st.sampled_from(["", " ", "null"]))


@st.composite
def good_input_file(draw) -> tuple[bytes, list[str], int]:
    """An --input file every row of which must be predicted: TSV or JSON lines of texts that show."""
    texts = draw(st.lists(VISIBLE_TEXT.map(str.strip).filter(lambda text: '"' not in text), min_size=1, max_size=5))
    if draw(st.booleans()):
        text = "\n".join(["sentence", *texts]) + "\n"
    else:
        text = "\n".join(json.dumps({"sentence": sentence}) for sentence in texts)
    return text.encode("utf-8"), texts, len(texts)


@st.composite
def mixed_input_file(draw) -> tuple[bytes, None, int]:
    """An --input file of good rows and rows no task can read (a text of spaces or zero-width characters, a
    missing or non-text sentence), one of each at least: with --skip-bad-rows, each bad one must be skipped
    and named."""
    invisible = st.sampled_from([" ", "\u200b", "\u00a0 "])
    tsv = draw(st.booleans())
    bad = invisible if tsv else st.one_of(invisible.map(lambda text: {"sentence": text}), st.just({"other": "x"}),
                                          st.just({"sentence": 3}))
    good = GOOD_TEXT if tsv else GOOD_TEXT.map(lambda text: {"sentence": text})
    rows = draw(st.permutations(draw(st.lists(good, min_size=1, max_size=3)) +
                                draw(st.lists(bad, min_size=1, max_size=3))))
    text = "\n".join(["sentence", *rows]) + "\n" if tsv else "\n".join(map(json.dumps, rows))
    return text.encode("utf-8"), None, len(rows)


@st.composite
def input_files(draw):
    """An --input file: TSV (a header, rows of cells) or JSON lines (objects, maybe with missing, null or
    non-string values), sometimes not UTF-8. One in three is well formed instead (its texts come back too),
    one in three a mix of good and bad rows.
    With it, how many rows it holds, where that can be told without a CSV reader (no quote or line break
    in a cell; an empty line is no row), else None."""
    kind = draw(st.integers(0, 2))
    if kind < 2:
        return draw(good_input_file() if kind == 0 else mixed_input_file())
    if draw(st.booleans()):
        header = draw(st.sampled_from([["sentence"], ["id", "sentence"], ["text"], ["sentence", "extra"]]))
        rows = draw(st.lists(st.lists(INPUT_CELL, min_size=len(header) - 1, max_size=len(header) + 1), max_size=5))
        text = "\n".join("\t".join(row) for row in [header, *rows]) + "\n"
        plain = not any(mark in cell for row in rows for cell in row for mark in '"\n\r')
        count = sum(1 for row in rows if "\t".join(row)) if plain else None
    else:
        value = st.one_of(INPUT_CELL, st.none(), st.integers(), st.lists(st.text(max_size=2), max_size=2))
        lines = draw(st.lists(st.one_of(
            st.fixed_dictionaries({"sentence": value}, optional={"id": value}).map(json.dumps),
            st.sampled_from(["", "{", "[]", '{"other": "x"}', "not json"])), max_size=5))
        text = "\n".join(lines)
        count = sum(1 for line in lines if line.strip())
    data = text.encode("utf-8", "surrogatepass")
    if draw(st.integers(0, 9)) == 0:
        data = b"\xfe" + data
    return data, None, count


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

    data, good_texts, count = file
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
    if not skip:  # every row predicted, or none (refused above)
        assert count is None or len(lines) == count, (len(lines), count, data)
    if skip:  # rows in = rows predicted + rows skipped, each skipped one reported in a line naming its row
        skipped = [int(line.split()[2]) for line in result.stderr.splitlines() if line.startswith(f"{path} row ")]
        summary = [line for line in result.stderr.splitlines() if line.startswith(f"{path}: skipped ")]
        total = len(lines) + len(skipped)
        assert len(set(skipped)) == len(skipped) and all(1 <= row <= total for row in skipped), skipped
        assert summary == ([f"{path}: skipped {len(skipped)} of {total} rows"] if skipped else []), summary
        assert count is None or total == count, (total, count, data)
        event("rows counted" if count is not None else "rows not countable without a CSV reader")


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


# --- what the stages hand each other (Parquet, checkpoints, model folders), cut or altered ------------------
@st.composite
def damaged(draw, data: bytes, focus: range | None = None) -> tuple[str, bytes]:
    """`data` cut short (anywhere, to nothing at all) or with one bit flipped (anywhere, or half the time in
    `focus`: a small part that a reader trusts, such as a Parquet file's footer)."""
    if draw(st.booleans()):
        at = draw(st.integers(0, len(data) - 1))
        return f"cut at byte {at}", data[:at]
    where = focus if focus is not None and draw(st.booleans()) else range(len(data))
    at, bit = draw(st.sampled_from(where)), draw(st.integers(0, 7))
    return f"bit {bit} of byte {at} flipped", data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1:]


SPLIT_TABLE = pa.table({"id": [f"row{i}" for i in range(12)], "label": np.arange(12, dtype=np.float64),
                        "input_ids": pa.array([list(range(i, i + 4)) for i in range(12)], pa.list_(pa.int32()))},
                       metadata={b"pad_id": b"0"})


@given(choice=st.data())
@settings(max_examples=examples(400))
def test_a_parquet_file_cut_or_altered_is_refused_in_one_line_or_read_as_written(choice):
    from mtbert import io as mtbert_io

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "sst-dev.parquet"
        mtbert_io.write_parquet(path, SPLIT_TABLE)
        assert_split_table(mtbert_io.read_parquet(path, ("id",), "run the stage again"), "as written")
        written = path.read_bytes()
        footer = int.from_bytes(written[-8:-4], "little")  # the footer's length, before the closing PAR1
        change, data = choice.draw(damaged(written, focus=range(len(written) - 8 - footer, len(written) - 8)))
        path.write_bytes(data)
        try:
            table = mtbert_io.read_parquet(path, ("id", "input_ids"), "run the stage again")
        except UserError as error:
            one_line(error, str(path))
            event("refused in one line")
            return
    event("read, the same")  # a bit no reader looks at (statistics, padding)
    assert_split_table(table, change)


def assert_split_table(table: pa.Table, change: str) -> None:
    assert table.to_pylist() == SPLIT_TABLE.to_pylist() and table.schema.metadata[b"pad_id"] == b"0", change
    assert [value_type(field.type) for field in table.schema] == [value_type(f.type) for f in SPLIT_TABLE.schema]


def value_type(kind: pa.DataType) -> pa.DataType:
    """A column's type, a list's by its items' (Parquet names a list's item field anew)."""
    return pa.list_(kind.value_type) if pa.types.is_list(kind) else kind


def checkpoint_state() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {"fingerprint": "run-1", "progress": json.dumps({"epoch": 1, "step": 7}),
            "model": {"layer.weight": torch.randn(16, 8, generator=generator), "layer.bias": torch.zeros(16)},
            "optimizer": {"state": {0: {"step": torch.tensor(7.0)}}, "param_groups": [{"lr": 1e-4}]}}


def same_state(left, right) -> bool:
    if isinstance(left, torch.Tensor):
        return isinstance(right, torch.Tensor) and left.dtype == right.dtype and torch.equal(left, right)
    if isinstance(left, dict):
        return isinstance(right, dict) and left.keys() == right.keys() and all(
            same_state(value, right[key]) for key, value in left.items())
    if isinstance(left, (list, tuple)):
        return type(left) is type(right) and len(left) == len(right) and all(map(same_state, left, right))
    return left == right


@given(choice=st.data())
@settings(max_examples=examples(100))
def test_a_checkpoint_cut_or_altered_is_set_aside_or_resumed_as_written(choice):
    """A checkpoint that is not whole is set aside with a warning (the run starts over); one read is the one
    written, to every tensor's bit."""
    import dataclasses

    from mtbert.training.checkpoint import LAST, SET_ASIDE, newest_whole, save_checkpoint

    written = checkpoint_state()
    holder = dataclasses.make_dataclass("Checkpoint", list(written))(**written)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        save_checkpoint(folder, holder)
        assert same_state(newest_whole(folder)[1], written)  # whole, it is read as written
        change, data = choice.draw(damaged((folder / LAST).read_bytes()))
        (folder / LAST).write_bytes(data)
        found = newest_whole(folder)
        aside = [path.name for path in folder.iterdir() if SET_ASIDE in path.name]
    if found is None:
        assert len(aside) == 1, (change, aside)
        event("set aside")
        return
    event("read, the same")
    assert same_state(found[1], written), change


@pytest.mark.slow(reason="loads a small model folder on every example")
@given(choice=st.data())
@settings(max_examples=examples(25))
def test_a_model_folder_with_a_file_cut_or_altered_is_refused_naming_it(deployed, choice):
    from mtbert.model.saved import CHECKSUMS_FILE, load_model

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "cross"
        shutil.copytree(deployed.models / "cross", folder, copy_function=os.link)  # links: the weights are large
        listed = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())
        name = choice.draw(st.sampled_from(listed))
        path = folder / name
        data = path.read_bytes()
        path.unlink()  # the changed file is a new one: the link's target, the shared folder, stays whole
        change, changed = choice.draw(damaged(data)) if data else ("removed", None)
        if changed is not None:
            path.write_bytes(changed)
        try:
            load_model(folder)
        except UserError as error:
            message = str(error)
        else:
            message = None
    assert message is not None, f"{name} ({change}): the model loaded"
    assert "\n" not in message and (name in message or CHECKSUMS_FILE in message), message
    event("refused in one line")
