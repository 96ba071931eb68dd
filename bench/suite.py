"""The speed benchmarks: every figure a ratio against a baseline measured in the same run.

    python -m bench [--train-steps 24] [--peer-steps 12] [--json-out metrics/bench.json]

1. training throughput (examples/s, non-padding tokens/s) of the `train` stage's step against its peer,
   what a user would run instead: three Hugging Face `Trainer` fine-tunings of the same backbone, the
   run_glue way, on the same batches' examples (bench/peer.py), per task and over an epoch's mix, and
   each side's padding over an epoch of its own batches;
1b. the same of the default variant against the naive loop of the common GLUE example scripts: every
   batch padded to tokenize.max_length, fp32, no length bucketing; with bf16 autocast on top of the
   defaults; and with the GPU's static shapes (runtime.pad_to_multiple's cuda value) on this CPU, which is
   what that padding would cost here;
2. useful training FLOP/s (6 x the non-embedding parameters an example goes through x non-padding tokens)
   as a fraction of this machine's matmul peak in the precision the configuration ran in, measured here:
   the big-square peak, and the peak at the model's own shapes (a typical batch's padded rows by the
   hidden and feed-forward widths);
3. SMART (K = 1) and SMART's random mode step time over plain step time (bench/smart_step.py's
   measurement, the three alternating);
4. prediction throughput (sentences/s) of `predict`'s code against the same naive padding;
5. `tokenize` wall time for all nine files, interpreter start included;
6. peak resident memory of a process training the default variant (steps, an evaluation, a checkpoint);
7. `mtbert predict`'s engine: one-sentence latency (p50, p95) and batched sentences/s from raw text, against
   the `predict` stage's path over the tokenized splits (bench/inference.py);
8. the deployed model (bench/deploy.py; the first of export.models), where models/<model> and exports/<model>
   exist: cold start of a `mtbert predict` call, one-sentence p50/p95 and batched sentences/s for PyTorch, ONNX fp32 and
   int8, and a bounded load test of `mtbert serve` on loopback;
8b. the deployed ensemble (exports/ensemble, where it exists): one sentence's and one pair's p50 and batched
   texts/s, against the same members assembled apart and against its first member alone, and `mtbert serve`
   at 64 clients on the export against `--ensemble` over the members' exports;
8c. the exports of export.models beside exports/ensemble, where both exist (bench/side_by_side.py): one
   sentence's and one pair's p50 and batched texts/s in one process, and `mtbert serve` at 64 clients on
   each: requests/s and the server's peak memory, each as a ratio over the ensemble's.

The configurations being compared alternate in short blocks over the same kind of real batches, so a
change in the machine's speed during the run hits all of them alike. Needs data/tokenized/base
(`dvc repro tokenize@base`) and data/raw.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import typer

from bench.common import cpu_name, scratch_run, verdict
from bench.deploy import deploy_figures, ensemble_figures, report_ensemble
from bench.deploy import report as report_deploy
from bench.inference import engine_figures
from bench.peer import peer_figures
from bench.side_by_side import report as report_side_by_side
from bench.side_by_side import side_by_side_figures
from bench.smart_step import alternating_step_times, ratios
from mtbert import io
from mtbert.data.batches import TaskSplit, eval_batches, load_split
from mtbert.data.sampling import TaskStream
from mtbert.params_file import variant_params
from mtbert.runtime import setup_logging
from mtbert.training.build import FineTuning, make_objective, schedule
from mtbert.training.progress import Progress
from mtbert.training.step import Piece, compute

TARGETS = {"peer_speedup": 2.0, "train_speedup": 3.0, "peak_fraction": 0.40, "smart_ratio": 2.5,
           "smart_random_ratio": 2.0, "tokenize_seconds": 15.0, "peak_rss_gib": 3.0}
app = typer.Typer(add_completion=False)


# --- the machine ------------------------------------------------------------------------------------
def matmul_gflops(dtype: torch.dtype, size: int = 1024, seconds: float = 2.0,
                  shape: tuple[int, int, int] | None = None) -> float:
    """Best sustained GFLOP/s of matmuls in `dtype` over about `seconds`: square ones of `size`, or
    (m x k) @ (k x n) for shape (m, k, n)."""
    m, k, n = shape or (size, size, size)
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    torch.mm(a, b)  # warm-up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = max(best, 4 * 2 * m * k * n / (time.perf_counter() - started) / 1e9)
    return best


def shape_peaks(rows: int, hidden: int, intermediate: int, seconds: float = 0.5, rounds: int = 4) -> dict:
    """The matmul peak at the model's own shapes, fp32 and bf16: `rows` (a typical batch's padded tokens)
    by the attention projections (hidden x hidden), the feed-forward's up (hidden x intermediate) and down
    (intermediate x hidden) products; `layer` is the rate of one encoder layer's mix of them (4 projections,
    one up, one down), each at its own peak. Each shape's best over `rounds` rounds of `seconds`, the shapes
    and precisions taking turns, so that a slow spell of the machine during one probe is not taken for
    the peak (docs/performance.md, figure 2)."""
    shapes = {"qkvo": (rows, hidden, hidden), "ffn_up": (rows, hidden, intermediate),
              "ffn_down": (rows, intermediate, hidden)}
    flops = {"qkvo": 4 * hidden * hidden, "ffn_up": hidden * intermediate, "ffn_down": intermediate * hidden}
    figures: dict = {"rows": rows, "hidden": hidden, "intermediate": intermediate}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    best = {(precision, name): 0.0 for precision in dtypes for name in shapes}
    for _ in range(rounds):
        for precision, name in best:
            rate = matmul_gflops(dtypes[precision], shape=shapes[name], seconds=seconds)
            best[precision, name] = max(best[precision, name], rate)
    for precision in dtypes:
        peaks = {name: best[precision, name] for name in shapes}
        layer = sum(flops.values()) / sum(flops[name] / peaks[name] for name in shapes)
        figures[precision] = {**{name: round(peak, 1) for name, peak in peaks.items()}, "layer": round(layer, 1)}
    return figures


# --- training ---------------------------------------------------------------------------------------
def pad_to(batch: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """Every token tensor of a batch padded with zeros ([PAD], mask 0, type 0) to `length` columns; the frozen
    layers' states (B, T, hidden) along T."""
    return {k: v if k == "labels" else torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, length - v.shape[1]))
            for k, v in batch.items()}


class TrainConfig:
    """One way of feeding the training run: its batch streams, padding rule and precision."""

    def __init__(self, name: str, run: FineTuning, progress: Progress, *, bucket_batches: int,
                 pad_length: int | None, bf16: bool, pad_multiple: int = 1):
        self.name, self.progress, self.pad_length, self.bf16 = name, progress, pad_length, bf16
        self.pad_multiple = pad_multiple
        # the same run (model, optimiser, schedule, average) with this configuration's precision
        self.run = dataclasses.replace(run, objective=make_objective(run.model, run.params.smart, run.device, bf16,
                                                                     run.train.seed))
        self.streams = {t: TaskStream(split.lengths(run.model.encoding(t)), run.train.batch_size[t],
                                      bucket_batches, run.train.seed, i)
                        for i, (t, split) in enumerate(run.train_data.items())}
        self.reset()

    def reset(self) -> None:
        self.seconds, self.examples, self.tokens, self.padded, self.steps = 0.0, 0, 0, 0, 0

    def step(self, task: str) -> None:
        rows = self.streams[task].next()
        batch = self.run.train_data[task].batch(rows, self.run.model.encoding(task), self.pad_multiple)
        if self.pad_length is not None:
            batch = pad_to(batch, self.pad_length)
        started = time.perf_counter()
        # the stage's device work and LR schedule on this batch, whole (one piece: the naive side has no pieces)
        compute(self.run, self.progress, {task: [Piece(batch, len(rows), 0, share=1.0, weight=1.0)]}, ends_update=True)
        self.run.scheduler.step()
        self.seconds += time.perf_counter() - started
        self.examples += len(rows)
        self.tokens += int(sum(v.sum() for k, v in batch.items() if k.startswith("attention_mask")))
        self.padded += sum(v.numel() for k, v in batch.items() if k.startswith("attention_mask"))
        self.steps += 1

    def figures(self) -> dict:
        return {"examples_per_second": round(self.examples / self.seconds, 2),
                "tokens_per_second": round(self.tokens / self.seconds, 1), "seconds": round(self.seconds, 2),
                "examples": self.examples}


def train_throughput(run: FineTuning, progress: Progress, steps: int, block: int) -> dict[str, TrainConfig]:
    max_length = run.params.tokenize.max_length
    configs = {
        "naive": TrainConfig("naive", run, progress, bucket_batches=1, pad_length=max_length, bf16=False),
        "default": TrainConfig("default", run, progress, bucket_batches=run.train.bucket_batches, pad_length=None,
                               bf16=run.bf16),
        "default_bf16": TrainConfig("default_bf16", run, progress, bucket_batches=run.train.bucket_batches,
                                    pad_length=None, bf16=True),
        "default_static": TrainConfig("default_static", run, progress, bucket_batches=run.train.bucket_batches,
                                      pad_length=None, bf16=run.bf16,
                                      pad_multiple=run.params.runtime.pad_to_multiple.cuda),
    }
    first_tasks = [tasks[0] for tasks in schedule(run, 0)]
    for config in configs.values():  # warm-up, then reset the counters
        config.step(first_tasks[0])
        config.reset()
    for start in range(0, steps, block):
        for config in configs.values():
            for task in first_tasks[start:start + block]:
                config.step(task)
    return configs


def non_embedding_parameters(run: FineTuning) -> float:
    """The non-embedding parameters one example goes through (its task's encoders and head), averaged over
    the tasks: with CerBERTus a token passes one copy of the top layers, not every task's copy."""
    per_task = []
    for task in run.tasks:
        modules = [*run.model.encoders.for_task(task), run.model.heads[task]]
        input_side = run.model.family.depth_zero  # the embeddings (and MPNet's position bias table)
        unique = {id(p): p for module in modules for n, p in module.named_parameters()
                  if not any(part in n for part in input_side)}
        per_task.append(sum(p.numel() for p in unique.values()))
    return sum(per_task) / len(per_task)


# --- prediction -------------------------------------------------------------------------------------
def predict_seconds(run: FineTuning, dev: dict[str, TaskSplit], batch_size: int, pad_length: int | None) -> float:
    """Wall time to predict the dev splits: length-sorted batches (pad_length None) or file order, padded."""
    model = run.model.eval()
    seconds = 0.0
    with torch.inference_mode():
        for task, split in dev.items():
            encoding = model.encoding(task)
            lengths = split.lengths(encoding)
            batches = eval_batches(lengths, batch_size) if pad_length is None else \
                [np.arange(i, min(i + batch_size, len(split))) for i in range(0, len(split), batch_size)]
            started = time.perf_counter()
            for rows in batches:
                batch = split.batch(rows, encoding)
                model.predictions(task, model(task, pad_to(batch, pad_length) if pad_length else batch))
            seconds += time.perf_counter() - started
    model.train()
    return seconds


# --- separate processes -----------------------------------------------------------------------------
def tokenize_seconds(params_file: Path) -> float:
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "stages.tokenize", "--params-file", str(params_file),
                        "--out-dir", f"{scratch}/tok", "--rejects-file", f"{scratch}/rejects.tsv",
                        "--metrics-file", f"{scratch}/data.json"], check=True, capture_output=True)
        return time.perf_counter() - started


def training_peak_rss_gib(params_file: Path, tokenized_dir: Path, variant: str, steps: int) -> float:
    """Peak RSS of a child that trains `steps` steps, evaluates on dev and writes a resume checkpoint."""
    child = subprocess.run([sys.executable, "-m", "bench.train_memory", "--steps", str(steps), "--variant", variant,
                            "--params-file", str(params_file), "--tokenized-dir", str(tokenized_dir)],
                           check=True, capture_output=True, text=True)
    return json.loads(child.stdout.strip().splitlines()[-1])["peak_rss_gib"]


# --- the report -------------------------------------------------------------------------------------
@app.command()
def main(train_steps: int = typer.Option(24, help="timed training steps per configuration"),
         block: int = typer.Option(4, help="steps per block; the configurations alternate block by block"),
         peer_steps: int = typer.Option(12, help="timed training steps per task for the Trainer peer and for "
                                                 "mtbert's train step each"),
         smart_steps: int = typer.Option(12, help="timed steps each for SMART and plain"),
         predict_examples: int = typer.Option(1000, help="dev examples per task for the prediction benchmark"),
         memory_steps: int = typer.Option(20, help="training steps of the peak-memory child"),
         variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized/base")),
         deployed: str = typer.Option("", help="figure 8: the model whose export is timed (default: the first of "
                                               "export.models) ..."),
         models_dir: Path = typer.Option(Path("models"), help="... trained there ..."),
         exports_dir: Path = typer.Option(Path("exports"), help="... and exported there (both must exist)"),
         json_out: Path = typer.Option(Path("metrics/bench.json"))) -> None:
    setup_logging()
    params = variant_params(params_file, variant)
    torch.set_num_threads(params.runtime.threads or torch.get_num_threads())
    figures: dict = {"cpu": cpu_name(), "threads": torch.get_num_threads()}
    print(f"{figures['cpu']}; matmul peak ({figures['threads']} threads) ...", flush=True)
    figures["matmul_gflops"] = {"fp32": round(matmul_gflops(torch.float32), 1),
                                "bf16": round(matmul_gflops(torch.bfloat16), 1)}
    with tempfile.TemporaryDirectory() as scratch:
        run, progress = scratch_run(params, variant, tokenized_dir, Path(scratch))
        run.model.train()
        print(f"training: naive / default / default+bf16 / default with static shapes, {train_steps} steps each ...",
              flush=True)
        configs = train_throughput(run, progress, train_steps, block)
        figures["train"] = {name: config.figures() for name, config in configs.items()}
        flops = 6 * non_embedding_parameters(run)
        useful_gflops = {name: flops * config.tokens / config.seconds / 1e9 for name, config in configs.items()}
        for name, config in configs.items():
            useful = useful_gflops[name]
            figures["train"][name]["useful_gflops"] = round(useful, 1)
            precision = "bf16" if config.bf16 else "fp32"  # against the peak of the precision it ran in
            figures["train"][name]["precision"] = precision
            figures["train"][name]["fraction_of_peak"] = round(useful / figures["matmul_gflops"][precision], 3)
        naive = figures["train"]["naive"]["examples_per_second"]
        figures["train_speedup"] = {name: round(figures["train"][name]["examples_per_second"] / naive, 2)
                                    for name in ("default", "default_bf16", "default_static")}
        static, default_speed = figures["train"]["default_static"], figures["train"]["default"]["examples_per_second"]
        figures["static_shapes"] = {"multiple": configs["default_static"].pad_multiple,
                                    "over_default": round(static["examples_per_second"] / default_speed, 3)}
        default, encoder = configs["default"], run.model.encoder.config
        rows = max(1, round(default.padded / default.steps))  # a typical step's padded tokens
        print(f"matmul peak at the model's shapes ({rows} rows x {encoder.hidden_size}, "
              f"{encoder.intermediate_size}) ...", flush=True)
        figures["matmul_shape_gflops"] = shape_peaks(rows, encoder.hidden_size, encoder.intermediate_size)
        for name in configs:
            precision = figures["train"][name]["precision"]
            figures["train"][name]["fraction_of_shape_peak"] = round(
                useful_gflops[name] / figures["matmul_shape_gflops"][precision]["layer"], 3)
        print(f"training: the Hugging Face Trainer peer vs mtbert's train step, {peer_steps} steps per task "
              "each ...", flush=True)
        figures["peer"] = peer_figures(run, progress, peer_steps, block, Path(scratch))
        print(f"SMART(K=1) vs plain, {smart_steps} steps each ...", flush=True)
        figures["smart_ratio"], figures["smart_random_ratio"] = smart_ratios(run, progress, smart_steps)
        print("prediction: length-sorted vs padded to max_length ...", flush=True)
        dev = {name: load_split(tokenized_dir, task, "dev", predict_examples) for name, task in run.tasks.items()}
        sentences = sum(len(s) for s in dev.values())
        batch_size = params.predict.batch_size
        naive_s = predict_seconds(run, dev, batch_size, params.tokenize.max_length)
        default_s = predict_seconds(run, dev, batch_size, None)
        figures["predict"] = {"naive_sentences_per_second": round(sentences / naive_s, 1),
                              "sentences_per_second": round(sentences / default_s, 1),
                              "speedup": round(naive_s / default_s, 2)}
        print("mtbert predict's engine: one-sentence latency, batched throughput vs the predict stage ...", flush=True)
        figures["engine"] = engine_figures(run, params, tokenized_dir, dev)
        del run
        figures["deploy"] = None
        deployed = deployed or next(iter(params.export.models), "")
        if deployed and (models_dir / deployed).is_dir() and (exports_dir / deployed / "manifest.json").is_file():
            print(f"the deployed model: {models_dir / deployed} and {exports_dir / deployed} ...", flush=True)
            figures["deploy"] = deploy_figures(models_dir / deployed, exports_dir / deployed, tokenized_dir,
                                               threads=figures["threads"], scratch=Path(scratch),
                                               export_metrics=Path("metrics/export") / f"{deployed}.json")
        figures["deploy_ensemble"] = None
        if (exports_dir / "ensemble" / "manifest.json").is_file():
            print(f"the deployed ensemble: {exports_dir / 'ensemble'} ...", flush=True)
            figures["deploy_ensemble"] = ensemble_figures(exports_dir / "ensemble", Path("metrics/ensemble.json"),
                                                          tokenized_dir, threads=figures["threads"],
                                                          scratch=Path(scratch))
        others = {name: exports_dir / name for name in params.export.models
                  if (exports_dir / name / "manifest.json").is_file()}
        figures["side_by_side"] = None
        if others and figures["deploy_ensemble"] is not None:
            print(f"deployed models side by side: {', '.join(others)} against the ensemble ...", flush=True)
            figures["side_by_side"] = side_by_side_figures({"ensemble": exports_dir / "ensemble", **others},
                                                           tokenized_dir, threads=figures["threads"],
                                                           scratch=Path(scratch))
    print("tokenize (a fresh process) ...", flush=True)
    figures["tokenize_seconds"] = round(tokenize_seconds(params_file), 2)
    print(f"peak memory of training ({memory_steps} steps, evaluation, checkpoint) ...", flush=True)
    figures["peak_rss_gib"] = round(training_peak_rss_gib(params_file, tokenized_dir, variant, memory_steps), 2)
    figures["targets"] = TARGETS
    report(figures)
    io.write_json(json_out, figures)  # atomic, parent folders made


def smart_ratios(run: FineTuning, progress: Progress, steps: int, block: int = 2) -> tuple[float, float]:
    """SMART(K = 1) and random-mode step time over plain, measured alternating in one run."""
    measured = ratios(alternating_step_times(run, progress, steps, block, smart_steps=1))
    return measured["smart"], measured["random"]


def report_peer(peer: dict) -> None:
    """The headline: mtbert's train step against the Hugging Face Trainer peer, per task and overall."""
    print(f"\ntraining vs the Hugging Face Trainer peer (run_glue: one Trainer per task, {peer['precision']}, "
          f"{peer['steps_per_task']} steps per task each, alternating):")
    rows = {**peer["tasks"], "overall": peer["overall"]}
    for name, row in rows.items():
        cells = []
        for side in ("peer", "mtbert"):
            figure = row[side]
            cells.append(f"{side} {figure['examples_per_second']:7.1f} examples/s {figure['tokens_per_second']:8.0f} "
                         f"tokens/s" if figure else f"{side} (no step timed)")
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
        label = "overall" if name == "overall" else f"{name} ({peer['task_share'][name]:.0%} of the batches)"
        print(f"  {label:28s} {cells[0]} | {cells[1]} | mtbert/peer {ratio}")
    padding = ", ".join(f"{task} {side['peer']:.1%} | {side['mtbert']:.1%}" for task, side in peer["padding"].items())
    print(f"  the same examples each way; padding over an epoch of each side's own batches (peer | mtbert): {padding}")
    ratio = peer["overall"]["ratio"]
    print(f"1. train speed mtbert / Hugging Face Trainer, an epoch's task mix: {ratio:.2f}x "
          f"{verdict(ratio, TARGETS['peer_speedup'], True)}")


def report(f: dict) -> None:
    report_peer(f["peer"])
    t = f["train"]
    print(f"\nmatmul peak: fp32 {f['matmul_gflops']['fp32']} GFLOP/s, bf16 {f['matmul_gflops']['bf16']} GFLOP/s")
    s = f["matmul_shape_gflops"]
    for precision in ("fp32", "bf16"):
        print(f"matmul peak at the model's shapes, {precision} ({s['rows']} rows): "
              f"{s['rows']}x{s['hidden']}.{s['hidden']}x{s['hidden']} {s[precision]['qkvo']}, "
              f"{s['hidden']}x{s['intermediate']} {s[precision]['ffn_up']}, "
              f"{s['intermediate']}x{s['hidden']} {s[precision]['ffn_down']}; "
              f"a layer's mix {s[precision]['layer']} GFLOP/s")
    for name in ("naive", "default", "default_bf16", "default_static"):
        print(f"train {name:14s} {t[name]['examples_per_second']:7.1f} examples/s "
              f"{t[name]['tokens_per_second']:8.0f} tokens/s  {t[name]['useful_gflops']:6.1f} useful GFLOP/s "
              f"= {t[name]['fraction_of_peak']:.1%} of the {t[name]['precision']} peak, "
              f"{t[name]['fraction_of_shape_peak']:.1%} of its peak at the model's shapes")
    for name in ("default", "default_bf16"):
        print(f"1b. train speed-up {name} / naive loop: {f['train_speedup'][name]:.2f}x "
              f"{verdict(f['train_speedup'][name], TARGETS['train_speedup'], True)}")
    static = f["static_shapes"]
    print(f"1c. widths padded to multiples of {static['multiple']} (the GPU's static shapes) on this CPU: "
          f"{static['over_default']:.3f}x the default's examples/s")
    # the defaults' figure: a forced bf16 on a CPU that emulates it beats its own (meaningless) peak
    fraction, shaped = t["default"]["fraction_of_peak"], t["default"]["fraction_of_shape_peak"]
    print(f"2. defaults' fraction of the {t['default']['precision']} matmul peak: {fraction:.1%} "
          f"{verdict(fraction, TARGETS['peak_fraction'], True)}; of the peak at the model's shapes: {shaped:.1%}")
    print(f"3. SMART(K=1) / plain step time: {f['smart_ratio']:.2f}x "
          f"{verdict(f['smart_ratio'], TARGETS['smart_ratio'], False)}; random mode / plain: "
          f"{f['smart_random_ratio']:.2f}x {verdict(f['smart_random_ratio'], TARGETS['smart_random_ratio'], False)}")
    print(f"4. predict: {f['predict']['sentences_per_second']} sentences/s vs naive "
          f"{f['predict']['naive_sentences_per_second']}: {f['predict']['speedup']:.2f}x")
    print(f"5. tokenize wall time: {f['tokenize_seconds']:.1f} s "
          f"{verdict(f['tokenize_seconds'], TARGETS['tokenize_seconds'], False)}")
    print(f"6. peak RSS of training: {f['peak_rss_gib']:.2f} GiB "
          f"{verdict(f['peak_rss_gib'], TARGETS['peak_rss_gib'], False)}")
    e = f["engine"]
    print(f"7. mtbert predict: one sentence p50 {e['single_sentence_ms']['p50']} ms, p95 "
          f"{e['single_sentence_ms']['p95']} ms; batched {e['engine_sentences_per_second']} sentences/s from raw text "
          f"vs the predict stage's {e['predict_stage_sentences_per_second']} from tokens: "
          f"{e['engine_over_predict_stage']:.2f}x")
    if f["deploy"] is not None:
        report_deploy(f["deploy"])
    else:
        print("8. deployment: skipped (needs a variant of export.models and its export: dvc repro export@<variant>)")
    if f.get("deploy_ensemble") is not None:
        report_ensemble(f["deploy_ensemble"])
    else:
        print("8b. the deployed ensemble: skipped (needs exports/ensemble: dvc repro export_ensemble)")
    if f.get("side_by_side") is not None:
        report_side_by_side(f["side_by_side"])
    else:
        print("8c. deployed models side by side: skipped (needs exports/ensemble and an export of export.models)")


if __name__ == "__main__":
    app()
