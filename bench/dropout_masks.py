"""Would dropout masks drawn on two threads pay? PyTorch's masks against masks drawn in two halves at once.

    python -m bench.dropout_masks [--steps 24] [--json-out FILE]

PyTorch draws a dropout mask (`bernoulli_` with a scalar p) with MKL's parallel generator on Intel CPUs
only. On any other vendor it draws the mask element by element from one mt19937 stream, on one core, while
the other cores wait (`bernoulli_scalar_kernel` in aten/src/ATen/native/cpu/DistributionKernels.cpp). This
probe measures what drawing each mask in two halves at once would save: this thread draws one half and a
worker thread the other, each from its own generator seeded from torch's global one, so the masks still
follow the run's seed, its checkpoints and SMART's replay of the RNG.

- Masks alone: one mask of an FFN activation's size (32 x 40 tokens by 1536), PyTorch's against two halves.
- Training steps: the `train` stage's run (bench/smart_step.py `scratch_run`), alternating block by block
  over the same batches between (a) the stage as it runs (on a CPU, eager attention: the encoder's own,
  mtbert/model/architectures.py `attention_for`), (b) the same with two-half masks (eager attention draws its
  attention-probability masks through `F.dropout`, which (b) replaces, as it does nn.Dropout's), and (c) PyTorch's
  fused attention (`sdpa`), which on a CPU trains through its unfused math path (its CPU kernel has no
  dropout): what (a) gains over it.

Two-half masks differ from PyTorch's, so adopting them would change every result (three paired seeds).
Needs data/tokenized (`dvc repro tokenize`). Not part of `python -m bench`.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
import typer

from bench.smart_step import alternate_blocks, scratch_run, timed_steps
from bench.suite import cpu_name
from mtbert import io
from mtbert.model.architectures import attention_implementation
from mtbert.params import variant_params
from mtbert.runtime import setup_logging
from mtbert.training.finetune import schedule

app = typer.Typer(add_completion=False)
FFN_ACTIVATION = (32 * 40, 1536)  # a default batch's mean padded tokens by the FFN's width
BERT_DROPOUT = 0.1  # the backbone's hidden and attention-probability dropout


class TwoHalfMasks:
    """Dropout masks drawn in two halves at once, this thread's and a worker's, each half from its own
    generator seeded by one draw from torch's global generator."""

    def __init__(self) -> None:
        self.worker = ThreadPoolExecutor(1)
        self.generators = (torch.Generator(), torch.Generator())

    def mask(self, shape: torch.Size | tuple[int, ...], keep: float) -> torch.Tensor:
        mask = torch.empty(shape, dtype=torch.bool)
        seed = int(torch.randint(0, 2**62, ()))
        halves = mask.view(-1).chunk(2)
        later = None
        if len(halves) == 2:  # bernoulli_ releases the GIL: the worker draws its half while this thread draws
            later = self.worker.submit(halves[1].bernoulli_, keep, generator=self.generators[1].manual_seed(seed + 1))
        if halves:
            halves[0].bernoulli_(keep, generator=self.generators[0].manual_seed(seed))
        if later is not None:
            later.result()
        return mask

    def dropout(self, input: torch.Tensor, p: float = 0.5, training: bool = True,
                inplace: bool = False) -> torch.Tensor:
        """`F.dropout`'s signature and result distribution, with this object's masks (`inplace` is ignored)."""
        if not training or p == 0.0:
            return input
        if p == 1.0:
            return input * 0.0
        return MaskedDropout.apply(input, self.mask(input.shape, 1.0 - p), 1.0 / (1.0 - p))


class MaskedDropout(torch.autograd.Function):
    """x * mask * scale, saving only the boolean mask for the backward pass (as PyTorch's own dropout does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return torch.ops.aten.native_dropout_backward(x, mask, scale)  # that kernel computes x * mask * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return torch.ops.aten.native_dropout_backward(grad, mask, ctx.scale), None, None


@contextlib.contextmanager
def dropout_function(function: Callable) -> Iterator[None]:
    """`torch.nn.functional.dropout` replaced by `function` (nn.Dropout and eager attention call it)."""
    original = F.dropout
    F.dropout = function
    try:
        yield
    finally:
        F.dropout = original


def mkl_draws_masks() -> bool:
    """Whether PyTorch draws dropout masks with MKL's parallel generator here (Intel CPUs only)."""
    try:
        intel = "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return intel and torch.backends.mkl.is_available()


def mask_milliseconds(draw: Callable[[], torch.Tensor], repeats: int) -> float:
    draw()
    started = time.perf_counter()
    for _ in range(repeats):
        draw()
    return (time.perf_counter() - started) / repeats * 1e3


def arms(run, progress, masks: TwoHalfMasks) -> dict[str, Callable[[list], list[float]]]:
    """Each arm: the steps of a block of batches, timed inside its setting of the model."""
    settings = {"stage": contextlib.nullcontext,
                "stage, two-half masks": lambda: dropout_function(masks.dropout),
                "fused attention (sdpa)": lambda: attention_implementation(run.model, "sdpa")}
    return {name: timed_in(setting, run, progress) for name, setting in settings.items()}


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
         tokenized_dir: Path = typer.Option(Path("data/tokenized")),
         json_out: Path = typer.Option(None, help="also write the figures here")) -> None:
    setup_logging("WARNING")
    params = variant_params(params_file, variant)
    masks = TwoHalfMasks()
    keep = 1.0 - BERT_DROPOUT
    mask_ms = {"pytorch": mask_milliseconds(lambda: torch.empty(FFN_ACTIVATION).bernoulli_(keep), mask_repeats),
               "two halves": mask_milliseconds(lambda: masks.mask(FFN_ACTIVATION, keep), mask_repeats)}
    with tempfile.TemporaryDirectory() as scratch:
        run, progress = scratch_run(params, variant, tokenized_dir, Path(scratch))
        run.model.train()
        times = alternate_blocks(arms(run, progress, masks), schedule(run, 0)[: block + steps], block)
    report(mask_ms, times, run.bf16, json_out)


def report(mask_ms: dict[str, float], times: dict[str, list[float]], bf16: bool, json_out: Path | None) -> None:
    stage = sum(times["stage"])
    figures = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "bf16": bf16,
               "mkl_draws_masks": mkl_draws_masks(),
               "mask_milliseconds": {name: round(ms, 3) for name, ms in mask_ms.items()},
               "mask_speedup": round(mask_ms["pytorch"] / mask_ms["two halves"], 3),
               "timed_steps": len(times["stage"]),
               "steps": {name: {"mean_step_seconds": round(statistics.fmean(t), 4),
                                "speedup_over_stage": round(stage / sum(t), 3)} for name, t in times.items()}}
    print(f"{figures['cpu']}, {figures['threads']} threads, bf16 {bf16}; PyTorch draws masks with MKL's "
          f"parallel generator: {figures['mkl_draws_masks']}")
    print(f"one {FFN_ACTIVATION[0]}x{FFN_ACTIVATION[1]} mask: PyTorch {mask_ms['pytorch']:.2f} ms, two halves "
          f"{mask_ms['two halves']:.2f} ms ({figures['mask_speedup']:.2f}x)")
    for name, entry in figures["steps"].items():
        print(f"  {name:32s} {entry['mean_step_seconds']:.3f} s/step  {entry['speedup_over_stage']:.3f}x the stage's "
              f"speed (same {figures['timed_steps']} batches)")
    if json_out is not None:
        io.write_json(json_out, figures)  # atomic, parent folders made


if __name__ == "__main__":
    app()
