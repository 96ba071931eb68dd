"""Greedy ensemble selection, the honest estimate, metrics and submission files on hand-made dumps."""

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from scipy import stats

from mtbert.deploy.members import average
from mtbert.evaluation.ensemble import dev_halves, greedy_select, honest_estimate
from mtbert.evaluation.metrics import headline, overall, task_metrics
from mtbert.evaluation.plots import write_plot_tables
from mtbert.evaluation.predictions import read_dump, submission_path, write_dump, write_submission
from mtbert.params import EnsembleParams
from mtbert.runtime import MissingInputError
from tests.conftest import TASKS

LABELS = np.array([1, 1, 0, 0, 1, 0, 1, 0], dtype=float)
SST, QQP, STS = TASKS["sst"], TASKS["qqp"], TASKS["sts"]


def ensemble_options(**overrides) -> EnsembleParams:
    options = {"method": "greedy", "criterion": "metric", "snapshots": False, "max_members": 9,
               "with_replacement": True}
    return EnsembleParams(**{**options, **overrides})


def qqp_metrics(values: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    return task_metrics(QQP, values, labels)


def probs(*values) -> np.ndarray:
    return np.array(values, dtype=float)


def test_greedy_starts_from_the_best_single_and_adds_what_helps():
    predictions = {
        # 6/8 right; wrong on rows 0 and 2
        "a": probs(0.4, 0.9, 0.6, 0.1, 0.9, 0.1, 0.9, 0.1),
        # 5/8 right; confident where a is wrong, wrong on rows 4, 5, 6
        "b": probs(0.9, 0.9, 0.1, 0.1, 0.4, 0.6, 0.4, 0.1),
        # 4/8: useless
        "c": probs(0.6, 0.4, 0.6, 0.4, 0.6, 0.4, 0.4, 0.6),
    }
    selection = greedy_select(QQP, predictions, LABELS, max_members=5, with_replacement=True)
    assert selection.members[0] == "a"
    assert selection.members[:2] == ["a", "b"]  # a + b averaged: 8/8
    assert selection.score == 1.0
    assert "c" not in selection.members


def test_greedy_never_lowers_the_dev_metric():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 200).astype(float)
    predictions = {f"m{i}": np.clip(labels * 0.3 + rng.random(200) * 0.7, 0, 1) for i in range(6)}
    selection = greedy_select(QQP, predictions, labels, max_members=9, with_replacement=True)
    best_single = max(qqp_metrics(v, labels)["accuracy"] for v in predictions.values())
    scores = [qqp_metrics(average(predictions, selection.members[:k]), labels)["accuracy"]
              for k in range(1, len(selection.members) + 1)]
    assert scores[0] == best_single
    assert all(later >= earlier for earlier, later in zip(scores, scores[1:], strict=False))
    assert scores[-1] == selection.score


def test_a_duplicate_model_adds_nothing():
    a = probs(0.4, 0.9, 0.6, 0.1, 0.9, 0.1, 0.9, 0.1)
    selection = greedy_select(QQP, {"a": a, "a_copy": a.copy()}, LABELS, max_members=5, with_replacement=True)
    assert selection.members == ["a"]


def test_without_replacement_each_model_is_used_once():
    a = probs(0.4, 0.9, 0.6, 0.1, 0.9, 0.1, 0.9, 0.1)
    b = probs(0.9, 0.9, 0.1, 0.1, 0.4, 0.6, 0.4, 0.1)
    selection = greedy_select(QQP, {"a": a, "b": b}, LABELS, max_members=5, with_replacement=False)
    assert sorted(selection.members) == ["a", "b"]


def test_sts_ensemble_averages_scores_and_uses_pearson():
    gold = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    noise = np.array([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    predictions = {"x": gold + noise, "y": gold - noise}
    selection = greedy_select(STS, predictions, gold, max_members=4, with_replacement=True)
    assert sorted(selection.counts()) == ["x", "y"]
    assert selection.score == pytest.approx(1.0)


def test_honest_estimate_selects_and_scores_on_disjoint_halves():
    ids = np.array([f"id{i}" for i in range(400)])
    half_b = dev_halves(ids)
    assert 150 < half_b.sum() < 250
    assert np.array_equal(half_b, dev_halves(ids))  # fixed by the ids, not by chance
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, 400).astype(float)
    # "lucky_a" is perfect on half A and coin-flip on half B: selection on A must not help on B.
    lucky = np.where(half_b, rng.random(400), labels * 0.8 + 0.1)
    fair = np.clip(labels * 0.2 + rng.random(400) * 0.8, 0, 1)
    # One member per half, so the chosen model is simply the best on the selecting half.
    estimate = honest_estimate(QQP, {"lucky_a": lucky, "fair": fair}, labels, ids, ensemble_options(max_members=1))
    assert estimate["half_sizes"] == [int((~half_b).sum()), int(half_b.sum())]
    a_selected_score_on_b = qqp_metrics(lucky[half_b], labels[half_b])["accuracy"]
    assert estimate["halves"][0] == pytest.approx(a_selected_score_on_b)  # chosen on A, scored on B only
    chosen_on_b = max(("lucky_a", lucky), ("fair", fair),
                      key=lambda item: qqp_metrics(item[1][half_b], labels[half_b])["accuracy"])[1]
    assert estimate["halves"][1] == pytest.approx(qqp_metrics(chosen_on_b[~half_b], labels[~half_b])["accuracy"])
    assert estimate["score"] < qqp_metrics(lucky, labels)["accuracy"]


def test_metrics_match_a_direct_computation():
    rng = np.random.default_rng(2)
    gold = rng.random(50) * 5
    scores = gold + rng.normal(0, 1, 50)
    sts = task_metrics(STS, scores, gold)
    assert sts["pearson"] == pytest.approx(stats.pearsonr(scores, gold)[0])
    assert sts["spearman"] == pytest.approx(stats.spearmanr(scores, gold)[0])
    sst_labels = np.array([0, 1, 2, 3, 4, 4])
    sst_probs = np.eye(5)[[0, 1, 2, 3, 3, 4]]
    sst = task_metrics(SST, sst_probs, sst_labels)
    assert sst["accuracy"] == pytest.approx(5 / 6)
    # per-class F1: 1, 1, 1, 2/3 (class 3: tp 1, fp 1), 2/3 (class 4: tp 1, fn 1)
    assert sst["macro_f1"] == pytest.approx((3 + 4 / 3) / 5)
    qqp = qqp_metrics(np.array([0.9, 0.2, 0.7, 0.4]), np.array([1, 0, 0, 1]))
    assert qqp == {"accuracy": 0.5, "f1": 0.5}
    assert overall({"sst": sst, "qqp": qqp, "sts": sts}, TASKS) == pytest.approx((5 / 6 + 0.5 + sts["pearson"]) / 3)
    assert [headline(SST, sst_probs, sst_labels), headline(STS, scores, gold)] == [sst["accuracy"], sts["pearson"]]


def test_dumps_round_trip_and_submissions_have_every_test_id_once(tmp_path):
    ids = np.array(["a", "b", "c"], dtype=object)
    sst = np.array([[0.1, 0.2, 0.3, 0.2, 0.2], [0.5, 0.1, 0.1, 0.1, 0.2], [0, 0, 0, 0, 1.0]])
    write_dump(tmp_path, SST, "test", ids, sst)
    back_ids, back = read_dump(tmp_path, SST, "test")
    assert back_ids.tolist() == ["a", "b", "c"] and np.array_equal(back, sst)
    write_submission(tmp_path, SST, "test", ids, sst, rejected_ids=["z"])
    assert submission_path(tmp_path, SST, "test") == tmp_path / "sst-test-output.csv"
    frame = pd.read_csv(submission_path(tmp_path, SST, "test"))
    assert list(frame.columns) == ["id", "Predicted_Sentiment"]
    assert frame["id"].tolist() == ["a", "b", "c", "z"] and frame["id"].is_unique
    assert frame["Predicted_Sentiment"].tolist()[:3] == [2, 0, 4]
    write_submission(tmp_path, STS, "test", ids, np.array([1.0, 2.5, 4.25]))
    sts = pd.read_csv(submission_path(tmp_path, STS, "test"))
    assert sts.columns.tolist() == ["id", "Predicted_Similiarity"] and sts.iloc[:, 1].tolist() == [1.0, 2.5, 4.25]
    write_submission(tmp_path, QQP, "test", ids, np.array([0.2, 0.5, 0.9]))
    qqp = pd.read_csv(tmp_path / "para-test-output.csv")
    assert qqp.columns.tolist() == ["id", "Predicted_Is_Paraphrase"] and qqp.iloc[:, 1].tolist() == [0, 1, 1]


def test_binary_and_regression_dumps_hold_one_value_column(tmp_path):
    ids = np.array(["a", "b"], dtype=object)
    write_dump(tmp_path, QQP, "dev", ids, np.array([0.25, 0.75]))
    write_dump(tmp_path, STS, "dev", ids, np.array([1.5, 4.0]))
    qqp, sts = pq.read_table(tmp_path / "qqp-dev.parquet"), pq.read_table(tmp_path / "sts-dev.parquet")
    assert qqp.column_names == ["id", "prob", "label"] and qqp.column("label").to_pylist() == [0, 1]
    assert sts.column_names == ["id", "score", "label"] and sts.column("label").to_pylist() == [1.5, 4.0]
    assert read_dump(tmp_path, QQP, "dev")[1].tolist() == [0.25, 0.75]
    assert read_dump(tmp_path, STS, "dev")[1].tolist() == [1.5, 4.0]
    with pytest.raises(MissingInputError, match=r"sst-dev.parquet is missing"):
        read_dump(tmp_path, SST, "dev")


def test_plot_tables_are_written_per_kind_of_plot(tmp_path):
    write_plot_tables(tmp_path, SST, np.eye(5)[[0, 3, 4]], np.array([0, 2, 4]))
    write_plot_tables(tmp_path, QQP, np.array([0.9, 0.1]), np.array([1.0, 1.0]))
    write_plot_tables(tmp_path, STS, np.array([1.23456, 4.0]), np.array([1.0, 3.8]))
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.csv")) == [
        "confusion/qqp.csv", "confusion/sst.csv", "scatter/sts.csv"]
    sst = pd.read_csv(tmp_path / "confusion" / "sst.csv")
    assert sst.to_dict("list") == {"actual": [0, 2, 4], "predicted": [0, 3, 4]}
    assert pd.read_csv(tmp_path / "confusion" / "qqp.csv").to_dict("list") == {"actual": [1, 1], "predicted": [1, 0]}
    assert pd.read_csv(tmp_path / "scatter" / "sts.csv").to_dict("list") == {"gold": [1.0, 3.8],
                                                                              "predicted": [1.2346, 4.0]}
