"""Multitask fine-tuning of one variant, keeping each task's model from its best dev epoch: the loop.

Read it top to bottom, as the `train` and `distill` stages call it (`fine_tune`):

    run, progress = start(params, variant, paths)  # the process set up; model, data, optimiser; resumed
    summary = train(run, progress)                 # the loop

`train` runs, per epoch, the sampler's schedule of steps. `accumulate_gradients` is one step: its batches,
forward, loss and backward, the gradients adding up in `.grad`. `update` is one optimiser update (the ranks'
average, clipping, AdamW, the LR schedule, the moving average), every train.grad_accum steps. The rest, by job:
- training/build.py: `FineTuning` (what the loop works with), `prepare`, the schedule, the fingerprint;
- training/progress.py: `Progress` (counters, running sums, history) and the checkpoint a killed run
  resumes from (`checkpoint`, `resume`);
- training/epoch_end.py: the dev evaluation, snapshot dumps, the epoch's record, the model saved aside;
- training/publish.py: the summary, the model folder and the published dumps;
- training/objective.py (task loss, SMART, the Bregman teacher), training/pcgrad.py (`train.gradient:
  pcgrad`), training/averaging.py (the weights' moving average, `train.ema`).
"""

from __future__ import annotations

import logging

from tqdm.auto import tqdm

from mtbert.data.batches import micro_batches, on_device, padding_free_tokens
from mtbert.params import Params
from mtbert.rng import PCGRAD_ORDER, generator
from mtbert.runtime import limit_memory_growth, open_live
from mtbert.training.build import FineTuning, prepare, run_fingerprint, schedule
from mtbert.training.distillation import Distillation
from mtbert.training.distributed import average_gradients, setup_process, shard, shutdown
from mtbert.training.epoch_end import end_epoch, log_epoch
from mtbert.training.loop import Paths, clip_and_step, finish, trainable
from mtbert.training.progress import Progress, checkpoint, resume
from mtbert.training.publish import parameter_count, publish, summary

log = logging.getLogger("train")

def start(params: Params, variant: str, paths: Paths,
          distillation: Distillation | None = None) -> tuple[FineTuning, Progress]:
    """This process set up (memory caps, torchrun's process group, the seed), then the variant's run
    prepared and resumed from its last checkpoint if this very run (the fingerprint) wrote one. The stages
    `train` and `distill` start here, and so do the benchmarks and tests that drive a run step by step."""
    limit_memory_growth(params.runtime.onednn_cache, params.runtime.malloc_threshold_mb)
    ranks, device = setup_process(params.train.seed, params.runtime.threads)
    fingerprint = run_fingerprint(params, paths.tokenized, paths.pretrained, ranks.world_size)
    if distillation is not None:  # a student's run resumes only with the same teacher
        fingerprint = distillation.fingerprint(fingerprint)
    run = prepare(params, variant, paths, ranks, device, fingerprint, distillation)
    return run, resume(run)


def fine_tune(params: Params, variant: str, paths: Paths,
              distillation: Distillation | None = None) -> tuple[FineTuning, dict]:
    """Train the variant (or, with `distillation`, the student) from its last checkpoint or the start to
    the end; the run and its summary."""
    run, progress = start(params, variant, paths, distillation)
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
            if run.captured is not None:  # the step and its update, one CUDA graph replayed
                run.captured.step(run, progress, tasks)
            else:
                accumulate_gradients(run, progress, tasks)
            progress.step_in_epoch += 1
            bar.update(1)
            if progress.step_in_epoch % run.params.runtime.check_every == 0:
                run.finite.check()  # the host's one wait for the device in these steps
            if run.captured is None and (progress.step_in_epoch % run.train.grad_accum == 0
                                         or progress.step_in_epoch == len(epoch_steps)):
                update(run, progress)
            if (progress.updates > updates and progress.updates % run.params.runtime.checkpoint_every.train == 0
                    and progress.step_in_epoch < len(epoch_steps)):
                run.finite.check()  # never a checkpoint of spoiled weights
                checkpoint(run, progress)
        run.finite.check()
        run.stopwatch.stop()
    if run.captured is not None:
        log.info("epoch %d: %s", progress.epoch + 1, run.captured.summary())


def accumulate_gradients(run: FineTuning, progress: Progress, tasks: tuple[str, ...]) -> None:
    """One step's gradients: for each task, its next batch (this rank's share) in pieces, forward, loss,
    backward. Each piece's loss is scaled by its share of the global batch and by 1 / grad_accum, so the
    gradients summed over pieces, ranks and accumulated steps are the global batch's mean. With PCGrad each
    task's gradient is kept apart, and the step's end removes their conflicts."""
    for task in tasks:
        global_rows = run.streams[task].next()  # the same on every rank
        rows, encoding = shard(global_rows, run.ranks), run.model.encoding(task)
        for piece in micro_batches(rows, run.row_lengths[task], run.train.max_batch_tokens, run.pad_multiple):
            batch = run.train_data[task].batch(piece, encoding, run.pad_multiple)
            tokens = padding_free_tokens(batch)  # counted on the host, before the copy
            batch = on_device(batch, run.device)
            loss = run.objective(run.model, task, batch)  # the task's loss plus each regulariser's, weighted
            run.finite.add(loss.total, f"{task} loss",
                           f"at epoch {progress.epoch + 1} step {progress.step_in_epoch + 1}")
            progress.totals.add(task, len(piece), tokens, loss, weight=len(piece) / len(rows))
            share = len(piece) * run.ranks.world_size / len(global_rows)  # of the global batch
            if run.pcgrad is None:
                (loss.total * share / run.train.grad_accum).backward()  # frees the piece's activations
            else:
                run.pcgrad.backward(loss.total * share / run.train.grad_accum)
        if len(rows):
            progress.totals.batches[task] += 1
        if run.pcgrad is not None:
            run.pcgrad.end_task()
    if run.pcgrad is not None:
        run.pcgrad.end_step(generator(run.train.seed, PCGRAD_ORDER, progress.epoch, progress.step_in_epoch))


def update(run: FineTuning, progress: Progress) -> None:
    """One optimiser update: the gradients averaged over the ranks, clipped, AdamW and the LR schedule's
    step; then what follows the weights: SMART's Bregman teacher and the weights' moving average."""
    if run.pcgrad is None:  # PCGrad averaged each task's gradient over the ranks already
        average_gradients(trainable(run.model), run.ranks)
    clip_and_step(run.model, run.optimizer, run.scheduler, run.train.grad_clip)
    run.objective.after_update(run.model)  # the Bregman teacher (smart.mu > 0)
    run.average.update(run.model)  # the moving average (train.ema > 0)
    progress.updates += 1
