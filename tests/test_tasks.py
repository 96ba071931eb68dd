"""Tasks are data: each kind's behaviour on hand-made tensors and arrays, tasks built from params.yaml, and
the validation of every per-task section against the declared tasks."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
import yaml
from scipy import stats

from mtbert.data.kinds import Binary, Classification, Regression
from mtbert.data.tasks import Task, tasks_from_params, tokenized_path
from mtbert.evaluation.metrics import headline, overall, task_metrics
from mtbert.evaluation.predictions import read_dump, to_table, values_of, write_dump, write_submission
from mtbert.params import HeadParams, ModelSpec, ParamsError, as_dict
from mtbert.params_file import parse_params, parse_section, with_changes
from mtbert.per_task import KIND_METRICS
from mtbert.training.losses import BinaryCrossEntropy, CrossEntropy, SquaredError, task_loss
from tests.conftest import REPO_ROOT, TASKS

RAW = HeadParams(pooling="cls", hidden_layers=0, dropout=0.0, loss_weight=1.0, encoding="cross", combine="features",
                 target="raw")
UNIT = with_changes(RAW, target="unit")
NO_TARGET = with_changes(RAW, target=None)


def macro_f1(predicted: np.ndarray, gold: np.ndarray, classes: int) -> float:
    """From the confusion matrix: F1_c = 2 TP / (2 TP + FP + FN), a class with no rows scoring 0."""
    confusion = np.zeros((classes, classes))
    np.add.at(confusion, (gold, predicted), 1)
    tp = np.diag(confusion)
    fp, fn = confusion.sum(0) - tp, confusion.sum(1) - tp
    denominator = 2 * tp + fp + fn
    return float(np.mean(np.where(denominator > 0, 2 * tp / np.maximum(denominator, 1), 0.0)))


# --- the tasks of the repository's params.yaml -----------------------------------------------------
def test_repository_tasks_are_built_from_params():
    assert list(TASKS) == ["sst", "qqp", "sts"]
    sst, qqp, sts = TASKS["sst"], TASKS["qqp"], TASKS["sts"]
    assert isinstance(sst.kind, Classification) and sst.kind.output_size == 5
    assert isinstance(qqp.kind, Binary) and isinstance(sts.kind, Regression)
    assert (sts.kind.low, sts.kind.high) == (0.0, 5.0)
    assert (sst.text_columns, sst.label_column, sst.is_pair) == (("sentence",), "sentiment", False)
    assert (qqp.text_columns, qqp.label_column, qqp.is_pair) == (("sentence1", "sentence2"), "is_duplicate", True)
    assert [t.headline for t in TASKS.values()] == ["accuracy", "accuracy", "pearson"]
    assert [(t.submission_file, t.submission_column) for t in TASKS.values()] == [
        ("sst", "Predicted_Sentiment"), ("para", "Predicted_Is_Paraphrase"), ("sts", "Predicted_Similiarity")]
    raw = Path("raw")
    assert [sst.raw_path(raw, split) for split in ("train", "dev", "test")] == [
        raw / "ids-sst-train.csv", raw / "ids-sst-dev.csv", raw / "ids-sst-test-student.csv"]
    assert qqp.raw_path(raw, "dev") == raw / "quora-dev.csv"
    assert sst.is_labeled("dev") and not sst.is_labeled("test")
    assert tokenized_path("tok", "sst", "dev") == Path("tok") / "sst-dev.parquet"


def test_a_new_task_is_a_declaration():
    raw = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    declaration = {"files": {"prefix": "ratings", "train": "tr", "dev": "va", "test": "te"}, "text": ["review"],
                   "label": "stars", "kind": "regression", "range": [1, 7], "metric": "spearman",
                   "submission": {"file": "rate", "column": "Stars"}}
    raw["tasks"]["rate"] = declaration  # one block: its head and per-task knobs take their defaults
    params = parse_params(raw)
    assert params.heads["rate"] == HeadParams(target="raw")
    assert (params.train.batch_size["rate"], params.train.task_lr_mult["rate"]) == (32, 1.0)
    assert (params.train.max_train_examples["rate"], params.smart.task_weight("rate")) == (0, 0.0)
    tasks = tasks_from_params(params.tasks)
    assert list(tasks) == ["sst", "qqp", "sts", "rate"]
    rate = tasks["rate"]
    assert rate == Task(name="rate", file_prefix="ratings", split_files={"train": "tr", "dev": "va", "test": "te"},
                        text_columns=("review",), label_column="stars", kind=rate.kind, headline="spearman",
                        submission_file="rate", submission_column="Stars")
    assert isinstance(rate.kind, Regression) and rate.kind.label_domain() == (1.0, 7.0, False)
    assert rate.raw_path("d", "test") == Path("d") / "ratings-te.csv"


# --- each kind on hand-made tensors ----------------------------------------------------------------
def test_kinds_declare_sizes_metrics_plots_and_label_types():
    assert Classification(5).output_size == 5 and Classification(3).output_size == 3
    assert Binary().output_size == 1 and Regression(0, 5).output_size == 1
    assert Classification.metric_names == KIND_METRICS["classification"] == ("accuracy", "macro_f1")
    assert Binary.metric_names == KIND_METRICS["binary"] == ("accuracy", "f1")
    assert Regression.metric_names == KIND_METRICS["regression"] == ("pearson", "spearman")
    assert (Classification.plot, Binary.plot, Regression.plot) == ("confusion", "confusion", "scatter")
    assert (Classification.label_type, Binary.label_type, Regression.label_type) == (pa.int64(), pa.int64(),
                                                                                     pa.float64())
    assert Classification(3).label_domain() == (0, 2, True) and Classification(3).describe_domain() == "an integer 0-2"
    assert Binary().label_domain() == (0, 1, True)
    assert Regression(1.0, 7.0).label_domain() == (1.0, 7.0, False)
    assert Regression(1.0, 7.0).describe_domain() == "a number 1.0-7.0"


def test_classification_loss_predictions_and_divergence():
    torch.manual_seed(0)
    kind = Classification(5)
    logits, labels = torch.randn(6, 5) * 3, torch.tensor([0, 1, 2, 3, 4, 4])
    assert torch.equal(kind.head_output(logits, RAW, False), logits)  # (B, C) stay as they are
    torch.testing.assert_close(CrossEntropy().gold(logits, labels), F.cross_entropy(logits, labels))
    torch.testing.assert_close(kind.predictions(logits, None), torch.softmax(logits, -1))
    other = torch.randn(6, 5) * 3
    divergence = kind.divergence(logits, other)
    p, q = torch.softmax(logits, -1), torch.softmax(other, -1)
    expected = (p * (p / q).log()).sum(-1) + (q * (q / p).log()).sum(-1)  # KL(p||q) + KL(q||p)
    torch.testing.assert_close(divergence, expected, rtol=1e-4, atol=1e-5)
    assert divergence.shape == (6,) and (divergence >= 0).all() and (divergence > 0).all()
    assert torch.equal(kind.divergence(logits, logits), torch.zeros(6))


def test_binary_loss_predictions_and_divergence():
    torch.manual_seed(1)
    kind = Binary()
    assert kind.head_output(torch.ones(4, 1), RAW, False).shape == (4,)
    logits, labels = torch.randn(8) * 3, torch.tensor([1, 0, 1, 1, 0, 0, 1, 0])
    expected_loss = -(labels * F.logsigmoid(logits) + (1 - labels) * F.logsigmoid(-logits)).mean()
    torch.testing.assert_close(BinaryCrossEntropy().gold(logits, labels), expected_loss)
    torch.testing.assert_close(BinaryCrossEntropy().gold(logits, labels),
                               F.binary_cross_entropy_with_logits(logits, labels.float()))
    torch.testing.assert_close(kind.predictions(logits, None), 1 / (1 + torch.exp(-logits)))
    other = torch.randn(8) * 3
    p, q = torch.sigmoid(logits), torch.sigmoid(other)
    kl = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    reverse = q * (q / p).log() + (1 - q) * ((1 - q) / (1 - p)).log()
    torch.testing.assert_close(kind.divergence(logits, other), kl + reverse, rtol=1e-4, atol=1e-5)
    assert (kind.divergence(logits, other) >= 0).all()
    assert torch.equal(kind.divergence(logits, logits), torch.zeros(8))


def test_regression_loss_on_the_raw_and_the_unit_target():
    kind = Regression(1.0, 7.0)
    outputs, labels = torch.tensor([0.5, 0.25, 0.9]), torch.tensor([4.0, 1.0, 7.0])
    raw_loss, unit_loss = SquaredError(1.0, 7.0, unit=False), SquaredError(1.0, 7.0, unit=True)
    torch.testing.assert_close(raw_loss.gold(outputs, labels), F.mse_loss(outputs, labels))
    unit_target = (labels - 1.0) / (7.0 - 1.0)  # [0.5, 0, 1]
    torch.testing.assert_close(unit_loss.gold(outputs, labels), F.mse_loss(outputs, unit_target))
    torch.testing.assert_close(unit_loss.gold(outputs, labels), torch.tensor((0.0 + 0.25 ** 2 + 0.1 ** 2) / 3))
    assert torch.equal(kind.predictions(outputs, RAW), outputs)
    torch.testing.assert_close(kind.predictions(outputs, UNIT), torch.tensor([4.0, 2.5, 6.4]))
    # the head's raw output: through a sigmoid for the unit target, as it is for the raw one
    out = torch.tensor([[-2.0], [0.0], [3.0]])
    assert torch.equal(kind.head_output(out, RAW, False), out.squeeze(-1))
    torch.testing.assert_close(kind.head_output(out, UNIT, False), torch.sigmoid(out.squeeze(-1)))
    cosine = torch.tensor([[0.2], [1.0]])
    assert torch.equal(kind.head_output(cosine, UNIT, True), cosine.squeeze(-1))  # cos is the unit score
    torch.testing.assert_close(Regression(0.0, 5.0).head_output(cosine, RAW, True), torch.tensor([1.0, 5.0]))
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.5, 2.0, 1.0])
    torch.testing.assert_close(kind.divergence(a, b), (a - b) ** 2)
    assert torch.equal(kind.divergence(a, a), torch.zeros(3)) and (kind.divergence(a, b) >= 0).all()


def test_classification_metrics_match_a_direct_computation():
    rng = np.random.default_rng(0)
    for classes in (5, 3):
        kind = Classification(classes)
        values = rng.dirichlet(np.ones(classes), size=60)
        labels = rng.integers(0, classes, 60)
        predicted = values.argmax(-1)
        metrics = kind.metrics(values, labels)
        assert list(metrics) == list(kind.metric_names)
        assert metrics["accuracy"] == pytest.approx(np.mean(predicted == labels))
        assert metrics["macro_f1"] == pytest.approx(macro_f1(predicted, labels, classes))
        assert kind.predicted_labels(values).tolist() == predicted.tolist()
        assert kind.value_columns() == [f"prob_{c}" for c in range(classes)]


def test_binary_metrics_match_a_direct_computation():
    rng = np.random.default_rng(1)
    kind = Binary()
    values, labels = rng.random(80), rng.integers(0, 2, 80)
    predicted = (values >= 0.5).astype(int)
    metrics = kind.metrics(values, labels.astype(float))
    assert list(metrics) == ["accuracy", "f1"]
    tp, fp, fn = np.sum((predicted == 1) & (labels == 1)), np.sum((predicted == 1) & (labels == 0)), \
        np.sum((predicted == 0) & (labels == 1))
    assert metrics["accuracy"] == pytest.approx(np.mean(predicted == labels))
    assert metrics["f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert kind.predicted_labels(np.array([0.2, 0.5, 0.7])).tolist() == [0, 1, 1]
    assert kind.predicted_labels(values).dtype == np.int64
    assert kind.value_columns() == ["prob"]


def test_regression_metrics_match_a_direct_computation():
    rng = np.random.default_rng(2)
    kind = Regression(0.0, 5.0)
    gold = rng.random(50) * 5
    values = gold + rng.normal(0, 1, 50)
    metrics = kind.metrics(values, gold)
    assert metrics == pytest.approx({"pearson": stats.pearsonr(values, gold)[0],
                                     "spearman": stats.spearmanr(values, gold)[0]})
    assert kind.metrics(np.full(5, 2.0), gold[:5]) == {"pearson": 0.0, "spearman": 0.0}  # constant: no NaN
    assert kind.predicted_labels(values) is values and kind.value_columns() == ["score"]


def test_label_distributions_and_plot_tables():
    counts = Classification(3).label_distribution(pd.Series([2, 0, 2, 1, 2]))
    assert counts == {"0": 1, "1": 1, "2": 3}
    labels = np.array([1.0, 1.5, 2.0, 3.9, 4.0])
    scores = Regression(1.0, 4.0).label_distribution(pd.Series(labels))
    assert scores["histogram"] == {"1-2": 2, "2-3": 1, "3-4": 2}  # the last bin is closed
    assert scores["mean"] == pytest.approx(2.48) and scores["std"] == pytest.approx(np.std(labels, ddof=1), abs=1e-4)
    table = Classification(3).plot_table(np.eye(3)[[2, 0]], np.array([2.0, 1.0]))
    assert table.to_dict("list") == {"actual": [2, 1], "predicted": [2, 0]}
    scatter = Regression(0.0, 5.0).plot_table(np.array([1.234567]), np.array([1.0]))
    assert scatter.to_dict("list") == {"gold": [1.0], "predicted": [1.2346]}


# --- a three-class task end to end --------------------------------------------------------------------
THREE = dataclasses.replace(TASKS["sst"], name="emo", kind=Classification(3), headline="macro_f1",
                            submission_file="emo", submission_column="Predicted_Feeling")


def test_a_three_class_task_dumps_round_trip(tmp_path):
    ids = np.array(["a", "b", "c"], dtype=object)
    values = np.array([[0.2, 0.5, 0.3], [0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    write_dump(tmp_path, THREE, "dev", ids, values)
    table = pq.read_table(tmp_path / "emo-dev.parquet")
    assert table.column_names == ["id", "prob_0", "prob_1", "prob_2", "label"]
    assert table.column("label").to_pylist() == [1, 0, 2]
    back_ids, back = read_dump(tmp_path, THREE, "dev")
    assert back_ids.tolist() == ids.tolist() and np.array_equal(back, values)
    assert np.array_equal(values_of(THREE, to_table(THREE, ids, values)), values)
    write_submission(tmp_path, THREE, "test", ids, values)
    assert (tmp_path / "emo-test-output.csv").read_text().splitlines() == [
        "id,Predicted_Feeling", "a,1", "b,0", "c,2"]
    labels = np.array([1, 0, 1])
    assert task_metrics(THREE, values, labels)["accuracy"] == pytest.approx(2 / 3)
    assert headline(THREE, values, labels) == pytest.approx(macro_f1(values.argmax(-1), labels, 3))
    per_task = {"emo": task_metrics(THREE, values, labels), "qqp": {"accuracy": 0.5, "f1": 0.1}}
    assert overall(per_task, {"emo": THREE, "qqp": TASKS["qqp"]}) == pytest.approx((headline(THREE, values, labels)
                                                                                   + 0.5) / 2)


def test_a_three_class_task_gets_a_three_way_head(tiny_backbone, tiny_tokenizer):
    from mtbert.model.backbone import load_encoder
    from mtbert.model.multitask import MultitaskModel

    head = HeadParams(pooling="mean", hidden_layers=1, dropout=0.0, loss_weight=1.0, encoding=None, combine=None,
                      target=None)
    torch.manual_seed(0)
    model = MultitaskModel(load_encoder(str(tiny_backbone)), {"emo": THREE}, {"emo": head}).eval()
    batch = tiny_tokenizer(["a happy day", "so so"], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model("emo", dict(batch))
    labels = torch.tensor([2, 1])
    assert out.shape == (2, 3) and model.encoding("emo") == "cross"
    torch.testing.assert_close(task_loss(THREE, head)(out, {"labels": labels}), F.cross_entropy(out, labels))
    torch.testing.assert_close(model.predictions("emo", out).sum(-1), torch.ones(2))


# --- params validated against the declared tasks ---------------------------------------------------
@pytest.fixture
def raw_params() -> dict:
    return yaml.safe_load((REPO_ROOT / "params.yaml").read_text())


def changed(raw: dict, dotted_key: str, value=None, *, delete: bool = False) -> dict:
    raw = copy.deepcopy(raw)
    *parents, last = dotted_key.split(".")
    node = raw
    for parent in parents:
        node = node.setdefault(parent, {})
    if delete:
        del node[last]
    else:
        node[last] = value
    return raw


def fails(raw: dict, message: str) -> None:
    with pytest.raises(ParamsError, match=message):
        parse_params(raw)


HEAD = {"pooling": "mean", "hidden_layers": 1, "dropout": 0.1, "loss_weight": 1.0}


@pytest.mark.parametrize(("key", "value", "message"), [
    ("heads.mnli", HEAD, r"^params: heads.mnli: unknown task; tasks declares sst, qqp, sts$"),
    ("train.batch_size", {"sst": 8, "mnli": 16},
     r"^params: train.batch_size.mnli: unknown task; tasks declares sst, qqp, sts$"),
    ("train.task_lr_mult", {"mnli": 2.0},
     r"^params: train.task_lr_mult.mnli: unknown task; tasks declares sst, qqp, sts$"),
    ("train.max_train_examples", {"mnli": 100},
     r"^params: train.max_train_examples.mnli: unknown task; tasks declares sst, qqp, sts$"),
    ("smart.task_lambda.mnli", 1.0, r"^params: smart.task_lambda.mnli: unknown task; tasks declares sst, qqp, sts$"),
    ("data.unescape_ptb", ["mnli"], r"^params: data.unescape_ptb: unknown task 'mnli'; tasks declares sst, qqp, sts$"),
])
def test_an_unknown_task_name_is_refused_naming_it(raw_params, key, value, message):
    fails(changed(raw_params, key, value), message)


def test_a_task_left_out_of_a_per_task_section_gets_the_default(raw_params):
    raw = changed(raw_params, "train.batch_size", {"qqp": 64})
    raw["smart"]["task_lambda"] = {"sst": 2.0}
    params = parse_params(raw)
    assert params.train.batch_size == {"sst": 32, "qqp": 64, "sts": 32}  # full, in task order
    assert params.smart.task_lambda == {"sst": 2.0, "qqp": None, "sts": None}
    del raw["train"]["task_lr_mult"], raw["train"]["max_train_examples"]
    raw["heads"] = None  # `heads:` with nothing under it
    params = parse_params(raw)  # a per-task key left out: every task gets the default
    assert params.train.task_lr_mult == {"sst": 1.0, "qqp": 1.0, "sts": 1.0}
    assert params.train.max_train_examples == {"sst": 0, "qqp": 0, "sts": 0}
    assert list(params.heads) == ["sst", "qqp", "sts"] and params.heads["sts"].encoding == "cross"


def test_a_declared_task_needs_nothing_but_its_declaration(raw_params):
    raw = changed(raw_params, "tasks.cfimdb", {**raw_params["tasks"]["sst"], "kind": "binary"})
    del raw["tasks"]["cfimdb"]["classes"]
    params = parse_params(raw)
    assert list(params.tasks) == list(params.heads) == list(params.train.batch_size) == ["sst", "qqp", "sts",
                                                                                          "cfimdb"]
    assert params.heads["cfimdb"] == HeadParams()  # one sentence, binary: no encoding, combine or target
    assert params.smart.task_lambda["cfimdb"] is None and params.train.max_train_examples["cfimdb"] == 0


def test_heads_take_the_defaults_of_their_tasks_text_and_kind(raw_params):
    heads = parse_params(changed(raw_params, "heads", {})).heads
    assert heads["sst"] == HeadParams(pooling="mean", hidden_layers=1, dropout=0.0, loss_weight=1.0)
    assert (heads["qqp"].encoding, heads["qqp"].combine, heads["qqp"].target) == ("cross", "features", None)
    assert (heads["sts"].encoding, heads["sts"].combine, heads["sts"].target) == ("cross", "features", "raw")
    heads = parse_params(changed(raw_params, "heads.qqp", {"encoding": "bi", "dropout": 0.1})).heads
    assert (heads["qqp"].encoding, heads["qqp"].combine, heads["qqp"].dropout) == ("bi", "features", 0.1)
    assert heads["sts"].is_bi and heads["sts"].combine == "cosine"  # the repository's, beside an override


@pytest.mark.parametrize(("key", "value", "delete", "message"), [
    ("heads.sst.encoding", "cross", False, r"heads.sst.encoding: task sst has one sentence, so it takes no encoding"),
    ("heads.sst.combine", "features", False, r"heads.sst.combine: task sst has one sentence, so it takes no combine"),
    ("heads.qqp.target", "unit", False, r"heads.qqp.target: expected for regression tasks only \(task qqp is binary"),
    ("heads.sst.target", "raw", False, r"heads.sst.target: expected for regression tasks only \(task sst is class"),
    ("heads.sst.pooling", "first", False, r"heads.sst.pooling: expected 'cls', 'mean', 'max', 'attention' or 'rout"),
    ("heads.sst.dropout", 1.0, False, r"heads.sst.dropout: expected less than 1, got 1.0"),
    ("heads.qqp.bias", True, False, r"unknown key 'heads.qqp.bias'; heads.qqp accepts: pooling, hidden_layers"),
    ("tasks.sts.range", None, True, r"tasks.sts.range: kind regression expects \[lowest, highest\], got None"),
    ("tasks.sts.range", [5, 0], False, r"tasks.sts.range: kind regression expects \[lowest, highest\], got \[5.0"),
    ("tasks.qqp.range", [0, 1], False, r"tasks.qqp.range: expected for kind regression only"),
    ("tasks.sst.classes", None, True, r"tasks.sst.classes: expected for kind classification only, got None"),
    ("tasks.qqp.classes", 2, False, r"tasks.qqp.classes: expected for kind classification only, got 2 with kind bin"),
    ("tasks.sst.classes", 1, False, r"tasks.sst.classes: expected greater than or equal to 2, got 1"),
    ("tasks.qqp.metric", "pearson", False, r"tasks.qqp.metric: kind binary offers accuracy, f1, got 'pearson'"),
    ("tasks.sts.metric", "accuracy", False, r"tasks.sts.metric: kind regression offers pearson, spearman, got 'acc"),
    ("tasks.sst.metric", "f1", False, r"tasks.sst.metric: kind classification offers accuracy, macro_f1, got 'f1'"),
    ("tasks.sst.kind", "ordinal", False, r"tasks.sst.kind: expected 'classification', 'binary' or 'regression'"),
    ("tasks.sst.text", ["a", "b", "c"], False, r"tasks.sst.text: expected one column or two distinct ones"),
    ("tasks.sst.files.dev", None, True, r"missing key 'tasks.sst.files.dev'"),
    ("tasks", {}, False, r"tasks: expected at least one task declaration"),
])
def test_heads_and_declarations_are_checked_against_the_task(raw_params, key, value, delete, message):
    fails(changed(raw_params, key, value, delete=delete), r"^params: " + message)


def test_cosine_is_refused_for_classification_pairs(raw_params):
    raw = changed(raw_params, "tasks.qqp.kind", "classification")
    raw["tasks"]["qqp"]["classes"] = 2
    raw["heads"]["qqp"] = {"encoding": "bi", "combine": "cosine"}
    fails(raw, r"heads.qqp.combine: cosine gives one score, but task qqp has 2 classes; use features")
    raw["heads"]["qqp"]["combine"] = "features"
    assert parse_params(raw).heads["qqp"].is_bi
    binary = changed(raw_params, "heads.qqp.encoding", "bi")
    binary["heads"]["qqp"]["combine"] = "cosine"
    assert parse_params(binary).heads["qqp"].combine == "cosine"  # one logit: cosine is fine


def test_a_variant_may_not_override_tasks(raw_params):
    raw_params["models"] = {"base": {}, "other": {"tasks": {"sst": {"classes": 3}}}}
    fails(raw_params, r"models.other: a variant cannot override 'tasks'")


def test_a_variant_may_not_override_the_rows_the_variants_share(raw_params):
    raw_params["models"] = {"base": {}, "other": {"data": {"raw_dir": "elsewhere"}}}
    fails(raw_params, r"models.other: a variant cannot override 'data'")


def test_a_variant_is_checked_against_the_tasks(raw_params):
    raw_params["models"] = {"base": {}, "typo": {"heads": {"sst": {"encoding": "bi"}}}}
    fails(raw_params, r"models.typo.*heads.sst.encoding: task sst has one sentence")


def test_a_saved_models_spec_is_checked_the_same_way(raw_params):
    params = parse_params(raw_params)
    saved = {"tasks": as_dict(params.tasks), "heads": as_dict(params.heads)}  # as mtbert.json holds them: in full
    spec = parse_section(ModelSpec, saved, "")
    assert list(spec.tasks) == list(spec.heads) == ["sst", "qqp", "sts"]
    assert spec.tasks == params.tasks and spec.heads == params.heads
    heads = changed(saved["heads"], "sts", delete=True)
    with pytest.raises(ParamsError, match=r"^model.json: heads.sts: missing; a saved model names every"):  # no defaults
        parse_section(ModelSpec, {**saved, "heads": heads}, "", source="model.json")
    with pytest.raises(ParamsError, match=r"^model.json: heads.sst.encoding: task sst has one sentence"):
        parse_section(ModelSpec, {**saved, "heads": changed(saved["heads"], "sst.encoding", "bi")}, "",
                      source="model.json")
    with pytest.raises(ParamsError, match=r"tasks"):  # heads for tasks it does not declare
        parse_section(ModelSpec, {"tasks": None, "heads": saved["heads"]}, "")
