"""The tokenize stage through its command line."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import yaml
from typer.testing import CliRunner

from mtbert.data.rawdata import RawDataError
from mtbert.variants import deep_merge
from stages.tokenize import app
from tests.conftest import REPO_ROOT, synthetic_raw_files, write_raw_files


def write_params(path: Path, raw_dir: Path, extra: dict | None = None, **data_overrides) -> Path:
    params = deep_merge(yaml.safe_load((REPO_ROOT / "params.yaml").read_text()), extra or {})
    params["data"].update(raw_dir=str(raw_dir), **data_overrides)
    params["tokenize"]["max_length"] = 16
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def run_stage(tmp_path: Path, params_file: Path):
    return CliRunner().invoke(app, ["--params-file", str(params_file), "--out-dir", str(tmp_path / "tok"),
                                    "--rejects-file", str(tmp_path / "rejects.tsv"),
                                    "--metrics-file", str(tmp_path / "data.json")])


def test_stage_writes_every_split_and_reports_rejects(tmp_path):
    raw = write_raw_files(tmp_path / "raw", {
        "quora-train.csv": "\tid\tsentence1\tsentence2\tis_duplicate\n0\tq1\ta?\tb?\t1.0\n1\tq2\tc?\t\"\"\"d?\"\t\n"
                           + "".join(f"{i}\tk{i}\tx{i}?\ty{i}?\t0.0\n" for i in range(2, 20)),
    })
    result = run_stage(tmp_path, write_params(tmp_path / "params.yaml", raw, max_reject_fraction=0.1))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == sorted(
        f"{task}-{split}.parquet" for task in ("sst", "qqp", "sts") for split in ("train", "dev", "test"))
    assert pq.read_table(tmp_path / "tok" / "qqp-train.parquet").num_rows == 19
    rejects = (tmp_path / "rejects.tsv").read_text().splitlines()
    assert rejects == ["task\tsplit\trow\tid\treason\tdetail",
                       "qqp\ttrain\t2\tq2\tmissing_label\tcolumn 'is_duplicate' is empty"]
    report = json.loads((tmp_path / "data.json").read_text())
    assert report["qqp"]["train"]["rows_read"] == 20
    assert report["qqp"]["train"]["rows_kept"] == 19
    assert report["qqp"]["train"]["rejected"]["missing_label"] == 1
    assert report["qqp"]["train"]["labels"] == {"0": 18, "1": 1}
    assert report["sst"]["train"]["labels"] == {"0": 1, "2": 1, "3": 1}
    assert report["sts"]["train"]["labels"]["histogram"] == {"0-1": 1, "1-2": 0, "2-3": 0, "3-4": 0, "4-5": 1}
    assert "labels" not in report["sst"]["test"]


def test_stage_fails_when_a_file_rejects_too_many_rows(tmp_path):
    raw = write_raw_files(tmp_path / "raw", {
        "sts-dev.csv": "\tid\tsentence1\tsentence2\tsimilarity\n0\tt1\ta\tb\t1.0\n1\tt2\ta\tb\t9\n"})
    result = run_stage(tmp_path, write_params(tmp_path / "params.yaml", raw, max_reject_fraction=0.2))
    assert isinstance(result.exception, RawDataError)
    assert "sts-dev: 1 of 2 rows rejected, more than data.max_reject_fraction=0.2" in str(result.exception)
    assert "label_out_of_range" in (tmp_path / "rejects.tsv").read_text()  # the evidence is kept


# A three-class single-sentence task that only params.yaml knows about, with its own file names.
EMOTION = {
    "tasks": {"emo": {"files": {"prefix": "emo", "train": "train", "dev": "dev", "test": "blind"},
                      "text": ["text"], "label": "feeling", "kind": "classification", "classes": 3,
                      "metric": "macro_f1", "submission": {"file": "emo", "column": "Predicted_Feeling"}}},
    "heads": {"emo": {"hidden_layers": 0, "dropout": 0.1}},  # its per-task knobs: the defaults
}


def test_a_task_declared_in_params_alone_is_tokenized(tmp_path):
    raw = write_raw_files(tmp_path / "raw", {
        "emo-train.csv": "\tid\ttext\tfeeling\n0\te1\ta happy day\t2\n1\te2\ta sad day\t0\n2\te3\tso so\t1\n"
                         "3\te4\tmeh\t1\n",
        "emo-dev.csv": "\tid\ttext\tfeeling\n0\ted1\tgreat\t2\n",
        "emo-blind.csv": "\tid\ttext\n0\tet1\tfine\n1\tet2\tawful\n",
    })
    result = run_stage(tmp_path, write_params(tmp_path / "params.yaml", raw, EMOTION))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == sorted(
        f"{task}-{split}.parquet" for task in ("sst", "qqp", "sts", "emo") for split in ("train", "dev", "test"))
    train = pq.read_table(tmp_path / "tok" / "emo-train.parquet")
    assert train.column("id").to_pylist() == ["e1", "e2", "e3", "e4"]
    assert train.column("label").to_pylist() == [2, 0, 1, 1] and str(train.schema.field("label").type) == "int64"
    assert "input_ids_1" not in train.column_names  # one sentence: no pair encodings
    assert pq.read_table(tmp_path / "tok" / "emo-test.parquet").column("label").null_count == 2
    report = json.loads((tmp_path / "data.json").read_text())
    assert report["emo"]["train"]["labels"] == {"0": 1, "1": 2, "2": 1}
    assert report["emo"]["test"]["rows_kept"] == 2 and "labels" not in report["emo"]["test"]


def test_without_a_variant_each_variant_is_tokenized_by_its_own_encoder(tmp_path, tiny_backbone, tiny_mpnet,
                                                                       monkeypatch):
    """`python -m stages.tokenize` alone (by hand, or a runner without DVC) writes every variant's folder,
    as `tokenize@<variant>` does: the same rows, ids and labels, each in its encoder's tokens. The command
    with no argument, in the project's folder; the stage's own process runs in the pipeline tests' `dvc repro`."""
    raw = write_raw_files(tmp_path / "raw", synthetic_raw_files(8))
    write_params(tmp_path / "params.yaml", raw, {"model": {"name": str(tiny_backbone)}, "distill": {"variant": "bert"},
                                                 "models": {"bert": {}, "mpnet": {"model": {"name": str(tiny_mpnet)}}}})
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, [])
    assert result.exit_code == 0, result.output
    tables = {}
    for variant, pad_id in (("bert", b"0"), ("mpnet", b"1")):
        folder = tmp_path / "data" / "tokenized" / variant
        tables[variant] = pq.read_table(folder / "sts-dev.parquet")
        assert tables[variant].schema.metadata[b"mtbert.pad_id"] == pad_id
        assert (folder / "rejects.tsv").is_file() and (tmp_path / "metrics" / "data" / f"{variant}.json").is_file()
    for column in ("id", "label", "sentence1"):
        assert tables["bert"].column(column) == tables["mpnet"].column(column)
    assert tables["bert"].column("input_ids") != tables["mpnet"].column("input_ids")
