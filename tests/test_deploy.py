"""Export to ONNX, the ONNX Runtime engine and `mtbert predict` on exports, on two small variants and the
ensemble over them (tests/deployed.py): every task kind and encoding against the `predict` and `ensemble`
dumps, the fast path's imports, the same output and the same one-line errors as the PyTorch path."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from mtbert.deploy.engine import OnnxEnsemblePredictor, OnnxPredictor, resolve_engine
from mtbert.export.variant import ExportError, choose_engine, parity_difference, task_engines
from mtbert.integrity import IntegrityError, verify, write_manifest
from mtbert.params_file import load_params
from tests.commands import mtbert_in_process
from tests.conftest import REPO_ROOT
from tests.deployed import VARIANTS

TASKS = ("sst", "qqp", "sts")
TOLERANCE = 1e-4  # the issue's: ONNX fp32 against the PyTorch dumps


def dev_texts(deployed, task: str) -> list[tuple[str, ...]]:
    """A task's dev texts in the split's row order (the dumps' order), as the tokenized split stores them."""
    table = pq.read_table(deployed.tokenized / f"{task}-dev.parquet")
    columns = ["sentence"] if task == "sst" else ["sentence1", "sentence2"]
    return list(zip(*(table.column(c).to_pylist() for c in columns), strict=True))


def dump_values(path: Path) -> np.ndarray:
    table = pq.read_table(path)
    return np.array([table.column(c).to_numpy() for c in table.column_names
                     if c.startswith("prob") or c == "score"]).T


# --- parity -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("task", TASKS)
def test_onnx_fp32_equals_the_pytorch_dumps(deployed, variant, task):
    """sst: classification of one sentence; qqp: binary (cross-encoded; bi with the features head); sts:
    regression (cross-encoded; the cosine bi-encoder); `bi` keeps qqp from another epoch."""
    texts = dev_texts(deployed, task)
    for batch_size in (3, 128):  # batches of several widths, and the whole split as one
        predictor = OnnxPredictor.load(deployed.exports / variant, engine="onnx", batch_size=batch_size, threads=1)
        values = predictor.values(task, texts).reshape(len(texts), -1)
        expected = dump_values(deployed.predictions / variant / f"{task}-dev.parquet")
        assert values.shape == expected.shape and np.abs(values - expected).max() <= TOLERANCE


@pytest.mark.parametrize("task", TASKS)
def test_the_onnx_ensemble_equals_the_ensembles_dumps(deployed, task):
    texts = dev_texts(deployed, task)
    ensemble = OnnxEnsemblePredictor.load(deployed.ensemble_file, deployed.exports, engine="onnx", threads=1)
    assert ensemble.members[task] == ["bi", "cross"]  # uniform: both variants, so the average is tested
    values = ensemble.values(task, texts).reshape(len(texts), -1)
    expected = dump_values(deployed.ensemble_dir / f"{task}-dev.parquet")
    assert np.abs(values - expected).max() <= TOLERANCE


@pytest.mark.slow(reason="real `mtbert predict` processes")
def test_cleaning_and_truncation_are_the_pytorch_engines(deployed):
    """Raw text the dev splits do not have: PTB escapes (undone for SST only), surrounding whitespace, and
    texts and pairs far over tokenize.max_length (32 here: pairs are cut longest-first)."""
    from mtbert.inference import Predictor

    long = " ".join(["a remarkably long and winding sentence about rice"] * 12)
    cases = {"sst": ["  It 's a -LRB- lovely -RRB- film , `` fine '' \\/ good . ", long, "Dull."],
             "qqp": [("-LRB- How -RRB- do I cook rice?", long), (long, "short"), (long, long + " too")],
             "sts": [(" A dog runs. ", "A dog is running."), (long, "A cat."), ("A cat.", long)]}
    for variant in VARIANTS:
        onnx = OnnxPredictor.load(deployed.exports / variant, engine="onnx", threads=1)
        torch_engine = Predictor.load(deployed.models / variant, batch_size=2)
        for task, texts in cases.items():
            assert np.abs(onnx.values(task, texts) - torch_engine.values(task, texts)).max() <= TOLERANCE
            assert [row["label"] for row in onnx.predict(task, texts)] == \
                [row["label"] for row in torch_engine.predict(task, texts)] or task == "sts"


def test_int8_graphs_run_every_task(deployed):
    for variant in VARIANTS:
        int8 = OnnxPredictor.load(deployed.exports / variant, engine="int8", threads=1)
        for task in TASKS:
            values = int8.values(task, dev_texts(deployed, task))
            assert np.isfinite(values).all()
            if task == "sst":
                assert np.allclose(values.sum(-1), 1.0, atol=1e-5)


# --- the export's manifest and metrics -------------------------------------------------------------------
def test_the_manifest_describes_the_export_and_its_metrics_say_which_engine_and_why(deployed):
    for variant in VARIANTS:
        folder = deployed.exports / variant
        manifest = verify(folder)  # every file's sha256
        metrics = json.loads((deployed.export_metrics / f"{variant}.json").read_text())
        assert sorted(manifest["files"]) == sorted(["tokenizer.json", *(f"{t}{s}.onnx" for t in TASKS
                                                                        for s in ("", ".int8"))])
        assert manifest["max_length"] == 32 and manifest["truncation"] == "longest_first"
        assert manifest["default_engine"] == metrics["engine"] in ("onnx", "int8") and metrics["reason"]
        # per task, the rule applied to this export's own figures; `auto` runs them
        rule = task_engines(metrics, list(TASKS), load_params(deployed.params_file).export.int8_max_drop)
        assert manifest["task_engines"] == {task: engine for task, (engine, _) in rule.items()}
        assert metrics["task_engines"] == {task: {"engine": engine, "reason": why}
                                           for task, (engine, why) in rule.items()}
        assert manifest["tasks"]["sst"]["kind"] == "classification" and manifest["tasks"]["qqp"]["kind"] == "binary"
        assert manifest["tasks"]["sst"]["columns"] == [f"prob_{c}" for c in range(5)]
        assert ["-LRB-", "("] in manifest["tasks"]["sst"]["clean"]["replace"]  # data.unescape_ptb: [sst]
        assert manifest["tasks"]["qqp"]["clean"]["replace"] == []
        expected = {"cross": {"sst": "single", "qqp": "cross", "sts": "cross"},
                    "bi": {"sst": "single", "qqp": "bi", "sts": "bi"}}[variant]
        assert {task: entry["encoding"] for task, entry in manifest["tasks"].items()} == expected
        assert manifest["source"]["task_epochs"] == {"cross": {"sst": 1, "qqp": 1, "sts": 1},
                                                     "bi": {"sst": 1, "qqp": 2, "sts": 1}}[variant]
        assert all(difference <= TOLERANCE for difference in metrics["parity"]["max_abs_difference"].values())
        assert set(metrics["dev"]) == {"onnx", "int8"} and set(metrics["dev"]["int8"]) == {*TASKS, "overall"}
        assert set(metrics["int8_drop"]) == set(TASKS) and metrics["speed"]["seconds"]["int8"] > 0
        assert metrics["size_mb"]["int8"] < metrics["size_mb"]["onnx"]
        fp32_metrics = json.loads((deployed.root / "metrics" / f"{variant}.json").read_text())  # `predict`'s
        for task in TASKS:
            assert metrics["dev"]["onnx"][task] == pytest.approx(fp32_metrics[task], abs=2e-3)


def test_int8_is_the_default_only_where_it_is_as_good_and_faster():
    headlines = {"sst": "accuracy", "sts": "pearson"}
    faster, slower = {"onnx": 2.0, "int8": 1.0}, {"onnx": 1.0, "int8": 1.5}
    assert choose_engine({"sst": 0.002, "sts": -0.01}, faster, 0.003, headlines)[0] == "int8"
    engine, reason = choose_engine({"sst": 0.0031, "sts": 0.0}, faster, 0.003, headlines)
    assert engine == "onnx"
    assert reason == "int8 drops sst's dev accuracy by 0.0031, more than export.int8_max_drop 0.003"
    engine, reason = choose_engine({"sst": 0.0, "sts": 0.001}, slower, 0.003, headlines)
    assert engine == "onnx"
    assert reason.startswith("int8 was not faster on this machine: 1.500 s against fp32's 1.000 s")
    assert choose_engine(None, {"onnx": 1.0}, 0.003, headlines) == ("onnx", "export.int8 is false: no int8 graphs")


def test_each_task_runs_int8_only_where_int8_is_as_good_and_faster():
    faster, slower = {"speed": {"int8_speedup": 1.8}}, {"speed": {"int8_speedup": 0.9}}
    drops = {"int8_drop": {"sst": 0.02, "qqp": -0.001, "sts": 0.003}}
    choices = task_engines({**drops, **faster}, ["sst", "qqp", "sts"], 0.003)
    assert {task: engine for task, (engine, _) in choices.items()} == {"sst": "onnx", "qqp": "int8", "sts": "int8"}
    assert choices["sst"][1] == "int8 drops the dev headline by 0.0200, more than export.int8_max_drop 0.003"
    assert choices["qqp"][1] == "int8 drops the dev headline by -0.0010 (at most 0.003) and ran 1.80x as fast"
    assert {engine for engine, _ in task_engines({**drops, **slower}, ["qqp", "sts"], 0.003).values()} == {"onnx"}
    assert task_engines({}, ["sst"], 0.003) == {"sst": ("onnx", "export.int8 is false: no int8 graph")}


def test_auto_runs_each_task_on_the_engine_its_manifest_names(deployed, tmp_path):
    """An export whose tasks chose different engines: `auto` runs each task's own; `onnx` and `int8` run one
    engine for every task."""
    from mtbert.integrity import DIGEST, read_manifest

    folder = tmp_path / "cross"
    shutil.copytree(deployed.exports / "cross", folder)
    manifest = {key: value for key, value in read_manifest(folder).items() if key not in ("files", DIGEST)}
    chosen = {"sst": "int8", "qqp": "onnx", "sts": "int8"}
    write_manifest(folder, {**manifest, "default_engine": "onnx", "task_engines": chosen})
    engines = {engine: OnnxPredictor.load(folder, engine=engine, threads=1) for engine in ("auto", "onnx", "int8")}
    for task in TASKS:
        values = {engine: predictor.values(task, dev_texts(deployed, task)) for engine, predictor in engines.items()}
        assert not np.array_equal(values["onnx"], values["int8"])  # else this test could not tell them apart
        np.testing.assert_array_equal(values["auto"], values[chosen[task]])


def test_a_graph_that_differs_from_pytorch_fails_the_export_naming_the_task():
    expected = np.array([[0.2, 0.8], [0.5, 0.5]])
    assert parity_difference("sst", expected, expected + 5e-5, 1e-4) == pytest.approx(5e-5)
    with pytest.raises(ExportError, match=r"^task sst: the ONNX graph differs from PyTorch by 0.001 on the first 2 "
                                          r"dev rows, over export.tolerance 0.0001"):
        parity_difference("sst", expected, expected + 1e-3, 1e-4)
    with pytest.raises(ExportError, match="differs from PyTorch by nan"):
        parity_difference("sst", expected, expected * np.nan, 1e-4)


def test_an_engine_the_export_lacks_is_refused_in_one_line(deployed):
    from mtbert.deploy.engine import ExportedTask, ExportFolderError

    manifest = json.loads((deployed.exports / "cross" / "manifest.json").read_text())
    tasks = {name: ExportedTask.from_manifest(name, {**entry, "graphs": {"onnx": f"{name}.onnx"}}, "m.json")
             for name, entry in manifest["tasks"].items()}
    with pytest.raises(ExportFolderError, match=r"^m.json: task sst has no int8 graph \(exported with export.int8: "
                                                r"false\); the export has: onnx$"):
        resolve_engine("int8", manifest, tasks, "m.json")
    assert resolve_engine("auto", {**manifest, "default_engine": "onnx"}, tasks, "m.json") == "onnx"


@pytest.mark.slow(reason="a real `mtbert export` process")
def test_the_export_command_writes_an_export_that_predicts_like_the_stages(deployed, tmp_path):
    out = tmp_path / "exported"
    result = run_mtbert("export", "--model", deployed.models / "cross", "--out", out, "--no-int8",
                        "--params-file", deployed.params_file, "--tokenized-dir", deployed.tokenized,
                        "--metrics", tmp_path / "export.json", "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (f"{out}: default engine onnx (export.int8 is false: no int8 graphs); "
                                     "`auto` runs sst on onnx, qqp on onnx, sts on onnx")
    assert not list(out.glob("*.int8.onnx")) and json.loads((tmp_path / "export.json").read_text())["engine"] == "onnx"
    texts = dev_texts(deployed, "qqp")
    values = OnnxPredictor.load(out, threads=1).values("qqp", texts).reshape(len(texts), -1)
    assert np.abs(values - dump_values(deployed.predictions / "cross" / "qqp-dev.parquet")).max() <= TOLERANCE


@pytest.mark.slow(reason="a whole export of a 2-layer variant")
def test_the_graphs_are_fused_after_the_model_is_dropped_and_without_their_weights(deployed, tmp_path, monkeypatch):
    """The optimizer copies a graph several times over, and the model's memory would add to it. So PyTorch's
    part (the traced graphs, the parity rows) comes first and the model goes; and the optimizer is handed
    the graph's structure, its weight matrices left in a file until it is done."""
    import weakref

    import onnxruntime.transformers.optimizer as optimizer

    import mtbert.export.variant as variant
    from mtbert.params_file import load_params

    models, alive_while_fusing, largest_bytes_seen = [], [], []
    load_model, fuse_layers, optimize_model = variant.load_model, variant.fuse_layers, optimizer.optimize_model

    def load(model_dir):
        model, config = load_model(model_dir)
        models.append(weakref.ref(model))
        return model, config

    def fuse(path, config, expected):
        alive_while_fusing.append(models[0]() is not None)
        fuse_layers(path, config, expected)

    def optimize(graph, **options):
        largest_bytes_seen.append(max(len(tensor.raw_data) for tensor in graph.graph.initializer))
        return optimize_model(graph, **options)

    monkeypatch.setattr(variant, "load_model", load)
    monkeypatch.setattr(variant, "fuse_layers", fuse)
    monkeypatch.setattr(optimizer, "optimize_model", optimize)
    options = load_params(deployed.params_file).export.model_copy(update={"int8": False})
    report = variant.export_variant(deployed.models / "bi", tmp_path / "bi", options, deployed.tokenized, threads=1)
    assert alive_while_fusing == [False] * len(TASKS)
    # only the small constants (under onnx's 1 KiB threshold) in memory; every weight's bytes on disk
    assert len(largest_bytes_seen) == len(TASKS) and max(largest_bytes_seen) < 1024
    assert max(report["parity"]["max_abs_difference"].values()) <= options.tolerance  # fused, against PyTorch
    # one file per graph again (no weights file left), each as the manifest lists it
    assert sorted(verify(tmp_path / "bi")["files"]) == sorted(["tokenizer.json", *(f"{task}.onnx" for task in TASKS)])


def test_a_member_that_serves_some_tasks_is_exported_with_their_graphs_only(deployed, tmp_path):
    """A greedy ensemble may use a member for some tasks (MPNet for SST and STS, MiniLM for QQP): its export
    in the ensemble traces, fuses, checks and times those graphs alone, not every task's to delete some."""
    from mtbert.export.variant import export_variant
    from mtbert.params_file import load_params
    from mtbert.runtime import UserError

    options = load_params(deployed.params_file).export.model_copy(update={"int8": False})
    report = export_variant(deployed.models / "cross", tmp_path / "cross", options, deployed.tokenized, threads=1,
                            tasks=["sts"])
    manifest = verify(tmp_path / "cross")
    assert sorted(manifest["files"]) == ["sts.onnx", "tokenizer.json"] and list(manifest["tasks"]) == ["sts"]
    assert list(report["parity"]["max_abs_difference"]) == ["sts"]
    with pytest.raises(UserError, match=r"cross: no task 'nli' to export \(its tasks: sst, qqp, sts\)"):
        export_variant(deployed.models / "cross", tmp_path / "nli", options, deployed.tokenized, tasks=["nli"])
    assert not (tmp_path / "nli").exists()


def test_a_task_that_int8_costs_too_much_is_quantized_again_with_its_outlier_prone_products_in_fp32(
        deployed, tmp_path):
    """Where quantizing everything drops a task's dev headline past export.int8_max_drop, its int8 graph is
    written again with the feed-forward down projections and the embedding lookups in fp32, and that graph is
    measured and kept. A bound below any drop forces it here."""
    import onnx

    from mtbert.export.variant import export_variant
    from mtbert.params_file import load_params

    options = load_params(deployed.params_file).export.model_copy(update={"int8_max_drop": -1.0})
    report = export_variant(deployed.models / "bi", tmp_path / "bi", options, deployed.tokenized, threads=1,
                            tasks=["sts"])  # a bi-encoder: its graph holds the encoder once per sentence
    assert list(report["int8_outliers_in_fp32"]) == ["sts"] and report["engine"] == "onnx"
    assert report["task_engines"]["sts"]["engine"] == "onnx"
    first = report["int8_outliers_in_fp32"]["sts"]["drop_fully_quantized"]
    assert isinstance(first, float) and report["int8_drop"]["sts"] == pytest.approx(
        report["dev"]["onnx"]["sts"]["pearson"] - report["dev"]["int8"]["sts"]["pearson"])
    graph = onnx.load(str(tmp_path / "bi" / "sts.int8.onnx"), load_external_data=False).graph
    kinds = {node.name: node.op_type for node in graph.node}
    down = [name for name in kinds if re.search(r"/output/dense(_\d+)?/MatMul$", name) and "/attention/" not in name]
    # the shared layer's and the task layer's down projections, in each sentence's copy of the encoder
    assert len(down) == 4 and all(kinds[name] == "MatMul" for name in down), down
    assert "MatMulInteger" in kinds.values()  # the rest is int8
    weights = {tensor.name: tensor.data_type for tensor in graph.initializer}
    nodes = graph.node
    lookups = [node.input[0] for node in nodes if node.op_type == "Gather" and node.input[0] in weights]
    assert lookups and all(weights[name] == onnx.TensorProto.FLOAT for name in lookups)  # embeddings fp32


# --- integrity ------------------------------------------------------------------------------------------
def test_write_manifest_and_verify_name_the_file_that_changed(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"weights")
    (tmp_path / "sub" / "b.txt").write_text("tokens")
    manifest = write_manifest(tmp_path, {"format": 1})
    assert sorted(manifest["files"]) == ["a.bin", "sub/b.txt"] and manifest["format"] == 1
    assert verify(tmp_path) == json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "a.bin").write_bytes(b"weightz")
    with pytest.raises(IntegrityError, match=r"a.bin has sha256 [0-9a-f]{64}, but .*manifest.json expects "):
        verify(tmp_path)
    verify(tmp_path, ["sub/b.txt"])  # only the files asked for
    (tmp_path / "sub" / "b.txt").unlink()
    with pytest.raises(IntegrityError, match=r"sub/b.txt is missing; .*manifest.json lists it$"):
        verify(tmp_path, ["sub/b.txt"])
    with pytest.raises(IntegrityError, match=r"c.txt: not listed in"):
        verify(tmp_path, ["c.txt"])
    changed = {**manifest, "format": 2}  # an entry of the manifest itself, edited
    (tmp_path / "manifest.json").write_text(json.dumps(changed))
    with pytest.raises(IntegrityError, match=r"manifest.json: its contents do not match its `digest`"):
        verify(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({key: value for key, value in manifest.items()
                                                       if key != "digest"}))
    with pytest.raises(IntegrityError, match=r"manifest.json has no `digest` \(written by an older mtbert\)"):
        verify(tmp_path)
    (tmp_path / "manifest.json").write_text("[]")
    with pytest.raises(IntegrityError, match=r"manifest.json: not a manifest"):
        verify(tmp_path)
    with pytest.raises(IntegrityError, match=r"manifest.json is missing"):
        verify(tmp_path / "sub")


# --- `mtbert predict` on an export ------------------------------------------------------------------------
def run_mtbert(*args, stdin: bytes | None = None, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtbert.cli", *map(str, args)], cwd=cwd, input=stdin,
                          capture_output=True, text=stdin is None)


def predict(*args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return run_mtbert("predict", "--threads", "1", *args, stdin=stdin)


def predict_in_process(*args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return mtbert_in_process("predict", "--threads", "1", *args, stdin=stdin)


HEAVY = ("torch", "transformers", "pandas", "pyarrow", "scipy")


@pytest.mark.parametrize("source", ["model", "ensemble"])
def test_the_fast_path_imports_no_torch(deployed, source):
    target = ["--model", str(deployed.exports / "bi")] if source == "model" else \
        ["--ensemble", str(deployed.ensemble_file), "--models-dir", str(deployed.exports)]
    code = ("import sys, json\nfrom mtbert.cli import app\n"
            f"app({['predict', *target, '--task', 'sts', 'A dog runs.', 'A dog is running.']!r}, "
            "standalone_mode=False)\n"
            f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    prediction, imported = result.stdout.splitlines()
    assert set(json.loads(prediction)["sts"]) == {"score", "label"}
    assert json.loads(imported) == []


def lines(result: subprocess.CompletedProcess) -> list[dict]:
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def assert_same_output(onnx: list[dict], pytorch: list[dict]) -> None:
    """Same rows, keys and texts; values within the tolerance; the labels of class tasks equal."""
    assert len(onnx) == len(pytorch)
    for fast, slow in zip(onnx, pytorch, strict=True):
        assert fast.keys() == slow.keys()
        for key in fast:
            if not isinstance(fast[key], dict):
                assert fast[key] == slow[key]
                continue
            assert fast[key].keys() == slow[key].keys()
            for column, value in fast[key].items():
                if isinstance(value, float):
                    assert value == pytest.approx(slow[key][column], abs=TOLERANCE)
                else:
                    assert value == slow[key][column] and type(value) is type(slow[key][column])


@pytest.mark.slow(reason="real `mtbert predict` processes")
def test_the_command_on_exports_gives_the_pytorch_commands_output(deployed, tmp_path):
    """The export's command as a process of its own (torch-free, as deployed); the PyTorch engine's command in
    this process (tests/commands.py). The fp32 graphs: int8, where the export deploys it, is only near."""
    pairs = dev_texts(deployed, "sts")[:6]
    jsonl = "".join(json.dumps({"id": f"r{i}", "sentence1": a, "sentence2": b}) + "\n"
                    for i, (a, b) in enumerate(pairs))
    (tmp_path / "pairs.jsonl").write_text(jsonl)
    for variant in VARIANTS:
        arguments = ["--task", "sts", "--task", "qqp", "--input", tmp_path / "pairs.jsonl"]
        assert_same_output(lines(predict("--model", deployed.exports / variant, "--engine", "onnx", *arguments)),
                           lines(predict_in_process("--model", deployed.models / variant, *arguments)))
        arguments = ["--task", "sst", "A gorgeous, witty film.", "Dull."]
        assert_same_output(lines(predict("--model", deployed.exports / variant, "--engine", "onnx", *arguments)),
                           lines(predict_in_process("--model", deployed.models / variant, *arguments)))
    tsv = ("sentence1\tsentence2\n" + "".join(f"{a}\t{b}\n" for a, b in pairs)).encode()
    arguments = ["--ensemble", deployed.ensemble_file, "--task", "sts", "--input", "-"]
    exported = predict(*arguments, "--models-dir", deployed.exports, "--engine", "onnx", stdin=tsv)
    assert_same_output(lines(subprocess_text(exported)),
                       lines(predict_in_process(*arguments, "--models-dir", deployed.models, stdin=tsv)))
    written = predict("--model", deployed.exports / "bi", "--task", "sst", "Fine.", "--output", tmp_path / "o.jsonl")
    assert written.returncode == 0 and written.stdout == ""
    assert json.loads((tmp_path / "o.jsonl").read_text())["sentence"] == "Fine."


def subprocess_text(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """A run given bytes on stdin, its output as text."""
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(), result.stderr.decode())


@pytest.mark.parametrize(("arguments", "stdin", "message"), [
    (["--task", "sst", "  "], None,
     r"^error: input row 1: sentence is empty or invisible; expected a text with at least one visible character$"),
    (["--task", "sst", "ok", "\u200b\u2060\ufeff"], None, r"^error: input row 2: sentence is empty or invisible"),
    (["--task", "sts", "one", "two", "three"], None, r"^error: 3 text arguments do not make pairs"),
    (["--task", "sts", "--input", "-"], b'{"sentence1": "a dog"}\n', r"^error: stdin row 1: no 'sentence2'"),
    (["--task", "sst", "--input", "-"], b"sentence\n\xffbad\n",
     r"^error: stdin: not UTF-8 text \(byte 0xff at offset 9\)$"),
    (["--task", "nope", "x"], None, r"^error: unknown task 'nope'"),
    (["--task", "sst", "--task", "sts", "x"], None, r"^error: tasks sst, sts mix single sentences and pairs"),
    (["--task", "sst", "--input", "-"], b"sentence\n\n", r"^error: stdin: no rows; expected sentence per row$"),
    (["--task", "sst", "--input", "-"], b'{"sentence": "fine"}\n{"sentence": 3}\n',
     r"^error: stdin row 2 \(id 2\): sentence is not text \(a JSON number\); expected a string; or pass "
     r"--skip-bad-rows to predict the others$"),
    (["--task", "sst", "--input", "-"], "sentence\nfine\n\u200b\n".encode(),
     r"^error: stdin row 2 \(id 2\): sentence is empty or invisible"),
])
def test_bad_input_is_the_same_one_line_on_both_engines(deployed, arguments, stdin, message):
    """Both engines' commands in this process (tests/commands.py), the export's on its manifest and graphs
    (the tasks it holds, its tokenizer). The printed line is checked on real processes: the export's by
    test_an_engine_that_cannot_run_the_folder_is_one_line (and, with stdin, by the slow
    test_the_command_on_exports_gives_the_pytorch_commands_output), the PyTorch engine's by test_faults."""
    stdin = stdin if stdin is not None else b""
    onnx = predict_in_process("--model", deployed.exports / "cross", *arguments, stdin=stdin)
    pytorch = predict_in_process("--model", deployed.models / "cross", *arguments, stdin=stdin)
    errors = []
    for result in (onnx, pytorch):
        errors.append(result.stderr.strip().splitlines())
        assert result.returncode == 1 and len(errors[-1]) == 1 and re.search(message, errors[-1][0]), result.stderr
    assert errors[0] == errors[1]


def test_skip_bad_rows_predicts_the_rest_and_reports_each_skipped_row(deployed):
    """One empty second sentence (as QQP's test file has at row 2194) refuses the file by default; with
    --skip-bad-rows the other rows are predicted and the bad one is named on stderr."""
    tsv = b"id\tsentence1\tsentence2\na\tA man sings.\tA man is singing.\nb\tA dog runs.\t\nc\tTwo cats.\tCats.\n"
    arguments = ["--model", deployed.exports / "cross", "--task", "sts", "--input", "-"]
    refused = predict_in_process(*arguments, stdin=tsv)
    assert refused.returncode == 1 and "stdin row 2 (id b): sentence2 is empty" in refused.stderr
    kept = predict_in_process(*arguments, "--skip-bad-rows", stdin=tsv)
    assert kept.returncode == 0, kept.stderr
    assert [json.loads(line)["id"] for line in kept.stdout.splitlines()] == ["a", "c"]
    assert kept.stderr.splitlines() == [
        "stdin row 2 (id b): skipped: sentence2 is empty or invisible; expected a text with at least one visible "
        "character", "stdin: skipped 1 of 3 rows"]
    arguments_only = predict_in_process("--model", deployed.exports / "cross", "--task", "sst", "ok", "--skip-bad-rows")
    assert arguments_only.returncode == 1 and "--skip-bad-rows is for an --input file" in arguments_only.stderr
    every = predict_in_process(*arguments, "--skip-bad-rows", stdin=b"sentence1\tsentence2\n\tx\n")
    assert every.returncode == 1 and every.stderr.splitlines()[-1] == \
           "error: stdin: every row was skipped; nothing to predict"


def test_an_engine_that_cannot_run_the_folder_is_one_line(deployed):
    cases = [(["--model", deployed.exports / "cross", "--engine", "torch"],
              rf"^error: {deployed.exports / 'cross'} is an export \(ONNX graphs\), which PyTorch cannot run"),
             (["--model", deployed.models / "cross", "--engine", "onnx"],
              rf"^error: {deployed.models / 'cross'} is not an export \(no manifest.json\).*`mtbert export --model "),
             (["--model", deployed.exports / "cross", "--bf16"], r"^error: --bf16 is for --engine torch"),
             (["--model", deployed.exports / "cross", "--engine", "gpu"], r"^error: --engine 'gpu': expected one of "
                                                                           r"auto, onnx, int8, torch$")]
    for arguments, message in cases:
        result = predict(*arguments, "--task", "sst", "a film")
        errors = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(errors) == 1 and re.search(message, errors[0]), result.stderr


def test_a_changed_or_missing_export_file_is_one_line_naming_it(deployed, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(deployed.exports / "cross", copy)
    graph = copy / "sst.onnx"
    graph.write_bytes(graph.read_bytes()[:-1] + b"\x00")
    result = predict("--model", copy, "--task", "sst", "a film", "--engine", "onnx")
    assert result.returncode == 1 and re.fullmatch(rf"error: {graph} has sha256 [0-9a-f]{{64}}, but "
                                                   rf"{copy / 'manifest.json'} expects [0-9a-f]{{64}}: the file "
                                                   r"changed after it was written \(write the folder again\)\n",
                                                   result.stderr), result.stderr
    (copy / "tokenizer.json").unlink()
    result = predict("--model", copy, "--task", "sst", "a film")
    assert result.returncode == 1 and result.stderr == \
        f"error: {copy / 'tokenizer.json'} is missing; {copy / 'manifest.json'} lists it\n"


def graph_of_two_products(path):
    """A graph `x @ matrix @ vector`: one product by a matrix, one by a vector."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    matrix = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "matrix")
    vector = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "vector")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "matrix"], ["h"], name="by_matrix"),
         helper.make_node("MatMul", ["h", "vector"], ["score"], name="by_vector")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch"])], [matrix, vector])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)


def test_int8_leaves_products_with_a_vector_weight_in_fp32(tmp_path):
    """The routing head's activation score multiplies by a vector: quantized per channel, ONNX Runtime
    refused it at run time ("b zero point is not valid"), so the quantizer must leave it in fp32."""
    import numpy as np
    import onnx
    from onnxruntime import InferenceSession

    from mtbert.export.quantize import quantize, vector_products

    source, target = tmp_path / "g.onnx", tmp_path / "g.int8.onnx"
    graph_of_two_products(source)
    assert vector_products(onnx.load(source)) == ["by_vector"]
    quantize(source, target, per_channel=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    fp32 = InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    int8 = InferenceSession(str(target), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert int8.shape == (4,) and np.allclose(int8, fp32, rtol=0.1, atol=0.1)  # runs, and stays near fp32


@pytest.mark.parametrize("per_channel", [False, True])
def test_int8_weights_keep_to_7_bits_so_a_cpu_without_vnni_does_not_saturate(tmp_path, per_channel):
    """On AVX2 without VNNI, ONNX Runtime sums pairs of uint8 x int8 products in int16 (VPMADDUBSW): 8-bit
    weights overflow it (this graph's int8 result was 1.32 for an fp32 3.92 there), 7-bit ones cannot
    (7-bit weights in [-64, 64]). Checked on the weights, so it fails on any CPU."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from mtbert.export.quantize import quantize

    graph_of_two_products(tmp_path / "g.onnx")
    quantize(tmp_path / "g.onnx", tmp_path / "g.int8.onnx", per_channel=per_channel)
    weights = [numpy_helper.to_array(t) for t in onnx.load(tmp_path / "g.int8.onnx").graph.initializer
               if t.data_type == onnx.TensorProto.INT8]
    assert weights and max(int(np.abs(w.astype(np.int16)).max()) for w in weights) <= 64  # 2 x 255 x 64 < 32768


@pytest.mark.parametrize("outliers_in_fp32", [False, True])
def test_int8_per_channel_writes_the_librarys_own_graph_byte_for_byte(deployed, tmp_path, monkeypatch,
                                                                      outliers_in_fp32):
    """The export computes each weight's per-channel int8 scales in one array operation instead of ONNX
    Runtime's loop over the channels (mtbert/export/quantize.py): on a real graph, and on one
    with a channel of zeros and one of subnormals (the scales the library replaces with 1.0), the file
    written is the library's own."""
    import contextlib

    import numpy as np
    import onnx
    from onnx import numpy_helper

    from mtbert.export import quantize as module

    graph_of_two_products(tmp_path / "small.onnx")
    small = onnx.load(tmp_path / "small.onnx")
    matrix = numpy_helper.to_array(small.graph.initializer[0]).copy()
    matrix[:, 0], matrix[:, 1] = 0.0, np.float32(1e-45)
    small.graph.initializer[0].CopyFrom(numpy_helper.from_array(matrix, "matrix"))
    onnx.save(small, tmp_path / "small.onnx")
    at_once, weights = module.per_channel_at_once, []
    monkeypatch.setattr(module, "per_channel_at_once", lambda tensor, *rest: weights.append(tensor.name)
                        or at_once(tensor, *rest))
    ways = {"at once": module._per_channel_at_once, "library": contextlib.nullcontext}
    for source in (deployed.exports / "cross" / "sst.onnx", tmp_path / "small.onnx"):
        written = {}
        for way, quantizer in ways.items():
            monkeypatch.setattr(module, "_per_channel_at_once", quantizer)
            module.quantize(source, tmp_path / "int8.onnx", per_channel=True, outliers_in_fp32=outliers_in_fp32)
            written[way] = (tmp_path / "int8.onnx").read_bytes()
        assert written["at once"] == written["library"], source.name
    assert "matrix" in weights and len(weights) > 10  # both graphs' weights went through the array operation


def test_the_quantizer_logs_no_line_per_tensor_and_the_projects_loggers_are_untouched(tmp_path, caplog):
    """ONNX Runtime's quantizer logs an INFO line per tensor on the root logger (thousands for MPNet, in
    every export's log); the export drops them, and nothing else, only while it quantizes."""
    import logging

    from mtbert.export.quantize import quantize

    graph_of_two_products(tmp_path / "g.onnx")
    caplog.set_level(logging.INFO)
    filters = list(logging.getLogger().filters)
    quantize(tmp_path / "g.onnx", tmp_path / "g.int8.onnx", per_channel=False)
    logging.info("after quantizing")
    logging.getLogger("mtbert.export").info("the project's own line")
    lines = [(record.name, record.levelname, record.getMessage()) for record in caplog.records]
    assert lines == [("root", "INFO", "after quantizing"), ("mtbert.export", "INFO", "the project's own line")]
    assert logging.getLogger().filters == filters
