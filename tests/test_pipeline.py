"""The whole pipeline through a real `dvc repro` in a temporary repository, on a 2-layer backbone.

Beside SST, QQP and STS the repository declares a fourth task in its params alone (a binary
single-sentence task, `cfimdb`, with its own raw files): every stage must handle it with no code change.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import REPO_ROOT, make_params, synthetic_raw_files, write_raw_files


def dvc(repo: Path, *args: str) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["dvc", *args], cwd=repo, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"dvc {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


# A fourth task, declared only here: binary sentiment of single sentences (like CS224N's CFIMDB).
FOURTH_TASK = {
    "tasks": {"cfimdb": {"files": {"prefix": "ids-cfimdb", "train": "train", "dev": "dev", "test": "test-student"},
                         "text": ["sentence"], "label": "sentiment", "kind": "binary", "metric": "accuracy",
                         "submission": {"file": "cfimdb", "column": "Predicted_Sentiment"}}},
    "heads": {"cfimdb": {"pooling": "mean", "hidden_layers": 1, "dropout": 0.1, "loss_weight": 1.0}},
    "train": {"batch_size": {"cfimdb": 4}},
    "smart": {"task_lambda": {"cfimdb": None}},
}
TASK_NAMES = ("sst", "qqp", "sts", "cfimdb")


def fourth_task_files(rows: int) -> dict[str, str]:
    files = {}
    for split, suffix in (("train", "train"), ("dev", "dev"), ("test", "test-student")):
        header = "\tid\tsentence" + ("" if split == "test" else "\tsentiment")
        lines = [f"{i}\t{split}-c{i}\t{'a fine film' if i % 2 else 'a dull film'} number {i}"
                 + ("" if split == "test" else f"\t{i % 2}") for i in range(rows)]
        files[f"ids-cfimdb-{suffix}.csv"] = "\n".join([header, *lines]) + "\n"
    return files


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_backbone) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(REPO_ROOT / "stages", repo / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "dvc.yaml", repo / "dvc.yaml")
    make_params(repo, tiny_backbone, Path("data/raw"), train={"epochs": 1}, extra=FOURTH_TASK,
                models={"plain": {}, "meanpool": {"heads": {"sst": {"pooling": "mean"}}, "train": {"seed": 1}}})
    write_raw_files(repo / "data" / "raw", {**synthetic_raw_files(16), **fourth_task_files(16)})
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    dvc(repo, "init", "-q")
    dvc(repo, "config", "core.analytics", "false")
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "pipeline"], cwd=repo, check=True)  # DVCLive needs a commit
    dvc(repo, "repro")
    return repo


def test_repro_builds_every_stage_output(repo):
    for variant in ("plain", "meanpool"):
        assert (repo / "models" / variant / "heads.safetensors").is_file()
        metrics = json.loads((repo / "metrics" / f"{variant}.json").read_text())
        assert set(metrics) == {*TASK_NAMES, "overall"}
        assert set(metrics["cfimdb"]) == {"accuracy", "f1"}
        assert set(metrics["sst"]) == {"accuracy", "macro_f1"} and set(metrics["sts"]) == {"pearson", "spearman"}
        dump = pq.read_table(repo / "data" / "predictions" / variant / "sst-dev.parquet")
        assert dump.column_names == ["id", "prob_0", "prob_1", "prob_2", "prob_3", "prob_4", "label"]
        dump = pq.read_table(repo / "data" / "predictions" / variant / "cfimdb-dev.parquet")
        assert dump.column_names == ["id", "prob", "label"] and dump.num_rows == 16
        train = json.loads((repo / "metrics" / "train" / f"{variant}.json").read_text())
        assert set(train["dev"]) == {*TASK_NAMES, "overall"}
        assert train["epochs"][0]["task_batches"]["cfimdb"] > 0  # it was trained on, not only evaluated
    data = json.loads((repo / "metrics" / "data.json").read_text())
    assert data["cfimdb"]["train"]["labels"] == {"0": 8, "1": 8}
    ensemble = json.loads((repo / "metrics" / "ensemble.json").read_text())
    assert ensemble["overall"] == pytest.approx(sum(ensemble[t]["accuracy" if t != "sts" else "pearson"]
                                                    for t in TASK_NAMES) / 4)
    for task in TASK_NAMES:
        assert sum(ensemble[task]["members"].values()) >= 1
        assert set(ensemble[task]["members"]) <= {"plain", "meanpool"}
        assert sum(ensemble[task]["honest"]["half_sizes"]) == 16


def test_submissions_list_every_raw_test_id_once(repo):
    for prefix, id_letter, column in (("sst", "s", "Predicted_Sentiment"), ("para", "q", "Predicted_Is_Paraphrase"),
                                      ("sts", "t", "Predicted_Similiarity"), ("cfimdb", "c", "Predicted_Sentiment")):
        frame = pd.read_csv(repo / "data" / "ensemble" / f"{prefix}-test-output.csv")
        assert frame.columns.tolist() == ["id", column]
        assert sorted(frame["id"]) == sorted(f"test-{id_letter}{i}" for i in range(16))


def test_second_repro_does_nothing_and_status_is_clean(repo):
    assert "Running stage" not in dvc(repo, "repro")
    assert "up to date" in dvc(repo, "status")


def test_params_that_do_not_change_results_rerun_nothing(repo):
    params_file = repo / "params.yaml"
    original = params_file.read_text()
    params = yaml.safe_load(original)
    params["runtime"] = {"threads": 2, "checkpoint_every": {"train": 1, "pretrain": 7}}
    try:
        params_file.write_text(yaml.safe_dump(params, sort_keys=False))
        assert "up to date" in dvc(repo, "status")
        assert "Running stage" not in dvc(repo, "repro")
    finally:
        params_file.write_text(original)


def test_plots_render(repo):
    output = dvc(repo, "plots", "show", "--json")
    shown = json.loads(output)["data"]
    for plot in ("confusion/sst.csv", "confusion/cfimdb.csv", "scatter/sts.csv"):
        assert any(plot in name for name in shown), plot
    assert any("dev/overall.tsv" in name for name in shown)


def test_queued_experiments_run_and_show_with_their_metrics(repo):
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "lock"], cwd=repo, check=True)  # queued runs start from HEAD
    for name, members in (("one-member", 1), ("two-members", 2)):
        dvc(repo, "exp", "run", "--queue", "-n", name, "-S", f"ensemble.max_members={members}")
    dvc(repo, "queue", "start", "-j", "1")
    deadline = time.time() + 600
    while time.time() < deadline:
        status = dvc(repo, "queue", "status")
        if "Queued" not in status and "Running" not in status:
            break
        time.sleep(2)
    assert status.count("Success") == 2, status
    shown = json.loads(dvc(repo, "exp", "show", "--json"))
    experiments = {exp["name"]: exp for commit in shown for exp in (commit.get("experiments") or [])}
    assert {"one-member", "two-members"} <= set(experiments)
    for name, members in (("one-member", 1), ("two-members", 2)):
        data = experiments[name]["revs"][0]["data"]
        assert data["params"]["params.yaml"]["data"]["ensemble"]["max_members"] == members
        ensemble = data["metrics"]["metrics/ensemble.json"]["data"]
        assert all(sum(ensemble[task]["members"].values()) <= members for task in TASK_NAMES)
