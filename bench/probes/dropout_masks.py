"""Dropout masks: PyTorch's against mtbert's cheaper ones (mtbert/model/dropout.py), in real training steps.

    python -m bench.probes.dropout_masks [--steps 24] [--json-out FILE]

PyTorch draws a CPU dropout mask with `bernoulli_`: two 32-bit draws of one mt19937 stream per element, on
one core. mtbert's masks take two elements' draws from one 32-bit word, from the same generator. This probe
times one mask of an FFN activation's size (32 x 40 tokens by 1536) both ways, then training steps of the
`train` stage's run (bench/common.py `scratch_run`), alternating block by block over the same batches
between (a) the stage as it runs (mtbert's masks) and (b) the same run as it ran with PyTorch's masks: the
dropout modules call `F.dropout`, and the encoders run transformers' eager attention, which calls it too.

The two arms draw different masks, so their results differ (three paired seeds decide that, not this probe).
Needs data/tokenized/base (`dvc repro tokenize@base`). Not part of `python -m bench`.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
import typer

from bench.common import alternate_blocks, cpu_name, scratch_run, timed_steps
from mtbert import io
from mtbert.model import dropout
from mtbert.model.architectures import attention_implementation
from mtbert.params_file import variant_params
from mtbert.runtime import setup_logging
from mtbert.training.build import schedule

app = typer.Typer(add_completion=False)
FFN_ACTIVATION = (32 * 40, 1536)  # a default batch's mean padded tokens by the FFN's width
BERT_DROPOUT = 0.1  # the backbone's hidden and attention-probability dropout


@contextlib.contextmanager
def pytorch_masks(model: torch.nn.Module) -> Iterator[None]:
    """The model as it ran before mtbert's masks: its dropout modules call `F.dropout`, and its encoders run
    transformers' own eager attention, which calls `F.dropout` too."""
    cheap = dropout.drop
    dropout.drop = lambda x, p, training: F.dropout(x, p, training)
    try:
        with attention_implementation(model, "eager"):
            yield
    finally:
        dropout.drop = cheap


def mask_milliseconds(draw: Callable[[], torch.Tensor], repeats: int) -> float:
    draw()
    started = time.perf_counter()
    for _ in range(repeats):
        draw()
    return (time.perf_counter() - started) / repeats * 1e3


def timed_in(setting: Callable[[], contextlib.AbstractContextManager], run, progress) -> Callable[[list], list[float]]:
    """An arm for `alternate_blocks`: the steps of its batches, timed inside the setting."""
    def time_steps(batches: list) -> list[float]:
        with setting():
            return timed_steps(run, progress, batches)
    return time_steps


@app.command()
def main(steps: int = typer.Option(24, help="timed training steps per arm"),
         block: int = typer.Option(2, help="steps per block; the arms alternate block by block"),
         mask_repeats: int = typer.Option(50, help="masks drawn per way for the masks-alone timing"),
         variant: str = typer.Option("base"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized/base")),
         json_out: Path = typer.Option(None, help="also write the figures here")) -> None:
    setup_logging("WARNING")
    params = variant_params(params_file, variant)
    activation = torch.empty(FFN_ACTIVATION, dtype=torch.bfloat16)
    mask_ms = {"pytorch": mask_milliseconds(lambda: F.dropout(activation, BERT_DROPOUT), mask_repeats),
               "mtbert": mask_milliseconds(lambda: dropout.drop(activation, BERT_DROPOUT, True), mask_repeats)}
    with tempfile.TemporaryDirectory() as scratch:
        run, progress = scratch_run(params, variant, tokenized_dir, Path(scratch))
        run.model.train()
        arms = {"stage (mtbert's masks)": timed_in(contextlib.nullcontext, run, progress),
                "pytorch's masks": timed_in(lambda: pytorch_masks(run.model), run, progress)}
        times = alternate_blocks(arms, schedule(run, 0)[: block + steps], block)
    report(mask_ms, times, run.bf16, json_out)


def report(mask_ms: dict[str, float], times: dict[str, list[float]], bf16: bool, json_out: Path | None) -> None:
    pytorch = sum(times["pytorch's masks"])
    figures = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "bf16": bf16,
               "dropout_milliseconds": {name: round(ms, 3) for name, ms in mask_ms.items()},
               "dropout_speedup": round(mask_ms["pytorch"] / mask_ms["mtbert"], 3),
               "timed_steps": len(times["pytorch's masks"]),
               "steps": {name: {"mean_step_seconds": round(statistics.fmean(t), 4),
                                "speedup_over_pytorch_masks": round(pytorch / sum(t), 3)}
                         for name, t in times.items()}}
    print(f"{figures['cpu']}, {figures['threads']} threads, bf16 {bf16}")
    print(f"dropout of one {FFN_ACTIVATION[0]}x{FFN_ACTIVATION[1]} bf16 activation: "
          f"PyTorch {mask_ms['pytorch']:.2f} ms, mtbert {mask_ms['mtbert']:.2f} ms ({figures['dropout_speedup']:.2f}x)")
    for name, entry in figures["steps"].items():
        print(f"  {name:24s} {entry['mean_step_seconds']:.3f} s/step  {entry['speedup_over_pytorch_masks']:.3f}x "
              f"PyTorch's masks' speed (same {figures['timed_steps']} batches)")
    if json_out is not None:
        io.write_json(json_out, figures)  # atomic, parent folders made


if __name__ == "__main__":
    app()
