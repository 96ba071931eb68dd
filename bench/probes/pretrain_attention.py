"""Masked-LM pretraining steps with the encoder's own attention (`eager`) against PyTorch's fused attention
(`sdpa`), alternating block by block over one run of the `pretrain` stage's own `train_step`.

    python -m bench.probes.pretrain_attention [--steps 48] [--block 4] [--json-out FILE]

Fine-tuning on a CPU switches to eager attention, because sdpa's CPU kernel has no dropout and trains
through an unfused math path (mtbert/model/architectures.py `attention_for`). This probe asks the same
of pretraining, which keeps sdpa. Both arms train the same model in turn, so each block starts from the
other's weights; neither result is kept. Not in `python -m bench`: a probe.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import typer

from bench.common import alternate_blocks
from mtbert import io
from mtbert.model.families import family_of
from mtbert.params_file import load_params
from mtbert.runtime import UserError, run_app, setup_logging
from mtbert.training import masked_lm
from mtbert.training.distributed import setup_process
from mtbert.training.loop import Paths

app = typer.Typer(add_completion=False)
ARMS = ("eager", "sdpa")


def timed_steps(run: masked_lm.MaskedLM, progress: masked_lm.Progress, implementation: str) -> Callable:
    """An arm: the seconds of `train_step`, one per batch it is given, with this attention."""
    def time_steps(batches: list) -> list[float]:
        run.model.set_attn_implementation(implementation)
        seconds = []
        for _ in batches:  # train_step draws its own batch from the run's stream
            started = time.perf_counter()
            masked_lm.train_step(run, progress)
            seconds.append(time.perf_counter() - started)
        return seconds
    return time_steps


@app.command()
def main(steps: int = typer.Option(48, help="timed steps per attention implementation"),
         block: int = typer.Option(4, help="steps per block; the two alternate block by block"),
         params_file: Path = typer.Option(Path("params.yaml")),
         tokenized_dir: Path = typer.Option(Path("data/tokenized/base")),
         json_out: Path = typer.Option(None, help="also write the figures here")) -> None:
    setup_logging()
    params = load_params(params_file)  # pretrain.enabled need not be on: the probe runs the steps itself
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        paths = Paths(tokenized=tokenized_dir, model_out=folder / "pretrained", metrics_out=folder / "pretrain.json",
                      live_dir=folder / "live", checkpoints=folder / "checkpoints")
        ranks, device = setup_process(params.pretrain.seed, params.runtime.threads)
        run = masked_lm.prepare(params, paths, ranks, device, fingerprint="probe")
        if not family_of(run.model.config).switchable_attention:
            raise UserError(f"model.name {params.model.name!r} ({run.model.config.model_type}) has one attention "
                            "implementation: nothing to compare (mtbert/model/families.py)")
        progress = masked_lm.Progress.start()
        arms = {name: timed_steps(run, progress, name) for name in ARMS}
        times = alternate_blocks(arms, list(range(block + steps)), block)
    report(times, json_out)


def report(times: dict[str, list[float]], json_out: Path | None) -> None:
    figures = {name: round(statistics.fmean(seconds), 4) for name, seconds in times.items()}
    speedup = round(figures["sdpa"] / figures["eager"], 3)
    print(f"masked-LM step: eager {figures['eager']:.3f} s, sdpa {figures['sdpa']:.3f} s (means over the same "
          f"{len(times['eager'])} steps' turns); eager over sdpa {speedup:.3f}x")
    if json_out is not None:
        io.write_json(json_out, {"mean_step_seconds": figures, "eager_speedup_over_sdpa": speedup,
                                 "timed_steps": len(times["eager"])})  # atomic, parent folders made


if __name__ == "__main__":
    run_app(app)
