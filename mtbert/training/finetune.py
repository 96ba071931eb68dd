"""Multitask fine-tuning of one variant, keeping each task's model from its best dev epoch: the loop.

Read it top to bottom, as the `train` and `distill` stages call it (`fine_tune`):

    run, progress = start(params, variant, paths)  # the process set up; model, data, optimiser; resumed
    summary = train(run, progress)                 # the loop

`train` runs, per epoch, the sampler's schedule of steps (`train_epoch`). One step, read top to bottom in
training/step.py: each task's next batch in pieces; each piece's forward and loss (training/losses.py's
`Objective`) and backward; then every train.grad_accum steps and at the epoch's last step the update
(clipping, AdamW, the weights' moving average) and the LR schedule's step. What the params change in it are
objects training/build.py chose once: the objective (with SMART's terms), how gradients combine (PCGrad,
several ranks), the moving average, and on a GPU the device work replayed from CUDA graphs. The rest, by job:
- training/build.py: `FineTuning` (what the loop works with), `prepare`, the schedule, the fingerprint;
- training/progress.py: `Progress` (counters, running sums, history) and the checkpoint a killed run
  resumes from (`checkpoint`, `resume`);
- training/epoch_end.py: the dev evaluation, snapshot dumps, the epoch's record, the model saved aside;
- training/publish.py: the summary, the model folder and the published dumps;
- training/capture.py: the step's device work as CUDA graphs on a GPU (runtime.capture.cuda).
"""

from __future__ import annotations

import logging

from tqdm.auto import tqdm

from mtbert.params import Params
from mtbert.runtime import limit_memory_growth, open_live
from mtbert.training.build import FineTuning, prepare, run_fingerprint, schedule
from mtbert.training.distillation import GOLD, GoldLabels
from mtbert.training.distributed import setup_process, shutdown
from mtbert.training.epoch_end import end_epoch, log_epoch
from mtbert.training.loop import Paths, finish
from mtbert.training.progress import Progress, checkpoint, resume
from mtbert.training.publish import parameter_count, publish, summary
from mtbert.training.step import step

log = logging.getLogger("train")

def start(params: Params, variant: str, paths: Paths, labels: GoldLabels = GOLD) -> tuple[FineTuning, Progress]:
    """This process set up (memory caps, torchrun's process group, the seed), then the variant's run
    prepared and resumed from its last checkpoint if this very run (the fingerprint) wrote one. The stages
    `train` and `distill` start here, and so do the benchmarks and tests that drive a run step by step.
    `labels`: the gold labels, or a student's `Distillation` (training/distillation.py)."""
    limit_memory_growth(params.runtime.onednn_cache, params.runtime.malloc_threshold_mb)
    ranks, device = setup_process(params.train.seed, params.runtime.threads)
    # a student's run resumes only with the same teacher
    fingerprint = labels.fingerprint(run_fingerprint(params, paths.tokenized, paths.pretrained, ranks.world_size))
    run = prepare(params, variant, paths, ranks, device, fingerprint, labels)
    return run, resume(run)


def fine_tune(params: Params, variant: str, paths: Paths, labels: GoldLabels = GOLD) -> tuple[FineTuning, dict]:
    """Train the variant (or, with a `Distillation` as `labels`, the student) from its last checkpoint or the
    start to the end; the run and its summary."""
    run, progress = start(params, variant, paths, labels)
    result = train(run, progress)
    shutdown(run.ranks)
    return run, result


def train(run: FineTuning, progress: Progress) -> dict:
    """From wherever `progress` is to the end: every epoch, then the model folder, dumps and metrics."""
    live = open_live(run.paths.live_dir, progress.history, log_epoch) if run.ranks.is_main else None
    log.info("%s: arch %s, %d steps per epoch, %d epochs, sampler %s, gradient %s, %s parameters, %d rank(s)",
             run.variant, run.params.model.arch, run.steps_per_epoch, run.train.epochs, run.train.sampler,
             run.train.gradient, f"{parameter_count(run.model):,}", run.ranks.world_size)
    while progress.epoch < run.train.epochs:
        train_epoch(run, progress)
        end_epoch(run, progress, live)
    if live is not None:
        live.end()
    result = summary(run, progress)
    finish(run, result, lambda: publish(run, result))
    return result


def train_epoch(run: FineTuning, progress: Progress) -> None:
    """The epoch's steps from wherever `progress` is: an update every grad_accum steps, a checkpoint every
    runtime.checkpoint_every.train updates (the epoch's end has its own, after the dev evaluation)."""
    epoch_steps = schedule(run, progress.epoch)
    run.model.train()
    # a context, so that an error closes the bar first and the error's one line does not run into it
    with tqdm(total=len(epoch_steps), initial=progress.step_in_epoch, desc=f"epoch {progress.epoch + 1}",
              unit="step", mininterval=2.0, disable=not run.ranks.is_main) as bar:
        run.stopwatch.start()
        while progress.step_in_epoch < len(epoch_steps):
            tasks, updates = epoch_steps[progress.step_in_epoch], progress.updates
            last = progress.step_in_epoch + 1 == len(epoch_steps)
            step(run, progress, tasks, ends_update=last or (progress.step_in_epoch + 1) % run.train.grad_accum == 0)
            progress.step_in_epoch += 1
            bar.update(1)
            if progress.step_in_epoch % run.params.runtime.check_every == 0:
                run.finite.check()  # the host's one wait for the device in these steps
            if progress.updates > updates and progress.updates % run.params.runtime.checkpoint_every.train == 0 \
                    and not last:
                run.finite.check()  # never a checkpoint of spoiled weights
                checkpoint(run, progress)
        run.finite.check()
        run.stopwatch.stop()
