"""The transfer set (mtbert/data/transfer.py, stage `transfer`): deterministic, training text only, the configured
size and kinds of rows; and a student's loss over a batch of training and transfer rows."""

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from mtbert.data.batches import load_split
from mtbert.data.transfer import TrainingText, transfer_rows
from mtbert.params import HeadParams, TransferParams
from mtbert.training.distillation import Distillation
from mtbert.training.losses import task_loss
from stages.transfer import app
from tests.conftest import TASKS, make_params

PARAMS = TransferParams(rows={"sst": 10, "qqp": 12, "sts": 12}, sentences_from="others", pairs_from="own",
                        neighbours=0.5, top_k=2, swapped=0.25, weight=1.0, seed=0)


def training_text() -> dict[str, TrainingText]:
    """Training splits small enough to read: STS and QQP pairs over 8 sentences, SST's own 4 sentences."""
    sentences = [f"sentence {i}" for i in range(8)]
    pairs = pd.DataFrame({"sentence1": sentences[:4], "sentence2": sentences[4:]})
    return {"sst": TrainingText.from_table(TASKS["sst"], pd.DataFrame({"sentence": ["good", "bad", "fine", "dull"]})),
            "qqp": TrainingText.from_table(TASKS["qqp"], pairs),
            "sts": TrainingText.from_table(TASKS["sts"], pairs.rename(columns={"sentence2": "sentence1",
                                                                               "sentence1": "sentence2"}))}


def embed(texts: list[str]) -> np.ndarray:
    """Unit vectors on a circle by the sentence's number: a sentence's nearest are the next numbers."""
    angles = np.array([int(text.split()[-1]) for text in texts]) * 0.3
    return np.stack([np.cos(angles), np.sin(angles)], axis=1)


def rows_of(task: str, params: TransferParams = PARAMS, embedder=embed) -> pd.DataFrame:
    return transfer_rows(TASKS[task], training_text(), params, params.rows[task], embedder)


def test_the_same_params_give_the_same_rows_and_another_seed_others():
    for task in ("sst", "qqp", "sts"):
        assert rows_of(task).equals(rows_of(task))
    other = TransferParams(**{**PARAMS.__dict__, "seed": 1})
    assert not rows_of("sts").equals(rows_of("sts", other))


def test_pairs_have_the_configured_size_and_kinds_and_are_new_pairs_of_training_sentences():
    text = training_text()["sts"]
    rows = rows_of("sts")
    assert len(rows) == 12 and rows["id"].tolist() == [f"transfer-sts-{i}" for i in range(12)]
    assert rows["source"].value_counts().to_dict() == {"swapped": 3, "neighbour": 4, "random": 5}
    pairs = list(zip(rows["sentence1"], rows["sentence2"], strict=True))
    training = text.pairs()
    for (a, b), source in zip(pairs, rows["source"], strict=True):
        assert a in text.sentences() and b in text.sentences() and a != b  # training text only
        assert ((b, a) in training) == (source == "swapped") and (a, b) not in training
    assert len({frozenset(pair) for pair in pairs}) == len(pairs)  # no repeat, in either order
    for a, b in (pair for pair, source in zip(pairs, rows["source"], strict=True) if source == "neighbour"):
        assert abs(int(a.split()[-1]) - int(b.split()[-1])) <= 2  # one of the top_k = 2 nearest


def test_without_an_embedder_or_neighbours_every_new_pair_is_random():
    rows = rows_of("qqp", embedder=None)
    assert rows["source"].value_counts().to_dict() == {"random": 9, "swapped": 3}


def test_a_one_sentence_task_gets_other_tasks_sentences_never_its_own_and_stops_when_they_run_out():
    rows = rows_of("sst")
    others = set(training_text()["qqp"].sentences())
    assert len(rows) == 8 and set(rows["sentence"]) == others  # 10 wanted, 8 there
    assert set(rows["source"]) == {"sentence"}


def test_spans_are_new_word_spans_of_the_tasks_own_sentences_and_stop_when_they_run_out():
    sentences = ["the film is not good at all", "a slow , dull and tired story", "fine", "it works"]
    training = {**training_text(), "sst": TrainingText.from_table(TASKS["sst"], pd.DataFrame({"sentence": sentences}))}
    spans = TransferParams(**{**PARAMS.__dict__, "sentences_from": "spans"})
    rows = transfer_rows(TASKS["sst"], training, spans, 10, embed)
    assert len(rows) == 10 and set(rows["source"]) == {"span"} and rows["sentence"].is_unique
    assert rows.equals(transfer_rows(TASKS["sst"], training, spans, 10, embed))
    for span in rows["sentence"]:
        assert 3 <= len(span.split()) < 7 and span not in sentences
        assert any(f" {span} " in f" {sentence} " for sentence in sentences[:2])  # whole words of one sentence
    every_span = transfer_rows(TASKS["sst"], training, spans, 40, embed)  # two 7-word sentences: 2 × (5+4+3+2)
    assert len(every_span) == 28 and every_span["sentence"].is_unique


def run_stage(tmp_path: Path, tiny_backbone: Path, tokenized: Path, distill: dict) -> Path:
    params = make_params(tmp_path, tiny_backbone, Path("unused"), extra={"distill": distill})
    result = CliRunner().invoke(app, ["--params-file", str(params), "--tokenized-dir", str(tokenized),
                                      "--pretrained-dir", str(tiny_backbone), "--out-dir", str(tmp_path / "transfer"),
                                      "--metrics-file", str(tmp_path / "transfer.json")])
    assert result.exit_code == 0, result.output
    return tmp_path / "transfer"


def test_the_stage_reads_only_training_splits_and_writes_tokenized_rows_of_their_text(tmp_path, tiny_backbone,
                                                                                    tiny_tokenized):
    train_only = tmp_path / "train-only"  # no dev or test split to read
    train_only.mkdir()
    for path in tiny_tokenized.glob("*-train.parquet"):
        shutil.copy(path, train_only)
    rows = {"sst": 5, "qqp": 6, "sts": 7}
    out = run_stage(tmp_path, tiny_backbone, train_only,
                    {"enabled": True, "transfer": {"rows": rows, "neighbours": 0.5, "swapped": 0.0}})
    train_text = {text for name, task in TASKS.items() for column in task.text_columns
                  for text in pd.read_parquet(train_only / f"{name}-train.parquet")[column]}
    for name, task in TASKS.items():
        split = load_split(out, task, "transfer")  # as predict reads it
        assert len(split) == rows[name] and np.isnan(split.labels).all()
        table = pd.read_parquet(out / f"{name}-transfer.parquet")
        assert all(set(table[column]) <= train_text for column in task.text_columns)
        if task.is_pair:
            neighbours = round(rows[name] * 0.5)
            assert table["source"].value_counts().to_dict() == {"neighbour": neighbours,
                                                                 "random": rows[name] - neighbours}
    report = json.loads((tmp_path / "transfer.json").read_text())
    assert report["sts"] == {"rows": 7, "sources": {"neighbour": 4, "random": 3}}


def test_switched_off_the_stage_writes_empty_tables(tmp_path, tiny_backbone, tiny_tokenized):
    out = run_stage(tmp_path, tiny_backbone, tiny_tokenized, {"enabled": False})
    assert all(len(load_split(out, task, "transfer")) == 0 for task in TASKS.values())


# --- the student's loss over training and transfer rows ---------------------------------------------------------
HEADS = {"sst": HeadParams(), "sts": HeadParams(encoding="cross", combine="features", target="raw")}


def test_a_transfer_row_is_taught_only_and_a_batch_is_the_mean_over_its_rows():
    student_loss = Distillation(teacher={}, alpha=0.25, temperature=1.0, transfer_weight=2.0).losses(
        {"sts": task_loss(TASKS["sts"], HEADS["sts"])})["sts"]
    outputs = torch.tensor([1.0, 2.0, 4.0, 0.0])
    teacher, labels = torch.tensor([2.0, 2.0, 3.0, 1.0]), torch.tensor([0.0, 4.0, float("nan"), float("nan")])
    gold = torch.tensor([True, True, False, False])
    loss = student_loss(outputs, {"teacher": teacher, "labels": labels, "gold": gold})
    per_row = [0.25 * (1 - 2) ** 2 + 0.75 * (1 - 0) ** 2, 0.25 * 0 + 0.75 * (2 - 4) ** 2,
               2.0 * (4 - 3) ** 2, 2.0 * (0 - 1) ** 2]
    assert loss.item() == pytest.approx(np.mean(per_row))
    only_transfer = student_loss(outputs[2:], {"teacher": teacher[2:], "labels": labels[2:], "gold": gold[2:]})
    assert only_transfer.item() == pytest.approx(np.mean(per_row[2:]))


def test_the_transfer_rows_follow_the_training_rows_with_their_teacher_labels(tiny_tokenized):
    split = load_split(tiny_tokenized, TASKS["sst"], "train")
    extra = load_split(tiny_tokenized, TASKS["sst"], "dev")  # any tokenized rows stand in for a transfer set
    values = np.full((len(split), 5), 0.2)
    extra_values = np.eye(5)[np.arange(len(extra)) % 5]
    taught = Distillation({"sst": (split.ids, values)}, 0.5, 1.0, {"sst": (extra, extra_values)}).taught(split)
    assert len(taught) == len(split) + len(extra) and taught.gold.tolist() == [True] * 16 + [False] * 16
    batch = taught.batch(np.array([0, 16, 17]), "cross")
    assert batch["gold"].tolist() == [True, False, False] and batch["teacher"].argmax(-1).tolist()[1:] == [0, 1]
    assert batch["input_ids"][1].tolist()[:int(batch["attention_mask"][1].sum())] == \
        extra.tokens["input_ids"].padded(np.array([0]))[0][0].tolist()


def test_transfer_rows_must_name_declared_tasks_and_be_counts():
    import yaml

    from mtbert.params import ParamsError
    from mtbert.params_file import parse_params
    from tests.conftest import REPO_ROOT

    raw = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    raw["distill"]["transfer"]["rows"] = {"nli": 5}
    with pytest.raises(ParamsError, match=r"^params: distill.transfer.rows.nli: unknown task; tasks declares sst, "
                                          r"qqp, sts$"):
        parse_params(raw)
    raw["distill"]["transfer"]["rows"] = {"sts": -1}
    with pytest.raises(ParamsError, match=r"distill.transfer.rows.sts: expected greater than or equal to 0, got -1"):
        parse_params(raw)
    raw["distill"]["transfer"]["rows"] = {"sts": 5}
    raw["distill"]["transfer"]["neighbours"] = 1.5
    with pytest.raises(ParamsError, match=r"distill.transfer.neighbours"):
        parse_params(raw)
