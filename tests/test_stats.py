"""Seed groups, their statistics and bootstrap intervals, per-task epoch choice, ensemble methods and
candidates, metric rounding and the README's generated results, on hand-made dumps and metrics."""

import json
import subprocess

import numpy as np
import pytest
import yaml

from mtbert import io
from mtbert.evaluation.candidates import candidates, require_test_snapshots
from mtbert.evaluation.ensemble import every_method, method_name, select
from mtbert.evaluation.predictions import write_dump
from mtbert.evaluation.report import results_block, results_table, splice
from mtbert.evaluation.seeds import compare_groups, group_statistics, seed_groups
from mtbert.evaluation.selection import chosen_epochs, chosen_metrics
from mtbert.params import EnsembleParams
from mtbert.runtime import MissingInputError
from tests.conftest import REPO_ROOT, TASKS

SST, QQP, STS = TASKS["sst"], TASKS["qqp"], TASKS["sts"]


def options(**overrides) -> EnsembleParams:
    values = {"method": "greedy", "criterion": "metric", "snapshots": False, "max_members": 9,
              "with_replacement": True}
    return EnsembleParams(**{**values, **overrides})


def test_variants_differing_only_in_seed_form_a_group():
    raw = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    raw["models"] = {"base": {}, "seed1": {"train": {"seed": 1}}, "shared": {"model": {"arch": "shared"}},
                     "shared-s1": {"model": {"arch": "shared"}, "train": {"seed": 1}},
                     "fast": {"runtime": {"threads": 1}}}  # runtime changes no result: same group
    assert seed_groups(raw) == {"base": ["base", "seed1", "fast"], "shared": ["shared", "shared-s1"]}


def test_group_statistics_equal_a_direct_numpy_computation():
    rng = np.random.default_rng(0)
    per_variant = [{"sst": {"accuracy": a, "macro_f1": f}, "qqp": {"accuracy": q, "f1": q},
                    "sts": {"pearson": p, "spearman": p}, "overall": (a + q + p) / 3}
                   for a, f, q, p in rng.random((3, 4))]
    statistics = group_statistics(per_variant, TASKS)
    accuracies = np.array([v["sst"]["accuracy"] for v in per_variant])
    assert statistics["sst"]["accuracy"] == pytest.approx({"mean": accuracies.mean(), "std": accuracies.std(ddof=1),
                                                          "min": accuracies.min(), "max": accuracies.max()})
    overall = np.array([v["overall"] for v in per_variant])
    assert statistics["overall"]["std"] == pytest.approx(overall.std(ddof=1))
    assert group_statistics(per_variant[:1], TASKS)["sts"]["pearson"]["std"] == 0.0


def binary_predictions(labels: np.ndarray, accuracy: float, rng) -> np.ndarray:
    """P(label 1) that is right on a random `accuracy` share of the rows."""
    right = rng.random(len(labels)) < accuracy
    return np.where(right == (labels == 1), 0.9, 0.1)


def bootstrap_case(accuracy_a: float, accuracy_b: float, rows: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    labels = {"qqp": rng.integers(0, 2, rows).astype(float)}
    group_a = {"qqp": [binary_predictions(labels["qqp"], accuracy_a, rng) for _ in range(3)]}
    group_b = {"qqp": [binary_predictions(labels["qqp"], accuracy_b, rng) for _ in range(3)]}
    return compare_groups({"qqp": QQP}, group_a, group_b, labels, resamples=400, confidence=0.95)["qqp"]


def test_bootstrap_interval_covers_the_true_difference_and_excludes_zero_for_a_clear_winner():
    clear = bootstrap_case(0.85, 0.75, rows=2000, seed=1)  # true difference 0.10
    assert clear["low"] < 0.10 < clear["high"] and clear["excludes_zero"]
    assert clear["low"] < clear["difference"] < clear["high"]
    covered = [case["low"] <= 0.0 <= case["high"] for case in (bootstrap_case(0.8, 0.8, 1000, s) for s in range(10))]
    assert sum(covered) >= 8  # no true difference: the 95% interval holds 0 in (nearly) every case


def test_bootstrap_is_deterministic_and_overall_averages_the_tasks():
    rng = np.random.default_rng(3)
    labels = {"qqp": rng.integers(0, 2, 300).astype(float), "sts": rng.random(300) * 5}
    a = {"qqp": [binary_predictions(labels["qqp"], 0.8, rng)], "sts": [labels["sts"] + rng.normal(0, 1, 300)]}
    b = {"qqp": [binary_predictions(labels["qqp"], 0.7, rng)], "sts": [labels["sts"] + rng.normal(0, 2, 300)]}
    tasks = {"qqp": QQP, "sts": STS}
    first = compare_groups(tasks, a, b, labels, resamples=200, confidence=0.9)
    assert first == compare_groups(tasks, a, b, labels, resamples=200, confidence=0.9)
    mean_difference = (first["qqp"]["difference"] + first["sts"]["difference"]) / 2
    assert first["overall"]["difference"] == pytest.approx(mean_difference)


def history(*scores) -> list[dict]:
    """Epoch records with the headline metrics (sst accuracy, qqp accuracy, sts pearson) given per epoch."""
    records = []
    for sst, qqp, sts in scores:
        dev = {"sst": {"accuracy": sst, "macro_f1": 0.0}, "qqp": {"accuracy": qqp, "f1": 0.0},
               "sts": {"pearson": sts, "spearman": 0.0}}
        records.append({"dev": {**dev, "overall": (sst + qqp + sts) / 3}})
    return records


def test_each_task_keeps_its_own_best_epoch_or_all_the_best_overall():
    epochs = history((0.40, 0.80, 0.85), (0.50, 0.79, 0.86), (0.47, 0.82, 0.87))
    assert chosen_epochs(epochs, TASKS, "task") == {"sst": 2, "qqp": 3, "sts": 3}
    assert chosen_epochs(epochs, TASKS, "overall") == {"sst": 3, "qqp": 3, "sts": 3}
    dev = chosen_metrics(epochs, TASKS, {"sst": 2, "qqp": 3, "sts": 3})
    assert dev["overall"] == pytest.approx((0.50 + 0.82 + 0.87) / 3) and dev["sst"]["accuracy"] == 0.50
    tie = history((0.5, 0.8, 0.8), (0.5, 0.8, 0.8))
    assert chosen_epochs(tie, TASKS, "task") == {"sst": 1, "qqp": 1, "sts": 1}  # a tie keeps the earlier epoch


def test_uniform_averages_every_candidate_and_smooth_greedy_uses_log_loss():
    labels = np.array([1, 0, 1, 0, 1, 1], dtype=float)
    predictions = {"a": np.array([0.9, 0.1, 0.6, 0.4, 0.9, 0.9]), "b": np.array([0.6, 0.4, 0.9, 0.1, 0.6, 0.6]),
                   "c": np.array([0.55, 0.45, 0.55, 0.45, 0.55, 0.55])}
    uniform = select(QQP, predictions, labels, options(method="uniform"))
    assert uniform.members == ["a", "b", "c"]
    # All three are 100% accurate: the metric cannot tell them apart, the log-loss can.
    by_metric = select(QQP, predictions, labels, options(max_members=1))
    by_loss = select(QQP, predictions, labels, options(criterion="smooth", max_members=1))
    assert by_metric.members == ["a"] and by_loss.members == ["a"]
    assert by_loss.score == pytest.approx(-QQP.kind.smooth_loss(predictions["a"], labels))
    two = select(QQP, predictions, labels, options(criterion="smooth", max_members=3))
    assert "c" not in two.members  # a near-0.5 member only raises the log-loss
    assert [method_name(m) for m in every_method(options())] == [
        "uniform", "greedy-metric", "greedy-smooth", "uniform+snapshots", "greedy-metric+snapshots",
        "greedy-smooth+snapshots"]


def test_snapshots_enter_the_candidates_only_when_enabled(tmp_path):
    ids = np.array(["a", "b", "c"], dtype=object)
    for variant, chosen in (("base", 2), ("seed1", 1)):
        write_dump(tmp_path / "predictions" / variant, QQP, "dev", ids, np.array([0.1, 0.5, 0.9]))
        for epoch in (1, 2):
            write_dump(tmp_path / "snapshots" / variant / f"epoch-{epoch}", QQP, "dev", ids[::-1],
                       np.array([0.3, 0.2, epoch / 10]))
        io.write_json(tmp_path / "snapshots" / variant / "chosen.json", {"qqp": chosen})
    plain = candidates(tmp_path / "predictions", tmp_path / "snapshots", ["base", "seed1"], QQP, "dev", ids, False)
    assert sorted(plain) == ["base", "seed1"]
    with_snapshots = candidates(tmp_path / "predictions", tmp_path / "snapshots", ["base", "seed1"], QQP, "dev", ids,
                                True)
    # each variant's other epochs join; the kept epoch is the variant's own dump already
    assert sorted(with_snapshots) == ["base", "base@epoch-1", "seed1", "seed1@epoch-2"]
    assert with_snapshots["base@epoch-1"].tolist() == [0.1, 0.2, 0.3]  # aligned to the ids' order
    # train wrote no epoch's test predictions (train.snapshot_test: false): the error says which knob writes them
    with pytest.raises(MissingInputError, match=r"base/epoch-1/qqp-test.parquet is missing: ensemble.snapshots: "
                                                 r"true .* train.snapshot_test: true"):
        require_test_snapshots(tmp_path / "snapshots", ["base", "seed1"], [QQP])
    for variant in ("base", "seed1"):
        for epoch in (1, 2):
            write_dump(tmp_path / "snapshots" / variant / f"epoch-{epoch}", QQP, "test", ids, np.array([0.3, 0.2, 0.1]))
    require_test_snapshots(tmp_path / "snapshots", ["base", "seed1"], [QQP])  # every epoch has its test dumps
    write_dump(tmp_path / "predictions" / "base", QQP, "test", ids, np.array([0.1, 0.5, 0.9]))
    with_test = candidates(tmp_path / "predictions", tmp_path / "snapshots", ["base"], QQP, "test", ids, True)
    assert sorted(with_test) == ["base", "base@epoch-1"] and with_test["base@epoch-1"].tolist() == [0.3, 0.2, 0.1]


def test_metrics_are_stored_at_four_significant_digits(tmp_path):
    io.write_metrics(tmp_path / "m.json", {"r": 0.8634110420920248, "n": 3047, "l": [1234.5678, 1e-7], "s": "x"})
    assert json.loads((tmp_path / "m.json").read_text()) == {"r": 0.8634, "n": 3047, "l": [1235.0, 1e-7], "s": "x"}
    io.write_metrics(tmp_path / "again.json", {"r": 0.8634110420920249, "n": 3047, "l": [1234.5678, 1e-7], "s": "x"})
    assert (tmp_path / "m.json").read_bytes() == (tmp_path / "again.json").read_bytes()


def committed(path: str) -> str:
    """A file as the last commit holds it: `dvc repro` rewrites the working tree's metrics on any machine."""
    return subprocess.run(["git", "show", f"HEAD:{path}"], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.skipif(not (REPO_ROOT / ".git").exists(), reason="needs the git history of a clone")
def test_readme_results_are_generated_from_the_committed_metrics():
    readme = committed("README.md")
    block = results_block(json.loads(committed("metrics/stats.json")), json.loads(committed("metrics/ensemble.json")))
    assert splice(readme, block) == readme, "README results are stale: run `make results` and commit"


def test_results_rows_show_the_seed_spread_only_where_there_are_seeds():
    def group(values):
        spread = {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
                  "min": min(values), "max": max(values)}
        return {"variants": [f"s{i}" for i in range(len(values))], "dev": {"sst": {"accuracy": spread},
                "overall": spread}, "epochs": {"sst": {"mean": 2.0, "std": 0.0, "min": 2, "max": 2}}}
    stats = {"tasks": {"sst": "accuracy"}, "groups": {"one": group([0.5]), "two": group([0.5, 0.6])}}
    ensemble = {"sst": {"accuracy": 0.55, "members": {"s0": 1}, "single_best": {"s0": 0.5}}, "overall": 0.55,
                "method": "uniform",
                "methods": {"uniform": {"sst": 0.54, "overall": 0.54}}}
    one, two = results_table(stats, ensemble).splitlines()[2:4]
    assert one == ("| `one`: 1 seed(s), single model, no seed spread (epochs kept: sst 2), chosen on dev | 0.500 | "
                   "0.500 |")
    assert two == ("| `two`: 2 seed(s), single model, mean ± std (epochs kept: sst 2), chosen on dev | 0.550 ± 0.071 | "
                   "0.550 ± 0.071 |")
    stats["groups"]["two"]["honest"] = {"sst": group([0.4, 0.5])["dev"]["overall"],
                                        "overall": group([0.4, 0.5])["dev"]["overall"]}
    assert results_table(stats, ensemble).splitlines()[4] == \
           "| `two`, honest estimate | 0.450 ± 0.071 | 0.450 ± 0.071 |"


def test_an_epoch_choice_is_estimated_on_the_half_of_dev_it_was_not_made_on():
    """Epoch 2 wins on each half it is chosen on, so each half scores epoch 2's predictions; a model whose
    best epoch differs by half scores the other half's choice on each."""
    from mtbert.data.kinds import Binary
    from mtbert.data.tasks import Task
    from mtbert.evaluation.ensemble import dev_halves, honest_epoch_choice

    task = Task(name="qqp", file_prefix="quora", split_files={}, text_columns=("a", "b"), label_column="y",
                kind=Binary(), headline="accuracy", submission_file="para", submission_column="p")
    ids = np.array([f"r{i}" for i in range(40)])
    labels = np.array([i % 2 for i in range(40)], dtype=float)
    half_b = dev_halves(ids)
    right, wrong = labels.copy(), 1 - labels
    assert honest_epoch_choice(task, [wrong, right], labels, ids)["score"] == 1.0
    # epoch 1 right on half A only, epoch 2 on half B only: each half picks the epoch right on it, wrong on the other
    first, second = np.where(half_b, wrong, right), np.where(half_b, right, wrong)
    estimate = honest_epoch_choice(task, [first, second], labels, ids)
    assert estimate["score"] == 0.0 and estimate["halves"] == [0.0, 0.0]


def test_results_show_the_ensembles_members_together_mean_and_std_over_them():
    stats = {"tasks": {"sst": "accuracy", "sts": "pearson"}, "groups": {}}
    ensemble = {"sst": {"accuracy": 0.55, "members": {"a": 2, "b": 1}, "single_best": {"a": 0.5, "b": 0.6}},
                "sts": {"pearson": 0.85, "members": {"a": 1, "b": 1}, "single_best": {"a": 0.8, "b": 0.9}},
                "overall": 0.7, "method": "greedy", "methods": {}}
    row = results_table(stats, ensemble).splitlines()[2]
    assert row == ("| the ensemble's members (`a`, `b`), mean ± std over the members | 0.550 ± 0.071 | "
                   "0.850 ± 0.071 | 0.700 ± 0.071 |")  # overall: a 0.65, b 0.75
    ensemble["sst"]["members"] = ensemble["sts"]["members"] = {"a": 1}
    assert "members" not in results_table(stats, ensemble)  # one member: nothing to average
