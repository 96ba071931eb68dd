"""User errors (bad params, data, model folder, backbone, missing input) end a stage with one line on stderr.

Each test runs the real stage as `python -m stages.<stage>` from the repository root, as dvc does, and
checks that the process exits 1 with exactly one `error: ...` line, the last one, naming what is wrong,
and no traceback; with MTBERT_DEBUG=1 the traceback is shown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtbert.data.rawdata import RawDataError
from mtbert.model.backbone import BackboneError
from mtbert.model.saved import ModelFolderError
from mtbert.params import ParamsError, as_dict
from mtbert.params_file import load_params
from mtbert.runtime import MissingInputError, UserError
from tests.conftest import REPO_ROOT, make_params, write_raw_files


def run_stage(stage: str, *args: str | Path, debug: bool = False) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "MTBERT_DEBUG"}
    if debug:
        env["MTBERT_DEBUG"] = "1"
    return subprocess.run([sys.executable, "-m", f"stages.{stage}", *map(str, args)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The error line, after checking that it is the only one, the last one, and comes without a traceback."""
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert lines[-1] == errors[0], result.stderr
    return errors[0]


def tokenize_args(tmp_path: Path, params_file: Path) -> list:
    return ["--params-file", params_file, "--out-dir", tmp_path / "tok", "--rejects-file", tmp_path / "rejects.tsv",
            "--metrics-file", tmp_path / "data.json"]


def test_every_error_of_the_user_is_a_user_error():
    for error in (ParamsError, RawDataError, ModelFolderError, BackboneError, MissingInputError):
        assert issubclass(error, UserError), error
    assert issubclass(MissingInputError, FileNotFoundError)  # callers that caught the old error still do


@pytest.mark.slow(reason="real stage processes")
def test_a_params_typo_is_one_line_naming_the_key(tmp_path, tiny_backbone, raw_dir):
    params_file = make_params(tmp_path, tiny_backbone, raw_dir, train={"lrr": 1.0e-4})
    result = run_stage("tokenize", *tokenize_args(tmp_path, params_file))
    line = one_line_error(result)
    assert line.startswith(f"error: {params_file}: unknown key 'train.lrr'; train accepts: seed"), line
    assert not (tmp_path / "tok").exists()  # it failed before any work

    debug = run_stage("tokenize", *tokenize_args(tmp_path, params_file), debug=True)
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "ParamsError" in debug.stderr and "train.lrr" in debug.stderr
    assert not any(line.startswith("error:") for line in debug.stderr.splitlines())


@pytest.mark.slow(reason="real stage processes")
def test_a_params_yaml_syntax_error_is_one_line_naming_line_and_column(tmp_path):
    params_file = tmp_path / "params.yaml"
    params_file.write_text("train:\n  lr: 1\n   epochs: 2\n")
    line = one_line_error(run_stage("tokenize", *tokenize_args(tmp_path, params_file)))
    assert line == f"error: {params_file}: not valid YAML at line 3, column 10: mapping values are not allowed here"


@pytest.mark.slow(reason="real stage processes")
def test_a_raw_file_that_is_not_utf8_is_one_line_naming_the_file(tmp_path, tiny_backbone):
    raw = write_raw_files(tmp_path / "raw", {
        "ids-sst-dev.csv": b"\tid\tsentence\tsentiment\n0\tsd1\tfine\t1\n1\tsd2\tcaf\xe9\t2\n"})
    params_file = make_params(tmp_path, tiny_backbone, raw)
    line = one_line_error(run_stage("tokenize", *tokenize_args(tmp_path, params_file)))
    assert line.startswith(f"error: {raw / 'ids-sst-dev.csv'}: not valid UTF-8 at line 3"), line


@pytest.mark.slow(reason="real stage processes")
def test_a_missing_backbone_is_one_line_naming_it(tmp_path, raw_dir):
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    params_file = make_params(tmp_path, not_a_model, raw_dir)
    line = one_line_error(run_stage("tokenize", *tokenize_args(tmp_path, params_file)))
    assert line.startswith(f"error: model.name {str(not_a_model)!r} is a directory without config.json"), line


def predict_args(tmp_path: Path, params_file: Path, models_dir: Path) -> list:
    return ["--variant", "base", "--params-file", params_file, "--models-dir", models_dir,
            "--tokenized-dir", tmp_path / "tok", "--rejects-file", tmp_path / "rejects.tsv",
            "--predictions-dir", tmp_path / "predictions",
            "--metrics-dir", tmp_path / "metrics"]


def foreign_model(models_dir: Path, config_text: str) -> Path:
    """A folder with every file `train` writes, whose mtbert.json holds `config_text` (never read past it)."""
    folder = models_dir / "base"
    (folder / "encoder").mkdir(parents=True)
    (folder / "encoder" / "config.json").write_text("{}")
    (folder / "heads.safetensors").write_bytes(b"")
    (folder / "mtbert.json").write_text(config_text)
    return folder


@pytest.mark.slow(reason="real stage processes")
def test_an_empty_model_folder_is_one_line_naming_the_path(tmp_path, tiny_backbone, raw_dir):
    params_file = make_params(tmp_path, tiny_backbone, raw_dir)
    (tmp_path / "models" / "base").mkdir(parents=True)
    line = one_line_error(run_stage("predict", *predict_args(tmp_path, params_file, tmp_path / "models")))
    assert line.startswith(f"error: {tmp_path / 'models' / 'base' / 'mtbert.json'} is missing; expected a model "
                           "folder written by `train`"), line
    assert not (tmp_path / "predictions").exists()


HEADS = as_dict(load_params(REPO_ROOT / "params.yaml").heads)  # in full, as a model folder holds them


@pytest.mark.parametrize(("config_text", "says"), [
    (json.dumps({"variant": "base", "params": {"heads": HEADS}}),  # an older mtbert's: no tasks
     "declares no tasks (a model folder from an older mtbert, before tasks were params? retrain it)"),
    ("{not json", "not an mtbert model config (expected JSON with a 'params' section, as `train` writes)"),
])
@pytest.mark.slow(reason="real stage processes")
def test_a_foreign_model_folder_is_one_line_naming_the_path(tmp_path, tiny_backbone, raw_dir, config_text, says):
    params_file = make_params(tmp_path, tiny_backbone, raw_dir)
    folder = foreign_model(tmp_path / "models", config_text)
    line = one_line_error(run_stage("predict", *predict_args(tmp_path, params_file, tmp_path / "models")))
    assert line.startswith(f"error: {folder / 'mtbert.json'}: "), line
    assert line.endswith(says), line
    assert not (tmp_path / "predictions").exists()


@pytest.mark.slow(reason="real stage processes")
def test_a_missing_stage_input_is_one_line_naming_the_file(tmp_path, tiny_backbone, raw_dir):
    params_file = make_params(tmp_path, tiny_backbone, raw_dir)
    (tmp_path / "tok").mkdir()
    line = one_line_error(run_stage("ensemble", "--params-file", params_file, "--tokenized-dir", tmp_path / "tok",
                                    "--predictions-dir", tmp_path / "predictions", "--out-dir", tmp_path / "ens",
                                    "--plots-dir", tmp_path / "plots", "--metrics-file", tmp_path / "ens.json",
                                    "--rejects-file", tmp_path / "rejects.tsv"))
    first = next(iter(load_params(params_file).tasks))  # the first task the stage reads
    assert line == f"error: {tmp_path / 'tok' / f'{first}-dev.parquet'} is missing; run `dvc repro tokenize` first"

