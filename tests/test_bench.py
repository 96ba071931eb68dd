"""The benchmark suite runs end to end on a 2-layer backbone and tiny data (figures checked for shape, not speed)."""

import json
import subprocess
import sys

from typer.testing import CliRunner

from bench.suite import app, pad_to
from tests.conftest import make_params, synthetic_raw_files, write_raw_files


def test_pad_to_pads_token_tensors_only():
    import torch

    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long),
             "labels": torch.tensor([1.0, 0.0])}
    padded = pad_to(batch, 5)
    assert padded["input_ids"].tolist() == [[1, 1, 1, 0, 0]] * 2
    assert padded["attention_mask"].sum() == 6 and torch.equal(padded["labels"], batch["labels"])


def test_a_child_process_reports_its_own_peak_memory_not_its_parents():
    """Figure 6 runs training as a child of the suite: getrusage's ru_maxrss would hand it the suite's own
    resident memory at fork, which outlives exec."""
    ballast = bytearray(768 * 2 ** 20)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # touch every page, so it is resident
    report = "from mtbert.runtime import peak_rss_gib; print(peak_rss_gib())"
    child = subprocess.run([sys.executable, "-c", report], capture_output=True, text=True, check=True)
    assert 0 < float(child.stdout) < 0.25, child.stdout


def test_suite_writes_every_figure(tmp_path, tiny_backbone, tiny_tokenized):
    raw = write_raw_files(tmp_path / "raw", synthetic_raw_files(16))
    params = make_params(tmp_path, tiny_backbone, raw)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["--train-steps", "2", "--block", "1", "--smart-steps", "2",
                                      "--predict-examples", "8", "--memory-steps", "2",
                                      "--params-file", str(params), "--tokenized-dir", str(tiny_tokenized),
                                      "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert set(figures["train"]) == {"naive", "default", "default_bf16"}
    assert all(figures["train"][name]["examples"] == 8 for name in figures["train"])  # 2 steps of 4
    assert figures["train_speedup"]["default"] > 0 and figures["smart_ratio"] > 0 and figures["smart_random_ratio"] > 0
    assert figures["predict"]["sentences_per_second"] > 0 and figures["tokenize_seconds"] > 0
    assert 0 < figures["peak_rss_gib"] < 24
    assert figures["engine"]["single_sentence_ms"]["p95"] >= figures["engine"]["single_sentence_ms"]["p50"] > 0
    assert figures["engine"]["engine_sentences_per_second"] > 0
    assert "1. train speed-up default / naive" in result.output and "7. mtbert predict" in result.output
