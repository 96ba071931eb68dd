"""Fault injection: the failures a user meets, on the real stage or command run as a subprocess.

Each test breaks one file as a full disk, a cut-short copy or a damaged sector would, runs the stage or
`mtbert predict` as a user would, and checks what the user sees: one line naming the file and what was
expected (exit status 1, no traceback), or the run's own recovery from it; and that nothing already
written was lost or changed. Trained parts come from the repository's 2-layer slice of the real backbone
on tiny synthetic data (tests/conftest.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from mtbert import io
from mtbert.params_file import variant_params
from mtbert.training import build
from tests.commands import mtbert_in_process
from tests.conftest import REPO_ROOT, make_params, module_folder
from tests.runs import kill_when, result_of, run_training, train_command
from tests.test_errors import one_line_error, run_stage, tokenize_args

pytestmark = pytest.mark.slow(reason="runs killed, resumed and broken as real processes")


@pytest.fixture(scope="module")
def training_params(tmp_path_factory, tiny_backbone) -> Path:
    return make_params(tmp_path_factory.mktemp("params"), tiny_backbone, Path("unused"))


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory, training_params, tiny_tokenized) -> tuple[dict, Path]:
    """An uninterrupted run: its result and its output folder (models/base/ is a whole model folder)."""
    out = module_folder(request, tmp_path_factory, "uninterrupted")
    return run_training(training_params, tiny_tokenized, out), out


def run(command: list[str], debug: bool = False, **popen) -> subprocess.CompletedProcess:
    """A stage or command as a user runs it, with MTBERT_DEBUG set only when asked for."""
    env = {key: value for key, value in os.environ.items() if key != "MTBERT_DEBUG"}
    if debug:
        env["MTBERT_DEBUG"] = "1"
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, **popen)


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def truncate(path: Path, keep: float = 0.5) -> bytes:
    """Cut `path` to a share of its bytes, as a full disk or an interrupted copy leaves it; the bytes left."""
    data = path.read_bytes()[:int(path.stat().st_size * keep)]
    path.write_bytes(data)
    return data


def overwrite_middle(path: Path, count: int = 64) -> bytes:
    """Overwrite `count` bytes in the middle of `path` (each flipped, so each changes), as a damaged sector
    would; the new bytes."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(byte ^ 0xFF for byte in data[middle:middle + count])
    path.write_bytes(bytes(data))
    return bytes(data)


# --- params -----------------------------------------------------------------------------------------------
def test_a_params_yaml_with_an_unclosed_bracket_is_one_line_naming_line_and_column(tmp_path, tiny_backbone,
                                                                                    raw_dir):
    params_file = make_params(tmp_path, tiny_backbone, raw_dir)
    text = params_file.read_text().replace("  lr: ", "  lr: [", 1)  # the list is never closed
    params_file.write_text(text)
    line_number = next(number for number, line in enumerate(text.splitlines(), 1) if "  lr: [" in line)
    line = one_line_error(run_stage("tokenize", *tokenize_args(tmp_path, params_file)))
    assert line.startswith(f"error: {params_file}: not valid YAML at line {line_number + 1}, column "), line
    assert line.endswith("expected ',' or ']', but got ':'"), line
    assert not (tmp_path / "tok").exists()
    assert params_file.read_text() == text


# --- model folders, through `mtbert predict` --------------------------------------------------------------
def predict_arguments(model: Path, output: Path) -> list[str]:
    return ["predict", "--model", str(model), "--task", "sst", "--output", str(output), "A fine film ."]


def predict_command(model: Path, output: Path) -> list[str]:
    """`mtbert predict` as installed (the console script runs mtbert.cli's app the same way)."""
    return [sys.executable, "-m", "mtbert.cli", *predict_arguments(model, output)]


def first_epoch_folder(model: Path) -> Path:
    """The snapshot folder whose encoder `mtbert predict` takes its tokenizer from (the lowest kept epoch)."""
    epochs = json.loads((model / "mtbert.json").read_text())["task_epochs"].values()
    return model / f"epoch-{min(epochs)}"


def foreign_heads(path: Path) -> None:
    save_file({"classifier.weight": torch.zeros(2, 2)}, str(path))  # a whole file, of another model's heads


# (fault, the file it breaks relative to the kept epoch's folder or the model folder, what the line says after
# the file's name). Files the libraries read are checked first, for a precise line; the checksums, read after
# them, catch what a library reads without a word (changed weights) and the files read later (the tokenizer).
MODEL_FAULTS = {
    "heads cut short": (lambda p: truncate(p), "heads.safetensors",
                        ": not a whole safetensors file (incomplete metadata, file not fully covered); expected the "
                        "weights as they were written: restore the folder (`dvc checkout`) or retrain"),
    "heads of another model": (foreign_heads, "heads.safetensors", ": not the heads mtbert.json declares ("),
    "encoder weights cut short": (lambda p: truncate(p), "encoder/model.safetensors",
                                  ": not a whole safetensors file (incomplete metadata, file not fully covered)"),
    "64 bytes overwritten in the encoder's weights": (overwrite_middle, "encoder/model.safetensors", " has sha256 "),
    "encoder config cut short": (lambda p: truncate(p, 0.3), "encoder/config.json", ": not valid JSON at line "),
    "tokenizer.json cut short": (lambda p: truncate(p, 0.3), "encoder/tokenizer.json", " has sha256 "),
    "tokenizer.json gone": (lambda p: p.unlink(), "encoder/tokenizer.json", " is missing; "),
    "mtbert.json cut short": (lambda p: truncate(p, 0.5), "../mtbert.json", ": not valid JSON at line "),
    "checksums gone": (lambda p: p.unlink(), "../checksums.json", " is missing; expected the manifest written with "),
}


def predict_on_broken_copy(tmp_path: Path, trained, fault: str, predict) -> None:
    """`predict(model, output)` (the command as a subprocess, or in this process) on a copy of the trained
    folder with one file broken by `fault`: one line naming the file, no output, nothing read changed."""
    break_file, relative, says = MODEL_FAULTS[fault]
    model = tmp_path / "base"
    shutil.copytree(trained[1] / "models" / "base", model)
    broken = (first_epoch_folder(model) / relative).resolve()
    break_file(broken)
    before = digests(model)
    line = one_line_error(predict(model, tmp_path / "out.jsonl"))
    assert line.startswith(f"error: {broken}{says}"), line
    assert not (tmp_path / "out.jsonl").exists()
    assert digests(model) == before  # nothing read was changed


@pytest.mark.parametrize("fault", list(MODEL_FAULTS))
def test_a_broken_model_folder_file_is_named_by_mtbert_predict(tmp_path, trained, fault):
    predict_on_broken_copy(tmp_path, trained, fault,
                           lambda model, output: mtbert_in_process(*predict_arguments(model, output)))


@pytest.mark.parametrize("fault", ["heads cut short", "64 bytes overwritten in the encoder's weights"])
def test_a_broken_model_folder_file_is_one_line_from_the_installed_command(tmp_path, trained, fault):
    """As a user sees it: a process of its own, whose stderr holds the one line and nothing else (a
    library's check, and the checksums')."""
    predict_on_broken_copy(tmp_path, trained, fault, lambda model, output: run(predict_command(model, output)))


def test_mtbert_debug_shows_the_traceback_of_a_broken_model_folder(tmp_path, trained):
    model = tmp_path / "base"
    shutil.copytree(trained[1] / "models" / "base", model)
    truncate(first_epoch_folder(model) / "heads.safetensors")
    result = run(predict_command(model, tmp_path / "out.jsonl"), debug=True)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "SafetensorError" in result.stderr and "ModelFolderError" in result.stderr
    assert not any(line.startswith("error:") for line in result.stderr.splitlines())


def test_a_good_model_folder_still_predicts(tmp_path, trained):
    result = run(predict_command(trained[1] / "models" / "base", tmp_path / "out.jsonl"))
    assert result.returncode == 0, result.stderr
    assert set(json.loads((tmp_path / "out.jsonl").read_text())["sst"]) >= {"label", "prob_0"}


# --- Parquet inputs ---------------------------------------------------------------------------------------
def test_a_cut_short_tokenized_split_is_one_line_from_train(tmp_path, training_params, tiny_tokenized):
    tokenized = tmp_path / "tok"
    shutil.copytree(tiny_tokenized, tokenized)
    broken = tokenized / "sst-train.parquet"
    truncate(broken)
    before = digests(tokenized)
    line = one_line_error(run(train_command(training_params, tmp_path, tokenized)))
    assert line.startswith(f"error: {broken}: not a readable Parquet file (Parquet magic bytes not found in "
                           "footer"), line
    assert line.endswith("expected a split `tokenize` writes: run `dvc repro tokenize` again (or `dvc checkout "
                         "tokenize` to restore it)"), line
    assert digests(tokenized) == before
    assert not (tmp_path / "models").exists() and not (tmp_path / "metrics" / "base.json").exists()


def test_a_missing_tokenized_split_is_named_before_train_fingerprints_the_data(tmp_path, training_params,
                                                                                tiny_tokenized):
    from mtbert.runtime import MissingInputError

    shutil.copytree(tiny_tokenized, tmp_path / "tok")
    (tmp_path / "tok" / "sts-test.parquet").unlink()
    with pytest.raises(MissingInputError, match=r"sts-test.parquet is missing; run `dvc repro tokenize` first"):
        build.run_fingerprint(variant_params(training_params, "base"), tmp_path / "tok", None)


def test_a_tokenized_split_without_a_column_names_it(tmp_path, tiny_tokenized):
    from mtbert.data.batches import load_split
    from mtbert.runtime import UnreadableInputError
    from tests.conftest import TASKS

    shutil.copytree(tiny_tokenized, tmp_path / "tok")
    path = tmp_path / "tok" / "qqp-dev.parquet"
    io.write_parquet(path, pq.read_table(path).drop_columns(["input_ids_2"]))  # as another version might write it
    with pytest.raises(UnreadableInputError, match=r"qqp-dev.parquet: has no column 'input_ids_2' \(expected id, "):
        load_split(tmp_path / "tok", TASKS["qqp"], "dev")


def dead_pid() -> int:
    """The pid of a process that has ended."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_write_removes_what_a_killed_writer_left_beside_it_and_keeps_a_live_ones(tmp_path):
    """SIGKILL runs no `finally`: a killed `atomic_dir` leaves its half-written folder, hidden, beside the
    output. The next write of that output removes it; a temporary of a writer still running stays."""
    target = tmp_path / "model"
    abandoned = tmp_path / f".model.{dead_pid()}.abcd1234"
    (abandoned / "encoder").mkdir(parents=True)
    (abandoned / "encoder" / "model.safetensors").write_bytes(b"half")
    abandoned_file = tmp_path / f".model.{dead_pid()}.efgh5678.tmp"
    abandoned_file.write_bytes(b"half")
    live = tmp_path / f".model.{os.getpid()}.ijkl9012"
    live.mkdir()
    other_output = tmp_path / f".model-seed1.{dead_pid()}.mnop3456"  # another output's: not this write's
    other_output.mkdir()
    with io.atomic_dir(target) as temp:
        (temp / "mtbert.json").write_text("{}")
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(["model", live.name, other_output.name])


def test_a_parquet_file_that_another_program_wrote_is_refused_for_its_missing_digest(tmp_path, tiny_tokenized):
    """Its content cannot be checked (mtbert/io.py's DIGEST_KEY), so it is not read."""
    from mtbert.data.batches import load_split
    from mtbert.runtime import UnreadableInputError
    from tests.conftest import TASKS

    shutil.copytree(tiny_tokenized, tmp_path / "tok")
    path = tmp_path / "tok" / "sst-dev.parquet"
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({key: value for key, value in table.schema.metadata.items()
                                                  if key != io.DIGEST_KEY}), path)
    with pytest.raises(UnreadableInputError, match=r"sst-dev.parquet: holds no mtbert.sha256 digest of its content "
                                                   r"\(written by another program or an older mtbert, or damaged\); "
                                                   r"expected a split `tokenize` writes"):
        load_split(tmp_path / "tok", TASKS["sst"], "dev")


def test_a_cut_short_prediction_dump_is_one_line(tmp_path):
    from mtbert.evaluation.predictions import dump_path, read_dump
    from mtbert.runtime import UnreadableInputError
    from tests.conftest import TASKS

    path = dump_path(tmp_path, "sts", "dev")
    io.write_parquet(path, pa.table({"id": ["a", "b"], "score": [1.0, 2.0], "label": [1.0, 2.0]}))
    truncate(path)
    with pytest.raises(UnreadableInputError, match=r"sts-dev.parquet: not a readable Parquet file .*run the stage"):
        read_dump(tmp_path, TASKS["sts"], "dev")


def test_a_cut_short_rejects_table_names_its_missing_column(tmp_path):
    from mtbert.evaluation.predictions import rejected_ids
    from mtbert.runtime import UnreadableInputError

    path = tmp_path / "rejects.tsv"
    path.write_text("task\tspl")  # cut inside its header
    with pytest.raises(UnreadableInputError, match=r"rejects.tsv: has no column 'split'; expected the rejects table"):
        rejected_ids(path, "sst", "dev")


# --- checkpoints ------------------------------------------------------------------------------------------
def checkpoint_folder(out: Path) -> Path:
    return out / "ck" / "base"


def lines_saying(result: subprocess.CompletedProcess, words: str) -> list[str]:
    return [line for line in result.stderr.splitlines() if words in line]


def set_aside_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.unreadable-*"))


def checkpoint_files(folder: Path) -> set[str]:
    """The files directly in a run's checkpoint folder (checkpoints, and the temporary file of one being written)."""
    return {path.name for path in folder.glob("*") if path.is_file()} if folder.is_dir() else set()


def first_checkpoint_written(folder: Path):
    return lambda: checkpoint_files(folder) == {"last.pt"}


def two_checkpoints_kept(folder: Path):
    return lambda: checkpoint_files(folder) == {"last.pt", "previous.pt"}


def test_a_cut_short_last_checkpoint_without_a_previous_one_restarts_the_run(tmp_path, training_params,
                                                                             tiny_tokenized, trained):
    folder = checkpoint_folder(tmp_path)
    command = train_command(training_params, tmp_path, tiny_tokenized)
    kill_when(command, first_checkpoint_written(folder))  # after update 3
    cut = truncate(folder / "last.pt")

    result = run(command)
    assert result.returncode == 0, result.stderr
    [said] = lines_saying(result, "cannot be read")
    assert f"checkpoint {folder / 'last.pt'} cannot be read (" in said and said.endswith("; starting over"), said
    assert result_of(tmp_path) == trained[0]  # a clean full run's result
    [aside] = set_aside_files(folder)
    assert aside.read_bytes() == cut  # set aside, not deleted
    assert [p.name for p in folder.iterdir()] == [aside.name]  # the rest of the folder went with the finished run


@pytest.mark.parametrize("damage", [truncate, overwrite_middle], ids=["cut short", "64 bytes overwritten"])
def test_a_damaged_last_checkpoint_resumes_from_the_previous_one(tmp_path, training_params, tiny_tokenized, trained,
                                                                damage):
    folder = checkpoint_folder(tmp_path)
    command = train_command(training_params, tmp_path, tiny_tokenized)
    kill_when(command, two_checkpoints_kept(folder))
    damaged = damage(folder / "last.pt")

    result = run(command)
    assert result.returncode == 0, result.stderr
    [said] = lines_saying(result, "cannot be read")
    assert said.endswith("; trying previous.pt"), said
    if damage is overwrite_middle:  # torch.load alone would read it without a word
        assert "fails its CRC-32 check" in said, said
    assert lines_saying(result, "resuming from epoch")
    assert result_of(tmp_path) == trained[0]  # as if never interrupted
    [aside] = set_aside_files(folder)
    assert aside.read_bytes() == damaged


def test_too_little_disk_space_stops_before_writing_and_keeps_the_checkpoint(tmp_path, training_params,
                                                                             tiny_tokenized, trained):
    folder = checkpoint_folder(tmp_path)
    command = train_command(training_params, tmp_path, tiny_tokenized)
    kill_when(command, first_checkpoint_written(folder))
    kept = digests(folder)

    # The stage itself, with one thing faked: the disk reports 1 MB free.
    low_disk = ("import runpy, shutil, sys; real = shutil.disk_usage; "
                "shutil.disk_usage = lambda path: real(path)._replace(free=1_000_000); "
                "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
    line = one_line_error(run([sys.executable, "-c", low_disk, *command[2:]]))
    assert line.startswith(f"error: {folder}: not enough free disk space for the next checkpoint: it needs "
                           "about "), line
    assert "bytes and 1,000,000 are free" in line and "the checkpoint before it is kept (last.pt)" in line, line
    assert digests(folder) == kept

    result = run(command)  # space freed: it resumes and ends as an uninterrupted run
    assert result.returncode == 0, result.stderr
    assert result_of(tmp_path) == trained[0]


def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, training_params, tiny_tokenized,
                                                                 trained):
    folder = checkpoint_folder(tmp_path)
    command = train_command(training_params, tmp_path, tiny_tokenized)
    kill_when(command, first_checkpoint_written(folder))
    kept = digests(folder)
    limit = (folder / "last.pt").stat().st_size // 2  # no checkpoint fits; every other file of the run does

    def small_files_only():  # a write past the limit fails with EFBIG, as one past a full disk with ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    line = one_line_error(run(command, preexec_fn=small_files_only))
    assert line.startswith(f"error: {folder / 'last.pt'}: writing the checkpoint failed ("), line
    assert line.endswith("the checkpoint before it is kept (last.pt). Free some space and run the stage again to "
                         "resume"), line
    assert digests(folder) == kept  # the old checkpoint whole, no partial file left beside it

    result = run(command)
    assert result.returncode == 0, result.stderr
    assert result_of(tmp_path) == trained[0]


def test_a_checkpoint_of_other_params_is_ignored_and_the_run_starts_over(tmp_path, tiny_backbone, training_params,
                                                                        tiny_tokenized, trained):
    other_params = make_params(tmp_path, tiny_backbone, Path("unused"), train={"lr": 3e-4})
    folder = checkpoint_folder(tmp_path)
    kill_when(train_command(other_params, tmp_path, tiny_tokenized), first_checkpoint_written(folder))

    result = run(train_command(training_params, tmp_path, tiny_tokenized))
    assert result.returncode == 0, result.stderr
    [said] = lines_saying(result, "ignoring")
    assert said.endswith(f"ignoring {folder / 'last.pt'}: it was written by a run with other params or data; "
                         "starting over"), said
    assert result_of(tmp_path) == trained[0]


def test_the_fingerprint_covers_params_data_and_start_weights_but_not_runtime(tmp_path, training_params,
                                                                             tiny_tokenized, tiny_backbone):
    params = variant_params(training_params, "base")
    tokenized, backbone = tmp_path / "tok", tmp_path / "backbone"
    shutil.copytree(tiny_tokenized, tokenized)
    shutil.copytree(tiny_backbone, backbone)
    fingerprint = build.run_fingerprint(params, tokenized, backbone)

    faster = variant_params(make_params(tmp_path, tiny_backbone, Path("unused"), runtime={"threads": 2}), "base")
    assert build.run_fingerprint(faster, tokenized, backbone) == fingerprint
    other = variant_params(make_params(tmp_path, tiny_backbone, Path("unused"), train={"seed": 1}), "base")
    assert build.run_fingerprint(other, tokenized, backbone) != fingerprint

    overwrite_middle(tokenized / "sts-test.parquet", 1)  # any split, test too: the snapshot dumps predict it
    assert build.run_fingerprint(params, tokenized, backbone) != fingerprint
    shutil.copy(tiny_tokenized / "sts-test.parquet", tokenized / "sts-test.parquet")
    overwrite_middle(backbone / "model.safetensors", 4)
    assert build.run_fingerprint(params, tokenized, backbone) != fingerprint
