"""Distillation: the teacher's loss by kind, its blend with the gold labels, the teacher read from the members'
training-split dumps, and the `distill` stage end to end (with `predict`, `ensemble` and `stats` around it)
on the 2-layer model."""

import importlib
import json
import shutil
import types
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
import yaml
from typer.testing import CliRunner

from mtbert.data.batches import load_split
from mtbert.evaluation.predictions import write_dump
from mtbert.evaluation.teacher import ensemble_teacher
from mtbert.params import HeadParams, ParamsError
from mtbert.params_file import parse_params
from mtbert.runtime import MissingInputError, UserError
from mtbert.training.distillation import Distillation
from mtbert.training.losses import Distilled, kind_losses, task_loss
from tests.conftest import REPO_ROOT, TASKS, make_params, module_folder

HEADS = {"sst": HeadParams(), "qqp": HeadParams(encoding="cross", combine="features"),
         "sts": HeadParams(encoding="cross", combine="features", target="raw")}
STUDENT = types.SimpleNamespace(tasks=TASKS, head_params=HEADS)  # what kind_losses asks of a model


def blend(alpha: float, temperature: float = 1.0) -> dict[str, Distilled]:
    """Each task's student loss with this blend, as the objective calls it."""
    return Distillation(teacher={}, alpha=alpha, temperature=temperature).losses(kind_losses(STUDENT))


# --- the losses -------------------------------------------------------------------------------------------
def test_at_temperature_1_the_blend_is_the_cross_entropy_against_the_blended_targets():
    torch.manual_seed(0)
    outputs, teacher = torch.randn(4, 5), torch.softmax(torch.randn(4, 5), -1)
    labels = torch.tensor([0, 3, 4, 1])
    loss = blend(0.3)["sst"](outputs, {"teacher": teacher, "labels": labels})
    targets = 0.3 * teacher + 0.7 * F.one_hot(labels, 5).float()
    assert loss.item() == pytest.approx(F.cross_entropy(outputs, targets).item(), rel=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 2.0, 4.0])
def test_a_student_that_agrees_with_its_teacher_gets_no_gradient_from_it(temperature):
    torch.manual_seed(1)
    for task, outputs, teacher_of in (("sst", torch.randn(4, 5), lambda z: z.softmax(-1)),
                                      ("qqp", torch.randn(4), torch.sigmoid)):
        outputs.requires_grad_(True)
        batch = {"teacher": teacher_of(outputs.detach()), "labels": torch.zeros(4)}
        blend(1.0, temperature)[task](outputs, batch).backward()
        assert torch.allclose(outputs.grad, torch.zeros_like(outputs), atol=1e-6), task


def test_times_t_squared_the_gradient_keeps_its_size_as_the_temperature_rises():
    torch.manual_seed(2)
    teacher = torch.softmax(3 * torch.randn(64, 5), -1)
    sizes = {}
    for temperature in (4.0, 8.0, 16.0):
        outputs = torch.zeros(64, 5, requires_grad=True)  # a uniform student
        batch = {"teacher": teacher, "labels": torch.zeros(64)}
        blend(1.0, temperature)["sst"](outputs, batch).backward()
        sizes[temperature] = outputs.grad.norm().item()
    # softer targets, but T * (p_T - q_T) tends to the logit difference / C: without T^2, / 16 from T 4 to 16
    assert sizes[16.0] == pytest.approx(sizes[4.0], rel=0.1) and sizes[8.0] == pytest.approx(sizes[4.0], rel=0.1)


def test_regression_blends_the_scores_and_ignores_the_temperature():
    outputs = torch.tensor([1.0, 2.0, 4.0], requires_grad=True)
    teacher, gold = torch.tensor([2.0, 2.0, 3.0]), torch.tensor([0.0, 4.0, 5.0])
    blend(0.25, temperature=3.0)["sts"](outputs, {"teacher": teacher, "labels": gold}).backward()
    expected = outputs.detach().clone().requires_grad_(True)
    F.mse_loss(expected, 0.25 * teacher + 0.75 * gold).backward()  # the same up to a constant
    assert torch.allclose(outputs.grad, expected.grad)
    unit = HeadParams(encoding="cross", combine="features", target="unit")
    assert task_loss(TASKS["sts"], unit).taught(torch.tensor([0.5]), torch.tensor([5.0]), 1.0).item() == \
        pytest.approx(0.25)  # the teacher's 5 is 1 on the unit scale


# --- the teacher on the training rows ----------------------------------------------------------------------
def test_each_training_row_gets_its_own_teacher_prediction_even_of_a_cut_split(tiny_tokenized):
    split = load_split(tiny_tokenized, TASKS["sst"], "train", 5)  # the first 5 rows of 16
    full = load_split(tiny_tokenized, TASKS["sst"], "train")
    order = np.random.default_rng(0).permutation(len(full))
    values = np.eye(5)[np.arange(len(full)) % 5]  # row i's teacher says class i mod 5
    taught = Distillation({"sst": (full.ids[order], values[order])}, 0.5, 1.0).taught(split)
    batch = taught.batch(np.array([4, 0, 2]), "cross")
    assert batch["teacher"].argmax(-1).tolist() == [4, 0, 2]
    assert batch["labels"].tolist() == split.labels[[4, 0, 2]].tolist()
    with pytest.raises(UserError, match=r"^teacher: no prediction of sst training row 'train-s0'"):
        Distillation({"sst": (full.ids[1:], values[1:])}, 0.5, 1.0).taught(split)


def ensemble_report(order: dict[str, list[str]]) -> dict:
    return {task: {"order": members} for task, members in order.items()}


def test_the_teacher_is_the_ensembles_average_in_its_order(tmp_path):
    ids = np.array(["train-s0", "train-s1"], dtype=object)
    predictions = {"a": np.array([[0.8, 0.2], [0.5, 0.5]]), "b": np.array([[0.2, 0.8], [0.5, 0.5]])}
    tasks = {"sst": TASKS["sst"]}
    for member, values in predictions.items():
        five = np.hstack([values, np.zeros((2, 3))])
        write_dump(tmp_path / "predictions" / member, TASKS["sst"], "train", ids[::-1] if member == "b" else ids,
                   five[::-1] if member == "b" else five)  # another row order: aligned by id
    ensemble_file = tmp_path / "ensemble.json"
    ensemble_file.write_text(json.dumps(ensemble_report({"sst": ["a", "b", "a"]})))
    teacher_ids, values = ensemble_teacher(ensemble_file, tmp_path / "predictions", tasks)["sst"]
    assert teacher_ids.tolist() == ids.tolist()
    assert np.allclose(values[:, :2], [[0.6, 0.4], [0.5, 0.5]])  # a weighs twice
    ensemble_file.write_text(json.dumps(ensemble_report({"sst": ["a", "b@epoch-1"]})))
    with pytest.raises(UserError, match=r"member b@epoch-1 is an epoch snapshot"):
        ensemble_teacher(ensemble_file, tmp_path / "predictions", tasks)
    ensemble_file.write_text(json.dumps(ensemble_report({"sst": ["c"]})))
    with pytest.raises(MissingInputError, match=r"c/sst-train.parquet is missing: `predict` dumps the training "
                                                r"split only with distill.enabled: true"):
        ensemble_teacher(ensemble_file, tmp_path / "predictions", tasks)


def test_the_fingerprint_changes_with_the_teacher_and_the_blend():
    teacher = {"sts": (np.array(["a", "b"], dtype=object), np.array([1.0, 2.0]))}
    other = {"sts": (np.array(["a", "b"], dtype=object), np.array([1.0, 2.5]))}
    prints = {Distillation(t, alpha, 2.0).fingerprint("run") for t in (teacher, other) for alpha in (0.5, 1.0)}
    assert len(prints) == 4
    assert Distillation(teacher, 0.5, 2.0).fingerprint("run") == Distillation(teacher, 0.5, 2.0).fingerprint("run")


# --- params ----------------------------------------------------------------------------------------------------
@pytest.fixture
def raw_params() -> dict:
    return yaml.safe_load((REPO_ROOT / "params.yaml").read_text())


def test_students_cannot_share_a_name_with_a_variant_nor_follow_an_unknown_one(raw_params):
    raw_params["distill"]["students"] = {"base": 0}
    with pytest.raises(ParamsError, match=r"^params: distill.students.base: a student name .* cannot be a variant's"):
        parse_params(raw_params)
    raw_params["distill"].update(students={"distilled": 0}, variant="nope")
    for enabled in (True, False):  # off too: dvc.yaml's `transfer` reads data/tokenized/<distill.variant>
        raw_params["distill"]["enabled"] = enabled
        with pytest.raises(ParamsError, match=r"^params: distill.variant: expected a key of models \(base, .*\), "
                                              r"got 'nope' \(stage `transfer` reads its data, even with distill off\)"):
            parse_params(raw_params)
    raw_params["distill"]["variant"] = "base"
    raw_params["export"]["models"] = ["distilled", "nope"]
    with pytest.raises(ParamsError, match=r"^params: export.models: expected keys of models or of distill.students "
                                          r"\(base, .*distilled\), got 'nope'$"):
        parse_params(raw_params)
    raw_params["export"]["models"] = ["distilled", "base"]  # a student and a variant
    parse_params(raw_params)
    raw_params["models"]["seed1"] = {"distill": {"alpha": 1.0}}
    with pytest.raises(ParamsError, match=r"models.seed1: a variant cannot override 'distill'"):
        parse_params(raw_params)


# --- the stage ---------------------------------------------------------------------------------------------------
def invoke(stage: str, *arguments) -> None:
    import importlib

    result = CliRunner().invoke(importlib.import_module(stage).app, [str(argument) for argument in arguments])
    assert result.exit_code == 0, f"{stage}: {result.output}"


def stage_arguments(root: Path, params_file: Path, tokenized: Path) -> dict[str, list]:
    rejects = tokenized.parent / "rejects.tsv"
    common = ["--params-file", params_file, "--tokenized-dir", tokenized]
    return {
        "train": [*common, "--models-dir", root / "models", "--metrics-dir", root / "metrics" / "train",
                  "--checkpoints-dir", root / "ck", "--snapshots-dir", root / "snapshots"],
        "transfer": [*common, "--out-dir", root / "transfer", "--metrics-file", root / "metrics" / "transfer.json"],
        "predict": [*common, "--rejects-file", rejects, "--models-dir", root / "models", "--transfer-dir",
                    root / "transfer", "--predictions-dir", root / "predictions", "--metrics-dir", root / "metrics"],
        "ensemble": [*common, "--rejects-file", rejects, "--predictions-dir", root / "predictions",
                     "--snapshots-dir", root / "snapshots", "--out-dir", root / "ensemble",
                     "--plots-dir", root / "plots", "--metrics-file", root / "metrics" / "ensemble.json"],
        "distill": [*common, "--rejects-file", rejects, "--predictions-dir", root / "predictions",
                    "--transfer-dir", root / "transfer",
                    "--ensemble-file", root / "metrics" / "ensemble.json", "--models-dir", root / "models",
                    "--dumps-dir", root / "distilled", "--snapshots-dir", root / "distilled_snapshots",
                    "--metrics-dir", root / "metrics",
                    "--train-metrics-dir", root / "metrics" / "train", "--checkpoints-dir", root / "ck"],
        "stats": [*common, "--predictions-dir", root / "predictions", "--distilled-dir", root / "distilled",
                  "--snapshots-dir", root / "snapshots", "--distilled-snapshots-dir", root / "distilled_snapshots",
                  "--train-metrics-dir", root / "metrics" / "train", "--stats-file", root / "metrics" / "stats.json",
                  "--curves-file", root / "metrics" / "curves.tsv"],
    }


TRANSFER_ROWS = {"sst": 6, "qqp": 0, "sts": 8}


@pytest.fixture(scope="module")
def pipeline(request, tmp_path_factory, tiny_backbone, tiny_tokenized) -> Path:
    """A transfer set, two variants (two seeds), their dumps with the training split and the transfer set, their
    ensemble, two students, stats."""
    root = module_folder(request, tmp_path_factory, "distill")
    params_file = make_params(root, tiny_backbone, Path("unused"), train={"epochs": 1},
                              models={"base": {}, "seed1": {"train": {"seed": 1}}},
                              extra={"predict": {"batch_size": 8, "bf16": False},
                                     "distill": {"enabled": True, "students": {"distilled": 0, "distilled-1": 1},
                                                 "alpha": 0.7, "temperature": 2.0,
                                                 "transfer": {"rows": TRANSFER_ROWS, "weight": 0.5}}})
    arguments = stage_arguments(root, params_file, tiny_tokenized)
    invoke("stages.transfer", "--pretrained-dir", tiny_backbone, *arguments["transfer"])
    for variant in ("base", "seed1"):
        invoke("stages.train", "--variant", variant, "--pretrained-dir", tiny_backbone, *arguments["train"])
        invoke("stages.predict", "--variant", variant, *arguments["predict"])
    invoke("stages.ensemble", *arguments["ensemble"])
    for student in ("distilled", "distilled-1"):
        invoke("stages.distill", "--student", student, "--pretrained-dir", tiny_backbone, *arguments["distill"])
    invoke("stages.stats", *arguments["stats"])
    return root


@pytest.mark.slow(reason="trains two variants and two students (the `pipeline` fixture)")
def test_predict_dumps_the_training_split_for_the_teacher(pipeline, tiny_tokenized):
    ids = load_split(tiny_tokenized, TASKS["qqp"], "train").ids.tolist()
    for variant in ("base", "seed1"):
        table = pq.read_table(pipeline / "predictions" / variant / "qqp-train.parquet")
        assert table.column("id").to_pylist() == ids  # every training row, and only those
        assert not (pipeline / "predictions" / variant / "para-train-output.csv").exists()


@pytest.mark.slow(reason="trains two variants and two students (the `pipeline` fixture)")
def test_predict_dumps_the_transfer_set_and_the_teacher_is_the_members_average_of_it(pipeline, tiny_tokenized):
    from mtbert.evaluation.evaluate import predict_split
    from mtbert.evaluation.teacher import transfer_teacher
    from mtbert.model.saved import load_model

    members = {name: load_model(pipeline / "models" / name)[0] for name in ("base", "seed1")}
    taught = transfer_teacher(pipeline / "metrics" / "ensemble.json", pipeline / "predictions", pipeline / "transfer",
                              TASKS)
    assert {name: len(rows) for name, (rows, _) in taught.items()} == {"sst": 6, "sts": 8}  # qqp: none
    assert not (pipeline / "predictions" / "base" / "qqp-transfer.parquet").exists()
    ensemble = json.loads((pipeline / "metrics" / "ensemble.json").read_text())
    for name, (rows, values) in taught.items():
        order = ensemble[name]["order"]
        predicted = {member: predict_split(members[member], rows, 8, torch.device("cpu")) for member in set(order)}
        assert np.allclose(values, np.mean([predicted[member] for member in order], axis=0), atol=1e-6)


class Crash(Exception):
    pass


@pytest.mark.slow(reason="trains the student twice, one run crashed")
def test_a_resumed_student_equals_an_uninterrupted_one(pipeline, tiny_backbone, tiny_tokenized, monkeypatch):
    from mtbert.training import finetune
    from tests.conftest import saved_heads

    root = pipeline / "resumed"
    shutil.copytree(pipeline / "predictions", root / "predictions")
    shutil.copytree(pipeline / "transfer", root / "transfer")
    (root / "metrics").mkdir()
    shutil.copy(pipeline / "metrics" / "ensemble.json", root / "metrics" / "ensemble.json")
    arguments = stage_arguments(root, pipeline / "params.yaml", tiny_tokenized)
    real_step = finetune.step

    def step_then_crash(run, progress, tasks, ends_update):
        real_step(run, progress, tasks, ends_update)
        if progress.updates == 5:  # past the checkpoint at update 3
            raise Crash  # not KeyboardInterrupt: click turns that into an exit

    with monkeypatch.context() as patch:
        patch.setattr(finetune, "step", step_then_crash)
        with pytest.raises(Crash):
            CliRunner().invoke(importlib.import_module("stages.distill").app,
                               [str(a) for a in ("--student", "distilled", "--pretrained-dir", tiny_backbone,
                                                 *arguments["distill"])], catch_exceptions=False)
    assert (root / "ck" / "distilled").exists()
    invoke("stages.distill", "--student", "distilled", "--pretrained-dir", tiny_backbone, *arguments["distill"])
    assert saved_heads(root / "models" / "distilled") == saved_heads(pipeline / "models" / "distilled")
    metrics = [json.loads((where / "metrics" / "distilled.json").read_text()) for where in (root, pipeline)]
    assert metrics[0] == metrics[1]


@pytest.mark.slow(reason="trains two variants and two students (the `pipeline` fixture)")
def test_the_student_is_a_model_folder_with_its_card_and_dumps(pipeline, tiny_tokenized):
    from mtbert.evaluation.evaluate import predict_split
    from mtbert.evaluation.predictions import read_dump
    from mtbert.model.saved import epoch_dir, load_model

    folder = pipeline / "models" / "distilled"
    model, config = load_model(folder)
    assert config["variant"] == "distilled" and config["params"]["train"]["seed"] == 0
    ensemble = json.loads((pipeline / "metrics" / "ensemble.json").read_text())
    assert config["distill"] == {"variant": "base", "seed": 0, "alpha": 0.7, "temperature": 2.0,
                                 "transfer": {"sst": 6, "sts": 8}, "transfer_weight": 0.5,
                                 "members": {task: ensemble[task]["members"] for task in TASKS}}
    card = (folder / "README.md").read_text()
    assert "# mtbert student `distilled`" in card and "## Distillation" in card and "`base` ×1" in card
    assert "transfer set" in card and "sts 8 rows" in card
    metrics = json.loads((pipeline / "metrics" / "distilled.json").read_text())
    for task in TASKS.values():  # the dumps are the folder's predictions, as predict's of a variant
        split = load_split(tiny_tokenized, task, "dev")
        ids, dumped = read_dump(pipeline / "distilled" / "distilled", task, "dev")
        assert ids.tolist() == split.ids.tolist()
        assert np.array_equal(predict_split(model, split, 8, torch.device("cpu")), dumped)
        assert set(metrics[task.name]) == set(task.kind.metric_names)
        assert (pipeline / "distilled" / "distilled" / f"{task.submission_file}-test-output.csv").is_file()
    from mtbert.inference import Predictor

    predicted = Predictor.load(folder, batch_size=8).predict("sts", [("A dog runs.", "A dog is running.")])
    assert set(predicted[0]) == {"score", "label"}  # as `mtbert predict --model models/distilled` reads it
    summary = json.loads((pipeline / "metrics" / "train" / "distilled-1.json").read_text())
    assert summary["variant"] == "distilled-1" and set(summary["task_epochs"]) == set(TASKS)
    snapshots = pipeline / "distilled_snapshots" / "distilled-1"  # every epoch's dev dumps, as train's
    assert json.loads((snapshots / "chosen.json").read_text()) == summary["task_epochs"]
    assert sorted(path.name for path in snapshots.glob("epoch-*")) == [epoch_dir(r["epoch"]) for r in summary["epochs"]]
    for task in TASKS.values():  # the epoch each task kept is the student's own dump
        np.testing.assert_allclose(read_dump(snapshots / epoch_dir(summary["task_epochs"][task.name]), task, "dev")[1],
                                   read_dump(pipeline / "distilled" / "distilled-1", task, "dev")[1], atol=1e-5)
    assert not (pipeline / "ck" / "distilled").exists()  # the run is complete


@pytest.mark.slow(reason="trains two variants and two students (the `pipeline` fixture)")
def test_the_students_form_a_seed_group_in_stats_and_the_results_table(pipeline):
    from mtbert.evaluation.report import results_table

    stats = json.loads((pipeline / "metrics" / "stats.json").read_text())
    assert stats["groups"]["distilled"]["variants"] == ["distilled", "distilled-1"]
    assert stats["groups"]["distilled"]["seeds"] == [0, 1] and stats["groups"]["distilled"]["student_of"] == "base"
    assert "distilled - base" in stats["comparisons"]
    assert set(stats["groups"]["distilled"]["honest"]) == {*TASKS, "overall"}  # from the students' epoch dumps
    ensemble = json.loads((pipeline / "metrics" / "ensemble.json").read_text())
    table = results_table(stats, ensemble).splitlines()
    row = next(line for line in table if line.startswith("| `distilled`"))
    assert "2 seed(s), student of the ensemble (configuration of `base`), mean ± std" in row
    assert any(line.startswith("| `distilled`, honest estimate |") for line in table)


@pytest.mark.slow(reason="trains two variants and two students (the `pipeline` fixture)")
def test_switched_off_the_stage_writes_outputs_that_say_so_and_stats_leaves_students_out(tmp_path, tiny_backbone,
                                                                                        tiny_tokenized, pipeline):
    params_file = make_params(tmp_path, tiny_backbone, Path("unused"),
                              models={"base": {}, "seed1": {"train": {"seed": 1}}})
    arguments = stage_arguments(tmp_path, params_file, tiny_tokenized)
    invoke("stages.distill", "--student", "distilled", *arguments["distill"])
    assert json.loads((tmp_path / "metrics" / "distilled.json").read_text()) == {"enabled": False}
    assert json.loads((tmp_path / "metrics" / "train" / "distilled.json").read_text()) == {"enabled": False}
    assert [p.name for p in (tmp_path / "models" / "distilled").iterdir()] == ["README.md"]
    assert [p.name for p in (tmp_path / "distilled" / "distilled").iterdir()] == ["README.md"]
    assert [p.name for p in (tmp_path / "distilled_snapshots" / "distilled").iterdir()] == ["README.md"]
    invoke("stages.export", "--model", "distilled", "--params-file", params_file, "--tokenized-dir", tiny_tokenized,
           "--models-dir", tmp_path / "models", "--exports-dir", tmp_path / "exports",
           "--metrics-dir", tmp_path / "metrics" / "export")  # export.models names the untrained student
    assert [p.name for p in (tmp_path / "exports" / "distilled").iterdir()] == ["README.md"]
    assert json.loads((tmp_path / "metrics" / "export" / "distilled.json").read_text()) == {"enabled": False}
    for name in ("predictions", "metrics/train", "snapshots"):  # the variants' outputs, from the pipeline above
        shutil.copytree(pipeline / name, tmp_path / name, dirs_exist_ok=True)
    invoke("stages.stats", *arguments["stats"])
    assert list(json.loads((tmp_path / "metrics" / "stats.json").read_text())["groups"]) == ["base"]
