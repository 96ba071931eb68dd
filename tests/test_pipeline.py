"""The whole pipeline through a real `dvc repro` in a temporary repository, on a 2-layer backbone.

Beside SST, QQP and STS the repository declares two more tasks, each with one block under `tasks:` and
its raw files, nothing else (every per-task knob takes its default): `cfimdb`, binary sentiment of single
sentences, declared exactly as the README's "Adding a task" shows it, and `nli`, a three-class sentence-pair
task. Every stage must handle them with no code change.
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

from tests.commands import mtbert_in_process
from tests.conftest import REPO_ROOT, make_params, module_folder, synthetic_raw_files
from tests.repos import GIT, copy_repo, dvc, dvc_env, pipeline_repo

pytestmark = pytest.mark.slow(reason="a real `dvc repro` and `dvc exp run` of the pipeline in a temporary repository")


def readme_task_block() -> dict:
    """The `tasks:` block of the README's "Adding a task" example, as a user would paste it."""
    section = (REPO_ROOT / "README.md").read_text(encoding="utf-8").split("## Adding a task", 1)[1]
    return yaml.safe_load(section.split("```yaml", 1)[1].split("```", 1)[0])


# A fifth task: three-way inference over sentence pairs, a cross-encoded classification by default.
FIFTH_TASK = {"nli": {"files": {"prefix": "nli", "train": "train", "dev": "dev", "test": "test-student"},
                      "text": ["premise", "hypothesis"], "label": "gold", "kind": "classification", "classes": 3,
                      "metric": "macro_f1", "submission": {"file": "nli", "column": "Predicted_Label"}}}
NEW_TASKS = {"tasks": {**readme_task_block()["tasks"], **FIFTH_TASK}}
TASK_NAMES = ("sst", "qqp", "sts", "cfimdb", "nli")
HEADLINE = {"sst": "accuracy", "qqp": "accuracy", "sts": "pearson", "cfimdb": "accuracy", "nli": "macro_f1"}


def task_files(prefix: str, id_letter: str, columns: list[str], row, rows: int) -> dict[str, str]:
    """Raw train, dev and test files of a task (ids `<split>-<id_letter><i>`): `row(i, split)` gives row i's
    text cells and its label."""
    files = {}
    for split, suffix in (("train", "train"), ("dev", "dev"), ("test", "test-student")):
        header = "\t".join(["", "id", *columns[:-1], *([] if split == "test" else columns[-1:])])
        lines = []
        for i in range(rows):
            texts, label = row(i, split)
            lines.append("\t".join([str(i), f"{split}-{id_letter}{i}", *texts, *([] if split == "test" else [label])]))
        files[f"{prefix}-{suffix}.csv"] = "\n".join([header, *lines]) + "\n"
    return files


def fourth_task_files(rows: int) -> dict[str, str]:
    return task_files("ids-cfimdb", "c", ["sentence", "sentiment"],
                      lambda i, split: ([f"{'a fine film' if i % 2 else 'a dull film'} number {i}"], str(i % 2)), rows)


def fifth_task_files(rows: int) -> dict[str, str]:
    return task_files("nli", "n", ["premise", "hypothesis", "gold"],
                      lambda i, split: ([f"a man plays number {i}", ["he sleeps", "a man plays", "he plays"][i % 3]],
                                        str(i % 3)), rows)


@pytest.fixture(scope="module")
def repo(request, tmp_path_factory, tiny_backbone, tiny_mpnet) -> Path:
    def write_params(repo: Path) -> None:
        # predict as train evaluates (batch 8, fp32), so the model cards' dev metrics are predict's exactly
        make_params(repo, tiny_backbone, Path("data/raw"), train={"epochs": 1},
                    extra={**NEW_TASKS, "predict": {"batch_size": 8, "bf16": False},
                           "export": {"models": ["distilled"]},
                           "distill": {"enabled": True, "variant": "plain", "students": {"distilled": 0},
                                       "transfer": {"rows": {"sst": 6, "qqp": 0, "sts": 6, "nli": 4}}}},
                    models={"plain": {}, "plain-seed1": {"train": {"seed": 1}},
                            # a member of another encoder family, with its own tokenizer and pad id
                            "meanpool": {"model": {"name": str(tiny_mpnet)}, "heads": {"sst": {"pooling": "mean"}},
                                         "train": {"seed": 1}}})

    raw_files = {**synthetic_raw_files(16), **fourth_task_files(16), **fifth_task_files(16)}
    repo = pipeline_repo(module_folder(request, tmp_path_factory, "repo"), raw_files, write_params)
    dvc(repo, "repro")
    return repo


def test_repro_builds_every_stage_output(repo):
    for variant in ("plain", "meanpool", "plain-seed1"):
        task_epochs = json.loads((repo / "models" / variant / "mtbert.json").read_text())["task_epochs"]
        assert task_epochs == {task: 1 for task in TASK_NAMES}  # one epoch
        assert (repo / "models" / variant / "epoch-1" / "heads.safetensors").is_file()
        metrics = json.loads((repo / "metrics" / f"{variant}.json").read_text())
        assert set(metrics) == {*TASK_NAMES, "overall"}
        assert set(metrics["cfimdb"]) == {"accuracy", "f1"} and set(metrics["nli"]) == {"accuracy", "macro_f1"}
        assert set(metrics["sst"]) == {"accuracy", "macro_f1"} and set(metrics["sts"]) == {"pearson", "spearman"}
        dump = pq.read_table(repo / "data" / "predictions" / variant / "sst-dev.parquet")
        assert dump.column_names == ["id", "prob_0", "prob_1", "prob_2", "prob_3", "prob_4", "label"]
        dump = pq.read_table(repo / "data" / "predictions" / variant / "cfimdb-dev.parquet")
        assert dump.column_names == ["id", "prob", "label"] and dump.num_rows == 16
        train = json.loads((repo / "metrics" / "train" / f"{variant}.json").read_text())
        assert set(train["dev"]) == {*TASK_NAMES, "overall"}
        assert train["epochs"][0]["task_batches"]["cfimdb"] > 0  # it was trained on, not only evaluated
        assert train["epochs"][0]["task_batches"]["nli"] > 0
    data = json.loads((repo / "metrics" / "data" / "plain.json").read_text())
    assert data["cfimdb"]["train"]["labels"] == {"0": 8, "1": 8}
    pad_ids = {variant: pq.read_schema(repo / "data" / "tokenized" / variant / "sst-dev.parquet").metadata[
        b"mtbert.pad_id"] for variant in ("plain", "meanpool", "plain-seed1")}
    assert pad_ids == {"plain": b"0", "meanpool": b"1", "plain-seed1": b"0"}  # each variant its encoder's tokens
    ensemble = json.loads((repo / "metrics" / "ensemble.json").read_text())
    assert ensemble["overall"] == pytest.approx(sum(ensemble[t][HEADLINE[t]] for t in TASK_NAMES) / len(TASK_NAMES),
                                                abs=1e-4)  # 4 digits
    for task in TASK_NAMES:
        assert sum(ensemble[task]["members"].values()) >= 1
        assert set(ensemble[task]["members"]) <= {"plain", "meanpool", "plain-seed1"}
        assert sum(ensemble[task]["honest"]["half_sizes"]) == 16
    # the deployable ensemble: every task, its members in the ensemble's order, checked against its dumps
    manifest = json.loads((repo / "exports" / "ensemble" / "manifest.json").read_text())
    assert manifest["members"] == {task: ensemble[task]["order"] for task in TASK_NAMES}
    assert all("meanpool" in order and "plain" in order for order in manifest["members"].values())  # uniform
    member_pads = {name: json.loads((repo / "exports" / "ensemble" / name / "manifest.json").read_text())["pad_id"]
                   for name in ("plain", "meanpool")}
    assert member_pads == {"plain": 0, "meanpool": 1}  # BERT and MPNet members in one deployed ensemble
    exported = json.loads((repo / "metrics" / "export" / "ensemble.json").read_text())
    assert set(exported["parity"]["max_abs_difference"]) == set(TASK_NAMES)
    stats = json.loads((repo / "metrics" / "stats.json").read_text())
    assert set(stats["groups"]["plain"]["honest"]) == {*TASK_NAMES, "overall"}  # its epoch choice, honestly


def test_a_cached_output_is_one_file_in_the_cache_and_the_workspace(repo):
    heads = repo / "models" / "plain" / "epoch-1" / "heads.safetensors"
    assert heads.stat().st_nlink > 1  # .dvc/config's cache.type links it; a copy would double the disk it takes


def test_the_student_learns_the_transfer_set_the_members_labelled(repo):
    transfer = json.loads((repo / "metrics" / "transfer.json").read_text())
    assert {task: transfer[task]["rows"] for task in TASK_NAMES} == {"sst": 6, "qqp": 0, "sts": 6, "cfimdb": 0,
                                                                     "nli": 4}
    for variant in ("plain", "meanpool", "plain-seed1"):
        assert pq.read_table(repo / "data" / "predictions" / variant / "nli-transfer.parquet").num_rows == 4
    student = json.loads((repo / "metrics" / "distilled.json").read_text())
    assert student["distill"]["transfer"] == {"sst": 6, "sts": 6, "nli": 4}
    assert set(student) == {*TASK_NAMES, "overall", "distill"}
    assert (repo / "models" / "distilled" / "mtbert.json").is_file()
    manifest = json.loads((repo / "exports" / "distilled" / "manifest.json").read_text())  # export.models
    assert set(manifest["tasks"]) == set(TASK_NAMES)
    assert json.loads((repo / "metrics" / "export" / "distilled.json").read_text())["engine"] in ("onnx", "int8")


def card_metadata(path: Path) -> dict:
    text = path.read_text(encoding="utf-8")
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_model_cards_carry_the_metrics_of_their_model(repo):
    from mtbert.params_file import variant_params

    encoders = {variant: variant_params(repo / "params.yaml", variant).model.name
                for variant in ("plain", "meanpool", "plain-seed1")}
    for variant in ("plain", "meanpool", "plain-seed1"):
        card = card_metadata(repo / "models" / variant / "README.md")
        assert card["base_model"] == encoders[variant]  # a variant's own encoder, or the shared one
        assert card["license"] == "apache-2.0" and card["library_name"] == "transformers"
        metrics = json.loads((repo / "metrics" / f"{variant}.json").read_text())
        results = {r["task"]["name"]: {m["type"]: m["value"] for m in r["metrics"]}
                   for r in card["model-index"][0]["results"]}
        assert results == {task: metrics[task] for task in TASK_NAMES}
    ensemble = json.loads((repo / "metrics" / "ensemble.json").read_text())
    card = card_metadata(repo / "data" / "ensemble" / "README.md")
    assert card["base_model"] == [encoders["meanpool"], encoders["plain"]]  # its members', BERT and MPNet
    card_metrics = {r["task"]["name"]: {m["type"]: m["value"] for m in r["metrics"]}
                    for r in card["model-index"][0]["results"]}
    assert {task: card_metrics[task][HEADLINE[task]] for task in card_metrics} == {
        task: ensemble[task][HEADLINE[task]] for task in TASK_NAMES}


def test_submissions_list_every_raw_test_id_once(repo):
    for prefix, id_letter, column in (("sst", "s", "Predicted_Sentiment"), ("para", "q", "Predicted_Is_Paraphrase"),
                                      ("sts", "t", "Predicted_Similiarity"), ("cfimdb", "c", "Predicted_Sentiment"),
                                      ("nli", "n", "Predicted_Label")):
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
    params["runtime"].update({"threads": 2, "checkpoint_every": {"train": 1, "pretrain": 7}, "onednn_cache": 8,
                              "malloc_threshold_mb": 1})
    try:
        params_file.write_text(yaml.safe_dump(params, sort_keys=False))
        assert "up to date" in dvc(repo, "status")
        assert "Running stage" not in dvc(repo, "repro")
    finally:
        params_file.write_text(original)


def test_a_variant_given_another_encoder_reruns_its_own_stages_and_what_combines_the_variants(repo, tiny_mpnet):
    params_file = repo / "params.yaml"
    original = params_file.read_text()
    params = yaml.safe_load(original)
    params["models"]["plain-seed1"]["model"] = {"name": str(tiny_mpnet)}
    try:
        params_file.write_text(yaml.safe_dump(params, sort_keys=False))
        changed = set(json.loads(dvc(repo, "status", "--json")))
    finally:
        params_file.write_text(original)
    # its tokens, its starting encoder and its training; the stages that read every variant's params
    # (`models`) or all their outputs follow; no other variant's stage re-runs
    assert {"tokenize@plain-seed1", "pretrain@plain-seed1", "train@plain-seed1"} <= changed
    assert not {f"{stage}@{variant}" for stage in ("tokenize", "pretrain", "train", "predict")
                for variant in ("plain", "meanpool")} & changed
    assert "transfer" not in changed  # the student's variant, plain, kept its encoder


def test_members_train_at_once_and_repro_goes_on_from_them(repo, tmp_path):
    """`make members` (python -m mtbert.members) on a copy where one member's params changed: it retrains in
    a process of its own, the others are left alone, dvc.lock records it, and `dvc repro` does not train it
    again."""
    copy = copy_repo(repo, tmp_path / "repo")
    params = yaml.safe_load((copy / "params.yaml").read_text())
    params["models"]["meanpool"]["train"]["seed"] = 2  # one member changes; the others stay up to date
    (copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    result = subprocess.run([sys.executable, "-m", "mtbert.members"], cwd=copy, env=env, capture_output=True,
                            text=True)  # dvc through the same interpreter, as mtbert.members runs it
    assert result.returncode == 0, result.stderr
    assert "training meanpool at once" in result.stderr
    assert json.loads((copy / "metrics" / "train" / "meanpool.json").read_text())["epochs"]
    assert "train@" not in dvc(copy, "status", "train@plain", "train@meanpool", "train@plain-seed1")
    repro = dvc(copy, "repro")
    assert "Running stage 'train@" not in repro and "Running stage 'predict@meanpool'" in repro


def test_seed_statistics_group_the_seeds_and_compare_the_groups(repo):
    stats = json.loads((repo / "metrics" / "stats.json").read_text())
    assert {group: entry["variants"] for group, entry in stats["groups"].items()} == {
        "plain": ["plain", "plain-seed1"], "meanpool": ["meanpool"], "distilled": ["distilled"]}
    singles = [json.loads((repo / "metrics" / f"{v}.json").read_text()) for v in ("plain", "plain-seed1")]
    accuracy = stats["groups"]["plain"]["dev"]["sst"]["accuracy"]
    assert accuracy["mean"] == pytest.approx(sum(m["sst"]["accuracy"] for m in singles) / 2, abs=1e-4)
    assert accuracy["min"] == min(m["sst"]["accuracy"] for m in singles)
    comparison = stats["comparisons"]["meanpool - plain"]
    for key in (*TASK_NAMES, "overall"):
        assert comparison[key]["low"] <= comparison[key]["difference"] <= comparison[key]["high"]


def test_plots_show_one_chart_of_curves_and_the_ensembles_plots_without_warnings(repo):
    result = subprocess.run(["dvc", "plots", "show", "--json"], cwd=repo, env=dvc_env(), capture_output=True, text=True)
    assert result.returncode == 0 and "WARNING" not in result.stderr + result.stdout, result.stderr
    shown = json.loads(result.stdout)["data"]
    assert sorted(shown) == sorted(["metrics/curves.tsv", *(f"data/plots/ensemble/confusion/{t}.csv"
                                                             for t in ("sst", "qqp", "cfimdb", "nli")),
                                    "data/plots/ensemble/scatter/sts.csv"])
    curves = shown["metrics/curves.tsv"][0]
    spec = curves["content"]
    assert spec["title"] == "Every variant per epoch (dev metrics and training loss)"
    assert spec["encoding" if "encoding" in spec else "spec"]["encoding"]["color"]["field"] == "variant"
    values = spec["data"]["values"]
    assert {row["variant"] for row in values} == {"plain", "meanpool", "plain-seed1", "distilled"}
    assert {int(row["epoch"]) for row in values} == {1}  # epochs count from 1


def test_the_plots_page_made_from_the_offline_template_loads_nothing_from_a_network(repo, tmp_path):
    """`make plots`: Vega inline instead of DVC's CDN script tags, and every plot's vegaEmbed call kept."""
    template = tmp_path / "offline.html"
    subprocess.run([sys.executable, "-m", "mtbert.offline_plots", str(template)], cwd=REPO_ROOT, check=True,
                   capture_output=True)
    dvc(repo, "plots", "show", "--html-template", str(template), "-o", str(tmp_path / "page"))
    page = (tmp_path / "page" / "index.html").read_text(encoding="utf-8")
    assert "<script src=" not in page and "cdn.jsdelivr.net" not in page
    assert "window.vegaEmbed=" in page and page.count("vegaEmbed('#") == 6  # the curves, 4 confusions, 1 scatter


def test_queued_experiments_run_and_show_with_their_metrics(repo):
    subprocess.run([*GIT, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-qm", "lock"], cwd=repo, check=True)  # queued runs start from HEAD
    for name, members in (("one-member", 1), ("two-members", 2)):
        dvc(repo, "exp", "run", "--queue", "-n", name, "-S", "ensemble.method=greedy",
            "-S", f"ensemble.max_members={members}")  # max_members bounds greedy; uniform takes every candidate
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
        assert "plain" in data["metrics"]["metrics/stats.json"]["data"]["groups"]


def test_a_recipe_runs_as_one_named_experiment_in_the_workspace(repo, tmp_path):
    """`make best`'s command (python -m mtbert.recipes) on a recipe of two overrides: one `dvc exp run`,
    listed by `dvc exp show` with the recipe's params and the metrics they gave, its params in the workspace."""
    copy = copy_repo(repo, tmp_path / "repo")
    subprocess.run([*GIT, "add", "-A"], cwd=copy, check=True)
    # with the queue test run before, its commit already holds the lock
    subprocess.run([*GIT, "commit", "-qm", "lock", "--allow-empty"], cwd=copy, check=True)
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "greedy-one.yaml").write_text("description: the single best member per task\n"
                                             "overrides: [ensemble.method=greedy, ensemble.max_members=1]\n")
    subprocess.run([sys.executable, "-m", "mtbert.recipes", "greedy-one", "--name", "from-a-recipe",
                    "--recipes-dir", str(recipes)], cwd=copy, env=dvc_env(), check=True, capture_output=True)
    shown = json.loads(dvc(copy, "exp", "show", "--json"))
    experiments = {exp["name"]: exp for commit in shown for exp in (commit.get("experiments") or [])}
    data = experiments["from-a-recipe"]["revs"][0]["data"]
    assert data["params"]["params.yaml"]["data"]["ensemble"] == {
        **yaml.safe_load((repo / "params.yaml").read_text())["ensemble"], "method": "greedy", "max_members": 1}
    ensemble = data["metrics"]["metrics/ensemble.json"]["data"]
    assert all(sum(ensemble[task]["members"].values()) == 1 for task in TASK_NAMES)
    assert yaml.safe_load((copy / "params.yaml").read_text())["ensemble"]["max_members"] == 1
    assert "up to date" in dvc(copy, "status")  # the workspace holds the experiment's outputs


# --- the trained models on new text: `mtbert predict` and its API (mtbert/inference.py) -----------------
def dev_texts(repo: Path, task: str) -> tuple[list[str], list[tuple[str, ...]]]:
    """The ids and texts of a task's dev split, in the split's row order (the dumps' order)."""
    table = pq.read_table(repo / "data" / "tokenized" / "plain" / f"{task}-dev.parquet")
    columns = yaml.safe_load((repo / "params.yaml").read_text())["tasks"][task]["text"]
    return table.column("id").to_pylist(), list(zip(*(table.column(c).to_pylist() for c in columns), strict=True))


def dump_values(path: Path) -> list[list[float]]:
    table = pq.read_table(path)
    return [list(row) for row in zip(*(table.column(c).to_pylist() for c in table.column_names
                                       if c.startswith("prob") or c == "score"), strict=True)]


def mtbert(repo: Path, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """The command, on one thread as the repo's `predict` ran (runtime.threads 1): fp32 kernels round
    differently with another thread count."""
    return subprocess.run([sys.executable, "-m", "mtbert.cli", "predict", "--threads", "1", *args], cwd=repo,
                          input=stdin, capture_output=True, text=stdin is None)


def in_process(repo: Path, *args: str) -> subprocess.CompletedProcess:
    """`mtbert(repo, ...)` in this process (tests/commands.py); the paths given must be absolute."""
    return mtbert_in_process("predict", "--threads", "1", *args)


@pytest.fixture
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_api_on_dev_rows_gives_the_predict_dumps_bit_for_bit(repo, task, one_thread):
    from mtbert.inference import EnsemblePredictor, Predictor

    _, texts = dev_texts(repo, task)
    values = Predictor.load(repo / "models" / "plain", batch_size=8).values(task, texts)
    expected = dump_values(repo / "data" / "predictions" / "plain" / f"{task}-dev.parquet")
    assert values.reshape(len(texts), -1).tolist() == expected
    ensemble = EnsemblePredictor.load(repo / "metrics" / "ensemble.json", repo / "models", batch_size=8)
    expected = dump_values(repo / "data" / "ensemble" / f"{task}-dev.parquet")
    assert ensemble.values(task, texts).reshape(len(texts), -1).tolist() == expected


def test_command_reads_files_and_arguments_and_matches_the_dumps(repo, tmp_path):
    ids, texts = dev_texts(repo, "sts")
    lines = "".join(json.dumps({"id": i, "sentence1": a, "sentence2": b}) + "\n"
                    for i, (a, b) in zip(ids, texts, strict=True))
    (tmp_path / "pairs.jsonl").write_text(lines, encoding="utf-8")
    result = mtbert(repo, "--model", "models/plain", "--task", "sts", "--task", "qqp", "--batch-size", "8",
                    "--input", str(tmp_path / "pairs.jsonl"), "--output", str(tmp_path / "out.jsonl"))
    assert result.returncode == 0, result.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["id"] for row in out] == ids
    expected = dump_values(repo / "data" / "predictions" / "plain" / "sts-dev.parquet")
    assert [[row["sts"]["score"]] for row in out] == expected
    assert set(out[0]["qqp"]) == {"prob", "label"} and out[0]["sentence1"] == texts[0][0]
    tsv = "sentence1\tsentence2\n" + "".join(f"{a}\t{b}\n" for a, b in texts)
    from_stdin = mtbert(repo, "--ensemble", "metrics/ensemble.json", "--task", "sts", "--batch-size", "8",
                        "--input", "-", stdin=tsv.encode())
    expected = dump_values(repo / "data" / "ensemble" / "sts-dev.parquet")
    assert [[json.loads(line)["sts"]["score"]] for line in from_stdin.stdout.splitlines()] == expected
    arguments = mtbert(repo, "--model", "models/plain", "--task", "sst", "A gorgeous, witty film.", "Dull.")
    rows = [json.loads(line) for line in arguments.stdout.splitlines()]
    assert arguments.returncode == 0 and len(rows) == 2 and sum(rows[0]["sst"][f"prob_{c}"] for c in range(5)) == \
        pytest.approx(1.0)


def test_a_bad_model_folder_is_one_line_naming_what_is_wrong(repo, tmp_path):
    import re

    broken = tmp_path / "broken"
    shutil.copytree(repo / "models" / "plain", broken)
    (broken / "epoch-1" / "heads.safetensors").unlink()
    old = tmp_path / "old"
    shutil.copytree(repo / "models" / "plain", old, copy_function=shutil.copyfile)  # writable: DVC's are not
    config = json.loads((old / "mtbert.json").read_text())
    (old / "mtbert.json").write_text(json.dumps({**config, "format": 1}))
    # the first as a process of its own (its stderr is what a user sees), the others in this process
    for folder, message, run in ((broken, r"epoch-1/heads.safetensors is missing", mtbert),
                                 (old, r"a model folder of format 1; this mtbert reads format 3", in_process),
                                 (tmp_path / "none", r"none/mtbert.json is missing", in_process)):
        result = run(repo, "--model", str(folder), "--task", "sst", "a film", "--output", str(tmp_path / "o"))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and re.search(message, lines[0]), result.stderr
        assert not (tmp_path / "o").exists()
