"""Training on one GPU, measured in one call: the eager step, the captured step and the Trainer peer.

    python -m bench.gpu [--steps-per-task 60] [--json-out metrics/bench-gpu.json]

1. the bf16 matmul peak of this GPU (8192^3, after a warm-up);
2. the default variant's training examples/s and non-padding tokens/s with today's eager step, with the
   captured step (runtime.capture.cuda, mtbert/training/capture.py) and with the Hugging Face Trainer
   peer (bench/peer.py), on the same examples: the eager and captured runs are two copies of the same
   run (same seed, so the same batches), and the peer steps the rows of the eager run's batches. Each
   side's share of the bf16 peak is its useful FLOP/s (6 x non-embedding parameters x tokens/s) over it;
3. the same eager and captured, on an encoder of BERT-base's shape (12 layers of 768, random weights);
4. a short run (one epoch of train.max_train_examples rows per task) trained both ways: the dev metrics.

The steps go in blocks of one task's steps; each side's blocks take turns, and each block is timed from a
synchronised device to a synchronised device, so a block counts its kernels to their end. The first pass
over the plan is a warm-up (kernels chosen, graphs captured), timed apart; the rate is the second pass's.
Per-task rates combine in the epoch's task mix (bench/peer.py `mixed_rate`).

On a CPU (a dry run, `--dry-run`), the CUDA parts are skipped: no peak, no captured step, and the figures
are of the CPU. Needs data/tokenized/base (`dvc repro tokenize@base`) and the backbone.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import typer

from bench.common import scratch_run
from bench.peer import Tally, TrainerPeer, mixed_rate, mtbert_step, task_share
from bench.suite import non_embedding_parameters
from mtbert import io
from mtbert.model.backbone import load_tokenizer, resolve_backbone
from mtbert.params import Params
from mtbert.params_file import variant_params, with_changes
from mtbert.runtime import setup_logging
from mtbert.training.build import FineTuning
from mtbert.training.capture import CapturedSteps
from mtbert.training.finetune import fine_tune
from mtbert.training.loop import Paths
from mtbert.training.progress import Progress

app = typer.Typer(add_completion=False)
BERT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bf16_peak_tflops(size: int = 8192, repeats: int = 10) -> float | None:
    """The GPU's bf16 matmul rate on square products of `size` (None on a CPU)."""
    if not torch.cuda.is_available():
        return None
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - started) / 1e12


def with_capture(params: Params, on: bool) -> Params:
    return params.model_copy(update={"runtime": with_changes(params.runtime, capture=with_changes(
        params.runtime.capture, cuda=on))})


@dataclasses.dataclass
class Side:
    """One way of training, stepped one task's step at a time; its tallies per task."""
    name: str
    step: Callable[[str, object], tuple[int, int]]  # (task, rows or None) -> (examples, tokens)
    tallies: dict[str, Tally]


def mtbert_side(name: str, run: FineTuning, progress: Progress) -> Side:
    return Side(name, lambda task, rows: mtbert_step(run, progress, (task,)), {task: Tally() for task in run.tasks})


def peer_side(run: FineTuning, scratch: Path) -> Side:
    peers = {task: TrainerPeer(run, task, scratch / f"peer-{task}") for task in run.tasks}
    return Side("peer", lambda task, rows: peers[task].step(rows), {task: Tally() for task in run.tasks})


def timed_block(side: Side, task: str, rows: list, tally: Tally | None) -> None:
    """`len(rows)` steps of one task, synchronised at both ends; added to `tally` (None: untimed)."""
    synchronize()
    started, examples, tokens = time.perf_counter(), 0, 0
    for step_rows in rows:
        e, t = side.step(task, step_rows)
        examples, tokens = examples + e, tokens + t
    synchronize()
    if tally is not None:
        tally.seconds += time.perf_counter() - started
        tally.examples += examples
        tally.tokens += tokens
        tally.batches += len(rows)


def upcoming(run: FineTuning, task: str, steps: int) -> list:
    """The rows of the task's next `steps` batches, leaving its stream where it was."""
    stream = run.streams[task]
    state = stream.state()
    rows = [stream.next() for _ in range(steps)]
    stream.load_state(state)
    return rows


def race(reference: FineTuning, sides: list[Side], steps_per_task: int, block: int) -> dict:
    """Two passes of `steps_per_task` steps of each task, in blocks of `block`, each side's block in turn;
    the first pass untimed in the rate (its seconds reported as warm-up). The mtbert sides draw the same
    batches (same seed); the peer trains on the rows of the reference's."""
    warmup = {side.name: 0.0 for side in sides}
    for timed in (False, True):
        for _ in range(0, steps_per_task, block):
            for task in reference.tasks:
                rows = upcoming(reference, task, block)
                for side in sides:
                    tally = side.tallies[task] if timed else Tally()
                    timed_block(side, task, rows, tally)
                    warmup[side.name] += 0.0 if timed else tally.seconds
    share = task_share(reference)
    return {side.name: {**mixed_rate(side.tallies, share),
                        "tasks": {task: tally.figures() for task, tally in side.tallies.items()},
                        "warmup_seconds": round(warmup[side.name], 2)} for side in sides}


def with_peak_fraction(figures: dict, parameters: float, peak_tflops: float | None) -> dict:
    """Each side's useful TFLOP/s (6 x parameters x tokens/s) and its share of the bf16 peak."""
    for side in figures.values():
        side["useful_tflops"] = round(6 * parameters * side["tokens_per_second"] / 1e12, 3)
        side["peak_fraction"] = round(side["useful_tflops"] / peak_tflops, 5) if peak_tflops else None
    return figures


def speed(params: Params, variant: str, tokenized: Path, scratch: Path, steps_per_task: int, block: int,
          peer: bool, peak: float | None) -> dict:
    """Eager, captured (on a GPU) and the peer (if asked) on the same examples."""
    eager, eager_progress = scratch_run(with_capture(params, False), variant, tokenized, scratch / "eager")
    eager.model.train()  # as train_epoch sets it: dropout on, as the peer's training_step has it
    sides = [mtbert_side("eager", eager, eager_progress)]
    if torch.cuda.is_available():
        captured, captured_progress = scratch_run(with_capture(params, True), variant, tokenized, scratch / "captured")
        captured.model.train()
        if isinstance(captured.compute, CapturedSteps):
            sides.append(mtbert_side("captured", captured, captured_progress))
    if peer:
        sides.append(peer_side(eager, scratch))
    figures = with_peak_fraction(race(eager, sides, steps_per_task, block), non_embedding_parameters(eager), peak)
    for faster, slower in (("captured", "eager"), ("eager", "peer"), ("captured", "peer")):
        if faster in figures and slower in figures:
            figures[f"{faster}_over_{slower}"] = round(figures[faster]["examples_per_second"]
                                                       / figures[slower]["examples_per_second"], 3)
    return figures


def bert_base_backbone(params: Params, out: Path, layers: int = BERT_BASE["num_hidden_layers"]) -> Path:
    """A randomly initialised encoder of BERT-base's shape (`layers` of them), with the backbone's tokenizer,
    saved to `out` (speed does not depend on the weights)."""
    from transformers import AutoConfig, AutoModel

    source = resolve_backbone(params.model.name)
    config = AutoConfig.from_pretrained(source, **{**BERT_BASE, "num_hidden_layers": layers})
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(out)
    load_tokenizer(source).save_pretrained(out)
    return out


def short_run_metrics(params: Params, variant: str, tokenized: Path, scratch: Path, rows: int) -> dict:
    """One epoch of `rows` training rows per task, eager and captured: dev metrics and training seconds."""
    results = {}
    for name, on in (("eager", False), ("captured", True)):
        if on and not torch.cuda.is_available():
            continue
        short = with_capture(params, on)
        short = short.model_copy(update={"train": with_changes(short.train, epochs=1, max_train_examples={
            task: rows for task in short.tasks})})
        folder = scratch / f"short-{name}"
        paths = Paths(tokenized=tokenized, model_out=folder / "model", metrics_out=folder / "metrics.json",
                      live_dir=folder / "live", checkpoints=folder / "checkpoints")
        _, summary = fine_tune(short, variant, paths)
        results[name] = {"dev": summary["dev"], "train_seconds": summary["speed"]["train_seconds"]}
    return results


@app.command()
def main(steps_per_task: int = typer.Option(60, help="timed steps per task and side (the warm-up pass as many)"),
         block: int = typer.Option(20, help="steps per block; the sides take turns block by block"),
         base_steps_per_task: int = typer.Option(24, help="the same for the BERT-base-shaped encoder"),
         base_layers: int = typer.Option(BERT_BASE["num_hidden_layers"], min=1,
                                         help="its layers: BERT-base's 12, or fewer for a quick dry run"),
         short_rows: int = typer.Option(2000, help="training rows per task of the short run"),
         variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized/base")),
         json_out: Path = typer.Option(Path("metrics/bench-gpu.json"))) -> None:
    setup_logging()
    params = variant_params(params_file, variant)
    figures: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)",
                     "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        figures["bf16_peak_tflops"] = peak = bf16_peak_tflops()
        print(f"bf16 peak: {peak if peak is None else round(peak, 1)} TFLOP/s", flush=True)
        figures["default"] = speed(params, variant, tokenized_dir, scratch / "default", steps_per_task, block,
                                   peer=True, peak=peak)
        report("default", figures["default"])
        base = params.model_copy(update={"model": with_changes(params.model, name=str(
            bert_base_backbone(params, scratch / "bert-base-shaped", base_layers)))})
        figures["bert_base_shaped"] = {"layers": base_layers, **speed(
            base, variant, tokenized_dir, scratch / "base", base_steps_per_task, min(block, base_steps_per_task),
            peer=False, peak=peak)}
        report("bert-base-shaped", figures["bert_base_shaped"])
        figures["short_run"] = short_run_metrics(params, variant, tokenized_dir, scratch / "short", short_rows)
        print("short run dev:", json.dumps({name: round(run["dev"]["overall"], 4)
                                            for name, run in figures["short_run"].items()}), flush=True)
        shutil.rmtree(scratch, ignore_errors=True)
    io.write_json(json_out, figures)


def report(name: str, figures: dict) -> None:
    for side in ("eager", "captured", "peer"):
        if side in figures:
            f = figures[side]
            print(f"{name} {side}: {f['examples_per_second']:.0f} examples/s, {f['tokens_per_second']:.0f} "
                  f"tokens/s, {f['useful_tflops']} useful TFLOP/s, peak fraction {f['peak_fraction']} "
                  f"(warm-up {f['warmup_seconds']} s)", flush=True)
    print(f"{name} ratios: " + ", ".join(f"{key} {value}" for key, value in figures.items() if "_over_" in key),
          flush=True)


if __name__ == "__main__":
    app()
