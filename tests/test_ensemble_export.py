"""The ensemble as one deployable model (stage `export_ensemble`, mtbert/export/ensemble.py), on the
two small variants of tests/deployed.py (a cross-encoder and a bi-encoder, averaged uniformly): its
predictions are the ensemble stage's dumps, and `mtbert predict`, `Predictor.load` and `mtbert serve` take
it as one model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.common import start_server, stop_server
from mtbert.deploy.engine import ExportedEnsemble, OnnxEnsemblePredictor
from mtbert.inference import InputError, Predictor
from mtbert.integrity import read_manifest
from tests.commands import mtbert_in_process
from tests.deployed import invoke
from tests.loopback import HTTP
from tests.test_deploy import TOLERANCE, dev_texts, dump_values
from tests.test_properties import examples, refusal

TASKS = ("sst", "qqp", "sts")


@pytest.fixture(scope="module")
def exported(ensemble_export) -> tuple[Path, dict]:
    """exports/ensemble as the stage writes it, and its metrics (the session's `ensemble_export`)."""
    return ensemble_export


@pytest.mark.slow(reason="a second whole export of the ensemble (30 s)")
def test_dumps_written_in_bf16_are_reported_not_held_to_the_tolerance(trained, tmp_path):
    """On a bf16 machine `predict` writes its dumps in bf16, about 1e-2 from fp32: the export is checked
    against the members' fp32 PyTorch predictions, and its difference from the dumps is only reported."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mtbert import io

    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for path in trained.ensemble_dir.glob("*-dev.parquet"):
        table = pq.read_table(path)
        columns = {name: (pa.array(table.column(name).to_numpy() + 0.01)
                          if name.startswith("prob") or name == "score" else table.column(name))
                   for name in table.column_names}
        io.write_parquet(dumps / path.name, pa.table(columns))
    invoke("stages.export_ensemble", "--params-file", trained.params_file, "--tokenized-root",
           trained.tokenized_root, "--models-dir", trained.models, "--ensemble-file", trained.ensemble_file,
           "--dumps-dir", dumps, "--out-dir", tmp_path / "ensemble", "--metrics-file", tmp_path / "ensemble.json")
    report = json.loads((tmp_path / "ensemble.json").read_text())
    assert all(d <= TOLERANCE for d in report["parity"]["max_abs_difference"].values())
    assert all(d >= 0.009 for d in report["from_ensemble_dumps"]["max_abs_difference"].values())


@pytest.mark.parametrize("task", TASKS)
def test_the_exported_ensemble_equals_the_ensemble_stages_dumps(exported, trained, task):
    folder, _ = exported
    texts = dev_texts(trained, task)
    ensemble = ExportedEnsemble.load(folder, engine="onnx", threads=1)
    assert ensemble.members[task] == ["bi", "cross"]
    values = ensemble.values(task, texts).reshape(len(texts), -1)
    assert np.abs(values - dump_values(trained.ensemble_dir / f"{task}-dev.parquet")).max() <= TOLERANCE


def test_the_report_checks_parity_and_says_each_members_engine_and_the_latency(exported):
    folder, report = exported
    assert set(report["parity"]["max_abs_difference"]) == set(TASKS)
    assert all(difference <= TOLERANCE for difference in report["parity"]["max_abs_difference"].values())
    # the tests' predict runs in fp32, so the ensemble stage's own dumps are matched too
    assert all(difference <= TOLERANCE for difference in report["from_ensemble_dumps"]["max_abs_difference"].values())
    assert set(report["dev"]) == {"onnx", "deployed"} and all(0 <= report["dev"][e]["overall"] <= 1
                                                              for e in report["dev"])
    for member in ("bi", "cross"):
        for task in TASKS:
            choice = report["members"][member][task]
            assert choice["engine"] in ("onnx", "int8") and choice["reason"]
            assert read_manifest(folder / member)["task_engines"][task] == choice["engine"]
    assert set(report["int8_drop"]) == set(TASKS)
    for task in report["int8_too_costly"]:  # the members' drops added up: fp32 everywhere for the task
        assert all(report["members"][member][task]["engine"] == "onnx" for member in ("bi", "cross"))
        assert report["dev"]["deployed"][task] == report["dev"]["onnx"][task]
    for who in ("ensemble", "first_member"):
        assert all(report["speed"][who]["p50_ms"][task] > 0 for task in TASKS)
        assert all(report["speed"][who]["texts_per_second"][task] > 0 for task in TASKS)
    assert (folder / "README.md").read_text().startswith("# The ensemble, exported")


def test_a_text_is_tokenized_once_per_encoding_not_once_per_member(exported, trained, monkeypatch):
    folder, _ = exported
    ensemble = ExportedEnsemble.load(folder, engine="onnx", threads=1)
    calls = []
    for predictor in ensemble.predictors.values():  # one tokenizer file: members of one encoder share tokens
        real = predictor.tokenizer.encode_batch
        monkeypatch.setattr(predictor.tokenizer, "encode_batch",
                            lambda texts, real=real: calls.append(len(texts)) or real(texts), raising=False)
    ensemble.values("sst", dev_texts(trained, "sst")[:3])  # both members read the sentence alone
    assert len(calls) == 1
    calls.clear()
    ensemble.values("sts", dev_texts(trained, "sts")[:3])  # one cross-encoded pass, one per side for bi
    assert len(calls) == 3


def test_predict_and_the_python_api_load_it_as_one_model(exported, deployed):
    folder, _ = exported
    texts = ["A gorgeous, witty film.", "Dull."]
    one = mtbert_in_process("predict", "--model", folder, "--engine", "onnx", "--task", "sst", *texts)
    members = mtbert_in_process("predict", "--ensemble", deployed.ensemble_file, "--models-dir", deployed.exports,
                                "--engine", "onnx", "--task", "sst", *texts)
    assert one.returncode == members.returncode == 0, one.stderr + members.stderr
    assert [json.loads(line)["sst"]["label"] for line in one.stdout.splitlines()] == \
           [json.loads(line)["sst"]["label"] for line in members.stdout.splitlines()]
    predictor = Predictor.load(folder, engine="onnx", threads=1)
    assert isinstance(predictor, ExportedEnsemble)
    with pytest.raises(InputError, match="is an export: its graphs run in fp32 or int8"):
        Predictor.load(folder, bf16=True)
    reference = OnnxEnsemblePredictor.load(deployed.ensemble_file, deployed.exports, engine="onnx", threads=1)
    np.testing.assert_allclose(predictor.values("sst", texts), reference.values("sst", texts), atol=TOLERANCE)


@pytest.mark.slow(reason="a real server process")
def test_serve_answers_with_the_exported_ensemble_over_http(exported, trained, tmp_path):
    folder, _ = exported
    process, url = start_server(tmp_path / "stderr.log", "--model", folder, "--engine", "onnx", "--threads", "1",
                                timeout=300)
    try:
        pair = [["A man plays a guitar.", "A man is playing music."]]
        answer = HTTP.post(f"{url}/predict", json={"task": "sts", "texts": pair}, timeout=60)
    finally:
        stop_server(process)
    assert answer.status_code == 200, answer.text
    expected = ExportedEnsemble.load(folder, engine="onnx", threads=1).values("sts", [tuple(pair[0])])
    assert answer.json()["results"][0]["score"] == pytest.approx(float(expected[0]), abs=TOLERANCE)


@pytest.mark.slow(reason="a fresh timing process and two real servers")
def test_the_bench_times_the_exported_ensemble_against_its_members(exported, trained, tmp_path):
    from bench.deploy import ensemble_figures

    folder, _ = exported
    figures = ensemble_figures(folder, trained.ensemble_file, trained.tokenized, threads=1, texts_per_task=8,
                               single_calls=3, rounds=1, clients=3, requests=2, scratch=tmp_path)
    assert figures["torch_imported"] is False and figures["first_member"] == "bi"
    assert figures["tasks"] == {"sentence": "sst", "pair": "qqp"}
    for name in ("ensemble", "members_apart", "one_member"):
        assert figures["single_sentence_ms"][name]["p50"] > 0 and figures["single_pair_ms"][name]["p50"] > 0
        assert figures["texts_per_second"][name] > 0
    for name in ("ensemble", "members_apart"):
        assert figures["server"][name]["answered"] == {"200": 6}
    assert figures["server"]["ensemble_over_members_apart"] > 0


@pytest.mark.slow(reason="a fresh timing process and two real servers")
def test_the_bench_sets_a_members_export_beside_the_ensemble(exported, trained, tmp_path):
    """Figure 8c (bench/side_by_side.py): the ensemble, the baseline, and one member's own export, timed in
    one process without torch and each served to concurrent clients, every figure also over the baseline's."""
    from bench.side_by_side import side_by_side_figures

    folder, _ = exported
    figures = side_by_side_figures({"ensemble": folder, "bi": folder / "bi"}, trained.tokenized, threads=1,
                                   texts_per_task=8, single_calls=3, rounds=1, clients=3, requests=2,
                                   scratch=tmp_path)
    assert figures["torch_imported"] is False and figures["baseline"] == "ensemble"
    assert figures["tasks"] == {"sentence": "sst", "pair": "qqp"}
    for name in ("ensemble", "bi"):
        assert figures["single_sentence_ms"][name]["p50"] > 0 and figures["single_pair_ms"][name]["p50"] > 0
        assert figures["server"][name]["answered"] == {"200": 6} and figures["server"][name]["peak_rss_mib"] > 0
    assert set(figures["over_baseline"]["ensemble"].values()) == {1.0}
    ratios, served, rates = figures["over_baseline"]["bi"], figures["server"], figures["texts_per_second"]
    assert ratios["texts_per_second"] == round(rates["bi"] / rates["ensemble"], 3)
    assert ratios["server_peak_rss"] == round(served["bi"]["peak_rss_mib"] / served["ensemble"]["peak_rss_mib"], 3)


@pytest.mark.parametrize("bound", [1.0, -1.0], ids=["within-the-bound-now", "still-over"])
def test_a_task_whose_int8_members_add_up_past_the_bound_is_quantized_again_then_fp32_if_still_over(
        exported, trained, tmp_path, bound):
    """The ensemble's second try (settle_int8): every member's int8 graph of the task written again with the
    down projections in fp32, the ensemble measured again; kept if now within export.int8_max_drop (a bound
    above any drop here), else fp32 in every member (a bound below any)."""
    import shutil

    from mtbert.data.tasks import tasks_from_params
    from mtbert.export.ensemble import manifest_contents, settle_int8, write_choices
    from mtbert.export.variant import write_int8
    from mtbert.params_file import load_params

    folder = tmp_path / "ensemble"
    shutil.copytree(exported[0], folder)
    report = json.loads(json.dumps(exported[1]))
    report["int8_too_costly"] = {"sst": 0.5}  # as if int8 in both members had cost the ensemble's SST that much
    choices = {member: {task: (choice["engine"], choice["reason"]) for task, choice in tasks.items()}
               for member, tasks in report["members"].items()}
    for member in choices:
        choices[member]["sst"] = ("int8", "within its own bound")
    params = load_params(trained.params_file)
    options = params.export.model_copy(update={"int8_max_drop": bound})
    members = read_manifest(folder)["members"]
    for member in ("bi", "cross"):  # SST's int8 graph fully quantized, as a member's first try writes it
        write_int8(folder / member, manifest_contents(folder / member), options.int8_per_channel, ["sst"])
        assert set(down_projection_kinds(folder / member / "sst.int8.onnx")) == {"MatMulInteger"}

    def write(engines: dict) -> None:
        write_choices(folder, members, engines, trained.ensemble_file, trained.models)

    settled = settle_int8(folder, choices, {"bi": {}, "cross": {}}, report, tasks_from_params(params.tasks),
                          trained.tokenized_root, options, 1, write)
    write(settled)
    for member in ("bi", "cross"):  # written again: the down projections in fp32
        assert set(down_projection_kinds(folder / member / "sst.int8.onnx")) == {"MatMul"}
    second = report["int8_outliers_in_fp32"]["sst"]
    assert second["drop_fully_quantized"] == 0.5 and isinstance(second["drop"], float)
    engines = {member: read_manifest(folder / member)["task_engines"]["sst"] for member in ("bi", "cross")}
    deployed_sst = ExportedEnsemble.load(folder, engine="auto", threads=1)
    if bound > 0:
        assert engines == {"bi": "int8", "cross": "int8"} and report["int8_too_costly"] == {}
        assert "quantized again with its outlier-prone products in fp32" in settled["bi"]["sst"][1]
    else:
        assert engines == {"bi": "onnx", "cross": "onnx"} and report["int8_too_costly"] == {"sst": second["drop"]}
        assert report["dev"]["deployed"]["sst"] == report["dev"]["onnx"]["sst"]
    texts = dev_texts(trained, "sst")
    expected = ExportedEnsemble.load(folder, engine="int8" if bound > 0 else "onnx", threads=1).values("sst", texts)
    np.testing.assert_array_equal(deployed_sst.values("sst", texts), expected)


def down_projection_kinds(path: Path) -> list[str]:
    """The operator of each feed-forward down projection in a graph (MatMul: fp32; MatMulInteger: int8)."""
    import re

    import onnx

    return [node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node
            if re.search(r"/output/dense(_\d+)?/(MatMul|MatMul_quant)$", node.name) and "/attention/" not in node.name]


def test_a_task_whose_int8_members_add_up_to_too_large_a_drop_runs_fp32_in_every_member():
    from mtbert.export.ensemble import fp32_for

    choices = {"a": {"sst": ("int8", "fine"), "qqp": ("int8", "fine")}, "b": {"sst": ("int8", "fine")}}
    changed = fp32_for(choices, {"sst": 0.0064})
    assert {name: {task: engine for task, (engine, _) in tasks.items()} for name, tasks in changed.items()} == \
           {"a": {"sst": "onnx", "qqp": "int8"}, "b": {"sst": "onnx"}}
    assert "by 0.0064, more than export.int8_max_drop" in changed["b"]["sst"][1]


@pytest.mark.slow(reason="loads the exported ensemble on every example")
@given(choice=st.data())
@settings(max_examples=examples(20))
def test_an_ensemble_export_with_a_file_missing_cut_or_altered_is_refused_naming_it(exported, choice):
    """Any file of the folder (its manifest and the members' list, a member's manifest, graph or tokenizer)
    removed, cut short or with a bit flipped: loading it and predicting every task is refused in one line
    naming the file, never answered from what was damaged."""
    import os
    import shutil
    import tempfile

    folder, _ = exported
    # every file but the model card (README.md, for people: the loader reads it not, and checks what it reads)
    files = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*")
                   if path.is_file() and path.name != "README.md")
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "ensemble"
        shutil.copytree(folder, copy, copy_function=os.link)  # links: the graphs are large
        name = choice.draw(st.sampled_from(files))
        path = copy / name
        data = path.read_bytes()
        path.unlink()  # the changed file is a new one: the link's target, the module's export, stays whole
        change = choice.draw(st.sampled_from(["remove", "cut", "flip", "flip"]))  # a flip: the silent kind
        if change == "cut":
            path.write_bytes(data[:choice.draw(st.integers(0, len(data) - 1))])
        elif change == "flip":
            at = choice.draw(st.integers(0, len(data) - 1))
            path.write_bytes(data[:at] + bytes([data[at] ^ 1 << choice.draw(st.integers(0, 7))]) + data[at + 1:])
        # an int8 graph is read by the int8 engine only; the manifests and the tokenizers by both
        engine = "int8" if ".int8." in name else "onnx" if name.endswith(".onnx") else \
            choice.draw(st.sampled_from(["onnx", "int8"]))
        message = refusal(copy, engine=engine)
    assert message is not None, f"{name} ({change}): the ensemble loaded and predicted"
    assert "\n" not in message and Path(name).name in message, (name, change, message)
