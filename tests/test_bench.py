"""The benchmark suite runs end to end on a 2-layer backbone and tiny data (figures checked for shape, not speed)."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bench.peer import Tally, batches_between, mixed_rate, num_labels, padding_fraction
from bench.suite import app, pad_to
from tests.conftest import make_params, synthetic_raw_files, write_raw_files


def test_pad_to_pads_token_tensors_only():
    import torch

    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long),
             "labels": torch.tensor([1.0, 0.0]), "states": torch.ones(2, 3, 4)}  # the frozen layers' (B, T, hidden)
    padded = pad_to(batch, 5)
    assert padded["input_ids"].tolist() == [[1, 1, 1, 0, 0]] * 2
    assert padded["attention_mask"].sum() == 6 and torch.equal(padded["labels"], batch["labels"])
    assert padded["states"].shape == (2, 5, 4) and padded["states"].sum() == 24  # along the tokens only


def test_the_overall_rate_weights_each_task_by_its_share_of_the_batches():
    """Per-batch means weighted by the epoch's mix, not the timed sample's: sst 10 examples in 1 s per batch,
    qqp 20 in 1 s per batch, equal shares: 15 examples/s, however many batches of each were timed."""
    tallies = {"sst": Tally(seconds=1.0, examples=10, tokens=100, batches=1),
               "qqp": Tally(seconds=4.0, examples=80, tokens=400, batches=4)}
    rate = mixed_rate(tallies, {"sst": 0.5, "qqp": 0.5})
    assert rate == {"examples_per_second": 15.0, "tokens_per_second": 100.0}
    assert mixed_rate(tallies, {"sst": 0.0, "qqp": 1.0})["examples_per_second"] == 20.0


@pytest.mark.parametrize("batches_per_epoch, timed_steps", [(267, 12), (96, 12), (4, 2), (13, 12)])
def test_the_timed_batches_spread_over_one_epoch(batches_per_epoch, timed_steps):
    """The warm-up batch, then `timed_steps` batches each after `batches_between` dropped ones: all inside the
    first epoch (the next one restarts the Trainer's longest-first order), the last in its final stretch."""
    gap = batches_between(batches_per_epoch, timed_steps)
    taken = [step * (gap + 1) for step in range(timed_steps + 1)]  # positions drawn: warm-up first
    assert taken[-1] < batches_per_epoch
    assert batches_per_epoch - taken[-1] <= 2 * (gap + 1)


def test_an_epoch_too_short_for_the_warm_up_and_the_timed_batches_drops_none():
    """12 batches for a warm-up and 12 timed ones: none is dropped, so only the last timed batch comes from
    the next epoch."""
    assert batches_between(12, 12) == 0


def test_padding_counts_each_batch_padded_to_its_longest_row_per_token_column():
    lengths = np.array([3, 5, 4])
    assert padding_fraction([np.array([0, 1]), np.array([2])], [lengths]) == round(1 - 12 / 14, 4)
    assert padding_fraction([np.array([0, 1, 2])], [lengths]) == round(1 - 12 / 15, 4)
    # a bi-encoder's sentences are padded apart: the second column's batch pads 2 + 2 to 4 + 4
    assert padding_fraction([np.array([0, 1])], [lengths[:2], np.array([2, 4])]) == round(1 - 14 / 18, 4)


def test_side_by_side_times_a_sentence_and_a_pair_task_that_every_export_serves(monkeypatch):
    """A member's folder inside an ensemble's export serves only the tasks the ensemble gave it (here not SST):
    the timing then has no one-sentence task, and says so in one line naming the exports."""
    from types import SimpleNamespace

    import typer

    from bench import side_by_side
    from bench.side_by_side import shared_tasks, task_with_columns

    sentence = SimpleNamespace(text_columns=["sentence"])
    pair = SimpleNamespace(text_columns=["sentence1", "sentence2"])
    served = {"distilled": {"sst": sentence, "sts": pair, "qqp": pair}, "base": {"qqp": pair, "sts": pair}}
    monkeypatch.setattr(side_by_side, "load_export", lambda folder: SimpleNamespace(tasks=served[Path(folder).name]))
    exports = {"student": Path("exports/distilled"), "base": Path("exports/ensemble/base")}
    shared = shared_tasks(exports)
    assert list(shared) == ["sts", "qqp"]  # the baseline's order
    assert task_with_columns(shared, 2, exports) == "sts"
    with pytest.raises(typer.BadParameter, match=r"^no one-sentence task is served by every export "
                       r"\(student=exports/distilled, base=exports/ensemble/base\); they share \['qqp', 'sts'\]$"):
        task_with_columns(shared, 1, exports)


def test_the_peer_has_run_glues_label_counts():
    from mtbert.data.kinds import Binary, Classification, Regression

    assert [num_labels(kind) for kind in (Classification(5), Binary(), Regression(0, 5))] == [5, 2, 1]


def test_a_child_process_reports_its_own_peak_memory_not_its_parents():
    """Figure 6 runs training as a child of the suite: getrusage's ru_maxrss would hand it the suite's own
    resident memory at fork, which outlives exec."""
    ballast = bytearray(768 * 2 ** 20)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # touch every page, so it is resident
    report = "from mtbert.runtime import peak_rss_gib; print(peak_rss_gib())"
    child = subprocess.run([sys.executable, "-c", report], capture_output=True, text=True, check=True)
    assert 0 < float(child.stdout) < 0.25, child.stdout


@pytest.mark.slow(reason="the whole benchmark suite, a training child process included")
def test_suite_writes_every_figure(tmp_path, tiny_backbone, tiny_tokenized):
    raw = write_raw_files(tmp_path / "raw", synthetic_raw_files(16))
    params = make_params(tmp_path, tiny_backbone, raw, heads={"sts": {"encoding": "bi", "combine": "cosine"}})
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["--train-steps", "2", "--block", "1", "--smart-steps", "2", "--peer-steps", "2",
                                      "--predict-examples", "8", "--memory-steps", "2",
                                      "--params-file", str(params), "--tokenized-dir", str(tiny_tokenized),
                                      "--exports-dir", str(tmp_path / "no-exports"), "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["cpu"] and figures["threads"] >= 1  # a figure names the processor it holds for
    assert set(figures["train"]) == {"naive", "default", "default_bf16", "default_static"}
    assert figures["static_shapes"]["multiple"] == 16 and figures["static_shapes"]["over_default"] > 0
    assert all(figures["train"][name]["examples"] == 8 for name in figures["train"])  # 2 steps of 4
    assert figures["train_speedup"]["default"] > 0 and figures["smart_ratio"] > 0 and figures["smart_random_ratio"] > 0
    assert figures["predict"]["sentences_per_second"] > 0 and figures["tokenize_seconds"] > 0
    assert 0 < figures["peak_rss_gib"] < 24
    assert figures["engine"]["single_sentence_ms"]["p95"] >= figures["engine"]["single_sentence_ms"]["p50"] > 0
    assert figures["engine"]["engine_sentences_per_second"] > 0
    # the Trainer peer against mtbert's train step: 2 timed batches of 4 per task each way
    peer = figures["peer"]
    assert set(peer["tasks"]) == {"sst", "qqp", "sts"} and peer["steps_per_task"] == 2
    for row in peer["tasks"].values():
        for side in ("peer", "mtbert"):
            assert row[side]["examples_per_second"] > 0 and row[side]["tokens_per_second"] > 0
            assert row[side]["batches"] == 2 and row[side]["examples"] == 8
        assert row["ratio"] > 0
    # the same examples each way: the same tokens cross-encoded; STS's bi-encoder adds a [CLS] per pair
    tasks = peer["tasks"]
    assert tasks["sst"]["mtbert"]["tokens"] == tasks["sst"]["peer"]["tokens"]
    assert tasks["qqp"]["mtbert"]["tokens"] == tasks["qqp"]["peer"]["tokens"]
    assert tasks["sts"]["mtbert"]["tokens"] == tasks["sts"]["peer"]["tokens"] + 8
    assert all(0 <= fraction < 1 for sides in peer["padding"].values() for fraction in sides.values())
    assert peer["overall"]["ratio"] > 0 and peer["overall"]["peer"]["examples_per_second"] > 0
    assert abs(sum(peer["task_share"].values()) - 1) < 1e-3 and peer["precision"] == "fp32"
    # the matmul peak at the model's own shapes, and the training's fraction of it
    shapes = figures["matmul_shape_gflops"]
    assert shapes["rows"] > 0 and (shapes["hidden"], shapes["intermediate"]) == (384, 1536)
    assert all(shapes[precision][name] > 0 for precision in ("fp32", "bf16")
               for name in ("qkvo", "ffn_up", "ffn_down", "layer"))
    assert all(figures["train"][name]["fraction_of_shape_peak"] > 0 for name in figures["train"])
    # the peer is the headline, printed first
    output = result.output
    assert "1. train speed mtbert / Hugging Face Trainer" in output and "7. mtbert predict" in output
    assert output.index("1. train speed mtbert / Hugging Face Trainer") < output.index("1b. train speed-up default")
    assert figures["deploy"] is None and "8. deployment: skipped" in output  # no export: test_deploy_bench's


def test_profile_groups_a_steps_operators_into_categories(tmp_path, tiny_backbone, tiny_tokenized):
    from bench.probes.profile_step import app as profile_app
    from bench.probes.profile_step import category

    assert category("aten::addmm") == "matmul" and category("aten::_fused_adamw_") == "optimizer (AdamW)"
    assert category("aten::bernoulli_") == "dropout" and category("aten::something_new") == "other operators"
    params = make_params(tmp_path, tiny_backbone, write_raw_files(tmp_path / "raw", synthetic_raw_files(16)),
                         train={"ema": 0.5})  # a moving average: its epoch end can evaluate the raw weights too
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(profile_app, ["--steps", "2", "--warmup", "1", "--params-file", str(params),
                                              "--tokenized-dir", str(tiny_tokenized), "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    shares = [entry["share"] for entry in figures["categories"].values()]
    assert figures["steps"] == 2 and "matmul" in figures["categories"] and all(share >= 0 for share in shares)
    assert figures["outside_operators_share"] == pytest.approx(max(0.0, 1 - sum(shares)), abs=0.01)
    assert figures["top_operators"] and "top operators (self CPU)" in result.output
    parts = figures["epoch_end"]["parts"]  # the epoch end's evaluation passes, each timed
    assert set(parts) == {"dev pass and dumps", "test predictions (train.snapshot_test)",
                          "raw weights' dev pass (train.dev_raw)"}
    assert all(part["seconds"] > 0 and 0 < part["share_of_epoch"] < 1 for part in parts.values())
    assert "an epoch end's evaluation" in result.output


def test_dropout_probe_times_every_arm(tmp_path, tiny_backbone, tiny_tokenized):
    from bench.probes.dropout_masks import app as probe_app

    params = make_params(tmp_path, tiny_backbone, write_raw_files(tmp_path / "raw", synthetic_raw_files(16)))
    out = tmp_path / "dropout.json"
    result = CliRunner().invoke(probe_app, ["--steps", "2", "--block", "1", "--mask-repeats", "2",
                                            "--params-file", str(params), "--tokenized-dir", str(tiny_tokenized),
                                            "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert set(figures["steps"]) == {"stage (mtbert's masks)", "pytorch's masks"}
    assert figures["timed_steps"] == 2 and figures["steps"]["pytorch's masks"]["speedup_over_pytorch_masks"] == 1.0
    assert all(entry["mean_step_seconds"] > 0 for entry in figures["steps"].values())
    assert figures["dropout_speedup"] > 0


def test_the_probes_pytorch_arm_draws_pytorchs_masks_and_restores_mtberts():
    import torch
    import torch.nn.functional as F

    from bench.probes.dropout_masks import pytorch_masks
    from mtbert.model import dropout

    cheap = dropout.drop
    model = torch.nn.Sequential(dropout.Dropout(0.5))
    x = torch.ones(200)
    with pytorch_masks(model):
        torch.manual_seed(0)
        inside = model(x)
    torch.manual_seed(0)
    assert torch.equal(inside, F.dropout(x, 0.5)) and dropout.drop is cheap


def test_pretrain_attention_probe_times_both_implementations(tmp_path, tiny_backbone, tiny_tokenized):
    from bench.probes.pretrain_attention import app as probe_app
    from tests.test_pretrain import pretrain_params

    out = tmp_path / "pretrain-attention.json"
    result = CliRunner().invoke(probe_app, ["--steps", "2", "--block", "1", "--tokenized-dir", str(tiny_tokenized),
                                            "--params-file", str(pretrain_params(tmp_path, tiny_backbone)),
                                            "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["timed_steps"] == 2 and set(figures["mean_step_seconds"]) == {"eager", "sdpa"}
    assert all(seconds > 0 for seconds in figures["mean_step_seconds"].values())
    assert figures["eager_speedup_over_sdpa"] > 0


@pytest.mark.slow(reason="cold starts of real processes and a load test of the server")
def test_deploy_bench_writes_every_figure(tmp_path, deployed, caplog):
    """Figure 8 on the small exported variant: every engine, the cold starts and the bounded load test."""
    from bench.deploy import app as deploy_app

    caplog.set_level(logging.INFO)  # as `python -m bench` logs

    out = tmp_path / "deploy.json"
    result = CliRunner().invoke(deploy_app, ["--model", "cross", "--params-file", str(deployed.params_file),
                                             "--models-dir", str(deployed.models), "--exports-dir",
                                             str(deployed.exports), "--tokenized-dir", str(deployed.tokenized),
                                             "--texts-per-task", "8", "--single-calls", "5", "--rounds", "1",
                                             "--cold-starts", "1", "--clients", "3", "--requests", "4",
                                             "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["engines"] == ["torch", "onnx", "int8"]
    assert figures["onnx_process_imported_torch"] is False  # the ONNX engines were timed as deployed
    for engine in figures["engines"]:
        assert figures["single_sentence_ms"][engine]["p95"] >= figures["single_sentence_ms"][engine]["p50"] > 0
        assert figures["sentences_per_second"][engine] > 0
    assert set(figures["speedup_over_torch"]) == {"onnx", "int8"}
    assert figures["cold_start_seconds"]["export"] > 0 and figures["cold_start_seconds"]["torch"] > 0
    server = figures["server"]
    assert server["sent"] == 12 and server["answered"] == {"200": 12} and server["accounted_for"]
    assert server["latency_ms"]["p99"] >= server["latency_ms"]["p50"] > 0 and server["requests_per_second"] > 0
    assert server["peak_rss_mib"] > 50  # the server process (Python, ONNX Runtime and the graphs) was measured
    assert "8. deployment" in result.output and "mtbert serve (1 worker(s)): 12 requests" in result.output
    assert not [record for record in caplog.records if record.name == "httpx"]  # no line per request


def test_the_int8_batch_size_probe_scores_both_graphs_at_each_size(deployed):
    """bench/probes/int8_batch_size.py on the small cross-encoder's export: every task at each batch size, on
    both graphs; fp32's figures do not depend on the batch (padding is masked), int8's may."""
    from bench.probes.int8_batch_size import app as probe

    result = CliRunner().invoke(probe, ["--export", str(deployed.exports / "cross"), "--tokenized-root",
                                        str(deployed.tokenized_root), "--params-file", str(deployed.params_file),
                                        "--batch-size", "1", "--batch-size", "5", "--threads", "1"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert [(row["member"], row["task"]) for row in rows] == [("cross", "sst"), ("cross", "qqp"), ("cross", "sts")]
    for row in rows:
        assert row["onnx"]["1"] == pytest.approx(row["onnx"]["5"], abs=1e-6)
        assert row["int8_drop"] == {size: round(row["onnx"][size] - row["int8"][size], 6) for size in ("1", "5")}
    assert rows[2]["int8"]["1"] != rows[2]["onnx"]["1"]  # STS's Pearson r: the two graphs differ
    assert "| cross | sts | " in result.output


def test_serve_bench_drives_a_normal_load_an_overload_and_vanishing_clients(tmp_path, deployed):
    """`python -m bench.serve` in small: every request accounted for, each overload request answered by the
    server (200 or 429; none refused by the machine), and a fresh request answered after each phase."""
    from bench.serve import app as serve_app

    out = tmp_path / "serve.json"
    result = CliRunner().invoke(serve_app, ["--model", str(deployed.exports / "bi"), "--tokenized-dir",
                                            str(deployed.tokenized), "--clients", "3", "--requests", "2",
                                            "--overload", "40", "--overload-texts", "8", "--overload-chars", "300",
                                            "--give-up", "0.5", "--threads", "1", "--server-arg=--max-concurrent-"
                                            "requests", "--server-arg=4", "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["normal"]["answered"] == {"200": 6} and figures["normal"]["shed_share"] == 0
    overload = figures["overload"]
    assert overload["accounted_for"] and set(overload["answered"]) <= {"200", "429"}
    assert overload["answered"].get("429", 0) > 0 and overload["shed_share"] > 0  # past 4 concurrent requests
    assert figures["vanishing"]["accounted_for"]
    for phase in ("overload", "vanishing"):
        assert figures[phase]["fresh_request_after"][1] == 200
        admitted = figures[phase]["admitted"]  # the server's own log: every request it took, answered in time
        assert admitted["requests"] > 0 and admitted["within_timeout"], admitted
    assert figures["overload"]["admitted"]["requests"] == sum(
        count for status, count in overload["answered"].items() if status != "429")
    assert figures["peak_rss_mib"]["vanishing"] >= figures["peak_rss_mib"]["idle"] > 50
    assert "overload: 40 requests" in result.output


@pytest.mark.slow(reason="four small trainings and a BERT-base-shaped encoder built on the CPU")
def test_the_admitted_count_waits_for_the_log_lines_of_every_answer_seen(tmp_path):
    """The server logs a request just after its answer has gone, so a client can see every answer before the
    log holds them all: the count waits for one line per answer seen, and a line still being written is left,
    whole, to the next phase."""
    import threading

    from bench.serve import admitted_answers

    def line(status: int, seconds: float) -> str:
        return json.dumps({"time": 0.0, "path": "/predict", "status": status, "seconds": seconds}) + "\n"

    def append(text: str) -> None:
        with log.open("a") as file:
            file.write(text)

    log = tmp_path / "serve.log"
    log.write_text("server started\n" + line(200, 1.0) + line(429, 0.01))
    late = threading.Timer(0.3, append, [line(200, 2.0) + line(503, 31.5)[:20]])
    late.start()
    figures, end = admitted_answers(log, len("server started\n"), request_timeout=30.0, answered=3, wait=10)
    late.join()
    assert figures["requests"] == 2 and figures["slowest_s"] == 2.0 and figures["logged_of_answered"] == [3, 3]
    assert figures["within_timeout"]
    append(line(503, 31.5)[20:])
    rest, _ = admitted_answers(log, end, request_timeout=30.0)
    assert rest["requests"] == 1 and not rest["within_timeout"]  # 31.5 s: past the timeout and its slack


def test_the_gpu_bench_dry_runs_on_the_cpu(tmp_path, tiny_backbone, tiny_tokenized):
    """`python -m bench.gpu` end to end without a GPU: the eager step and the peer on the same examples, the
    BERT-base-shaped encoder, the short run; the CUDA parts (peak, captured step) are absent."""
    from bench.gpu import app as gpu_app

    params = make_params(tmp_path, tiny_backbone, write_raw_files(tmp_path / "raw", synthetic_raw_files(16)))
    out = tmp_path / "bench-gpu.json"
    result = CliRunner().invoke(gpu_app, ["--steps-per-task", "2", "--block", "1", "--base-steps-per-task", "1",
                                          "--base-layers", "1", "--short-rows", "8", "--params-file", str(params),
                                          "--tokenized-dir", str(tiny_tokenized), "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["device"] == "cpu (dry run)" and figures["bf16_peak_tflops"] is None
    default = figures["default"]
    assert set(default) == {"eager", "peer", "eager_over_peer"} and default["eager_over_peer"] > 0
    for side in ("eager", "peer"):
        assert default[side]["examples_per_second"] > 0 and default[side]["peak_fraction"] is None
        assert all(task["batches"] == 2 and task["examples"] == 8 for task in default[side]["tasks"].values())
    # the same examples each way (STS's bi-encoder would add a [CLS] per pair; the tests cross-encode it)
    assert {t: s["tokens"] for t, s in default["eager"]["tasks"].items()} == \
           {t: s["tokens"] for t, s in default["peer"]["tasks"].items()}
    assert set(figures["bert_base_shaped"]) == {"layers", "eager"} and figures["bert_base_shaped"]["layers"] == 1
    assert figures["bert_base_shaped"]["eager"]["tasks"]["sst"]["batches"] == 1
    assert set(figures["short_run"]) == {"eager"} and 0 <= figures["short_run"]["eager"]["dev"]["overall"] <= 1
