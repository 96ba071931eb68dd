"""The speed benchmarks: every figure a ratio against a baseline measured in the same run.

    python -m bench [--train-steps 24] [--json-out metrics/bench.json]

1. training throughput of the default variant (examples/s, non-padding tokens/s) against the naive
   baseline of the common GLUE example scripts: every batch padded to tokenize.max_length, fp32, no
   length bucketing; and with bf16 autocast on top of the defaults;
2. useful training FLOP/s (6 x the non-embedding parameters an example goes through x non-padding tokens)
   as a fraction of this machine's matmul peak in the precision the configuration ran in, measured here;
3. SMART (K = 1) and SMART's random mode step time over plain step time (bench/smart_step.py's
   measurement, the three alternating);
4. prediction throughput (sentences/s) of `predict`'s code against the same naive padding;
5. `tokenize` wall time for all nine files, interpreter start included;
6. peak resident memory of a process training the default variant (steps, an evaluation, a checkpoint);
7. `mtbert predict`'s engine: one-sentence latency (p50, p95) and batched sentences/s from raw text, against
   the `predict` stage's path over the tokenized splits (bench/inference.py).

The configurations being compared alternate in short blocks over the same kind of real batches, so a
change in the machine's speed during the run hits all of them alike. Needs data/tokenized
(`dvc repro tokenize`) and data/raw.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import typer

from bench.inference import engine_figures
from bench.smart_step import alternating_step_times, ratios, scratch_run
from mtbert.data.batches import TaskSplit, eval_batches, load_split
from mtbert.data.sampling import TaskStream
from mtbert.params import variant_params
from mtbert.runtime import setup_logging
from mtbert.training.finetune import FineTuning, Progress, schedule, update
from mtbert.training.objective import Objective

TARGETS = {"train_speedup": 3.0, "peak_fraction": 0.40, "smart_ratio": 2.5, "smart_random_ratio": 2.0,
           "tokenize_seconds": 15.0,
           "peak_rss_gib": 3.0}
app = typer.Typer(add_completion=False)


# --- the machine ------------------------------------------------------------------------------------
def matmul_gflops(dtype: torch.dtype, size: int = 1024, seconds: float = 2.0) -> float:
    """Best sustained GFLOP/s of square matmuls in `dtype` over about `seconds`."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm-up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = max(best, 4 * 2 * size ** 3 / (time.perf_counter() - started) / 1e9)
    return best


# --- training ---------------------------------------------------------------------------------------
def pad_to(batch: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """Every token tensor of a batch padded with zeros ([PAD], mask 0, type 0) to `length` columns."""
    return {k: v if k == "labels" else torch.nn.functional.pad(v, (0, length - v.shape[1]))
            for k, v in batch.items()}


class TrainConfig:
    """One way of feeding the training run: its batch streams, padding rule and precision."""

    def __init__(self, name: str, run: FineTuning, progress: Progress, *, bucket_batches: int,
                 pad_length: int | None, bf16: bool):
        self.name, self.run, self.progress, self.pad_length, self.bf16 = name, run, progress, pad_length, bf16
        self.objective = Objective(run.model, run.params.smart, run.device, bf16, run.p.seed)
        self.streams = {t: TaskStream(split.lengths(run.model.encoding(t)), run.p.batch_size[t],
                                      bucket_batches, run.p.seed, i)
                        for i, (t, split) in enumerate(run.train_data.items())}
        self.seconds, self.examples, self.tokens = 0.0, 0, 0

    def step(self, task: str) -> None:
        rows = self.streams[task].next()
        batch = self.run.train_data[task].batch(rows, self.run.model.encoding(task))
        if self.pad_length is not None:
            batch = pad_to(batch, self.pad_length)
        started = time.perf_counter()
        result = self.objective(self.run.model, task, batch)
        result.total.backward()
        update(self.run, self.progress)
        self.seconds += time.perf_counter() - started
        self.examples += len(rows)
        self.tokens += int(sum(v.sum() for k, v in batch.items() if k.startswith("attention_mask")))

    def figures(self) -> dict:
        return {"examples_per_second": round(self.examples / self.seconds, 2),
                "tokens_per_second": round(self.tokens / self.seconds, 1), "seconds": round(self.seconds, 2),
                "examples": self.examples}


def train_throughput(run: FineTuning, progress: Progress, steps: int, block: int) -> dict[str, TrainConfig]:
    max_length = run.params.tokenize.max_length
    configs = {
        "naive": TrainConfig("naive", run, progress, bucket_batches=1, pad_length=max_length, bf16=False),
        "default": TrainConfig("default", run, progress, bucket_batches=run.p.bucket_batches, pad_length=None,
                               bf16=run.bf16),
        "default_bf16": TrainConfig("default_bf16", run, progress, bucket_batches=run.p.bucket_batches,
                                    pad_length=None, bf16=True),
    }
    first_tasks = [tasks[0] for tasks in schedule(run, 0)]
    for config in configs.values():  # warm-up, then reset the counters
        config.step(first_tasks[0])
        config.seconds, config.examples, config.tokens = 0.0, 0, 0
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
        unique = {id(p): p for module in modules for n, p in module.named_parameters() if "embeddings" not in n}
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
         smart_steps: int = typer.Option(12, help="timed steps each for SMART and plain"),
         predict_examples: int = typer.Option(1000, help="dev examples per task for the prediction benchmark"),
         memory_steps: int = typer.Option(20, help="training steps of the peak-memory child"),
         variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized")),
         json_out: Path = typer.Option(Path("metrics/bench.json"))) -> None:
    setup_logging()
    params = variant_params(params_file, variant)
    torch.set_num_threads(params.runtime.threads or torch.get_num_threads())
    figures: dict = {"threads": torch.get_num_threads()}
    print(f"matmul peak ({figures['threads']} threads) ...", flush=True)
    figures["matmul_gflops"] = {"fp32": round(matmul_gflops(torch.float32), 1),
                                "bf16": round(matmul_gflops(torch.bfloat16), 1)}
    with tempfile.TemporaryDirectory() as scratch:
        run, progress = scratch_run(params, variant, tokenized_dir, Path(scratch))
        run.model.train()
        print(f"training: naive / default / default+bf16, {train_steps} steps each ...", flush=True)
        configs = train_throughput(run, progress, train_steps, block)
        figures["train"] = {name: config.figures() for name, config in configs.items()}
        flops = 6 * non_embedding_parameters(run)
        for name, config in configs.items():
            useful = flops * config.tokens / config.seconds / 1e9
            figures["train"][name]["useful_gflops"] = round(useful, 1)
            precision = "bf16" if config.bf16 else "fp32"  # against the peak of the precision it ran in
            figures["train"][name]["precision"] = precision
            figures["train"][name]["fraction_of_peak"] = round(useful / figures["matmul_gflops"][precision], 3)
        naive = figures["train"]["naive"]["examples_per_second"]
        figures["train_speedup"] = {name: round(figures["train"][name]["examples_per_second"] / naive, 2)
                                    for name in ("default", "default_bf16")}
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
    print("tokenize (a fresh process) ...", flush=True)
    figures["tokenize_seconds"] = round(tokenize_seconds(params_file), 2)
    print(f"peak memory of training ({memory_steps} steps, evaluation, checkpoint) ...", flush=True)
    figures["peak_rss_gib"] = round(training_peak_rss_gib(params_file, tokenized_dir, variant, memory_steps), 2)
    figures["targets"] = TARGETS
    report(figures)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(figures, indent=2) + "\n")


def smart_ratios(run: FineTuning, progress: Progress, steps: int, block: int = 2) -> tuple[float, float]:
    """SMART(K = 1) and random-mode step time over plain, measured alternating in one run."""
    measured = ratios(alternating_step_times(run, progress, steps, block, smart_steps=1))
    return measured["smart"], measured["random"]


def verdict(value: float, target: float, higher_is_better: bool) -> str:
    met = value >= target if higher_is_better else value <= target
    return f"(target {'>=' if higher_is_better else '<='} {target}: {'met' if met else 'NOT met'})"


def report(f: dict) -> None:
    t = f["train"]
    print(f"\nmatmul peak: fp32 {f['matmul_gflops']['fp32']} GFLOP/s, bf16 {f['matmul_gflops']['bf16']} GFLOP/s")
    for name in ("naive", "default", "default_bf16"):
        print(f"train {name:13s} {t[name]['examples_per_second']:7.1f} examples/s "
              f"{t[name]['tokens_per_second']:8.0f} tokens/s  {t[name]['useful_gflops']:6.1f} useful GFLOP/s "
              f"= {t[name]['fraction_of_peak']:.1%} of the {t[name]['precision']} peak")
    for name in ("default", "default_bf16"):
        print(f"1. train speed-up {name} / naive: {f['train_speedup'][name]:.2f}x "
              f"{verdict(f['train_speedup'][name], TARGETS['train_speedup'], True)}")
    # the defaults' figure: a forced bf16 on a CPU that emulates it beats its own (meaningless) peak
    fraction = t["default"]["fraction_of_peak"]
    print(f"2. defaults' fraction of the {t['default']['precision']} matmul peak: {fraction:.1%} "
          f"{verdict(fraction, TARGETS['peak_fraction'], True)}")
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


if __name__ == "__main__":
    app()
