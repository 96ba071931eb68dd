"""Multitask fine-tuning of one variant, keeping each task's model from its best dev epoch: the loop.

Read it top to bottom, as the `train` and `distill` stages call it (`fine_tune`):

    run, progress = start(params, variant, paths)  # the process set up; model, data, optimiser; resumed
    summary = train(run, progress)                 # the loop

`train` runs, per epoch, the sampler's schedule of steps (`train_epoch`). The default step reads top to
bottom below: `accumulate_gradients` (each task's batch in pieces: forward and loss, training/losses.py's
`Objective`; backward), then every train.grad_accum steps `update` (clipping, AdamW, the LR schedule, the
weights' moving average). What the params add to it, the step calls without choosing: `run.hooks`
(training/build.py's `step_hooks`: PCGrad, several ranks' averaging, the Bregman teacher) and the objective's
SMART terms (training/smart.py's `Regularised`). The rest, by job:
- training/build.py: `FineTuning` (what the loop works with), `prepare`, the schedule, the fingerprint;
- training/progress.py: `Progress` (counters, running sums, history) and the checkpoint a killed run
  resumes from (`checkpoint`, `resume`);
- training/epoch_end.py: the dev evaluation, snapshot dumps, the epoch's record, the model saved aside;
- training/publish.py: the summary, the model folder and the published dumps;
- training/capture.py: the step as CUDA graphs on a GPU (runtime.capture.cuda).
"""

from __future__ import annotations

import logging

from tqdm.auto import tqdm

from mtbert.data.batches import micro_batches, on_device, padding_free_tokens
from mtbert.params import Params
from mtbert.runtime import limit_memory_growth, open_live
from mtbert.training.build import FineTuning, prepare, run_fingerprint, schedule
from mtbert.training.distillation import Distillation
from mtbert.training.distributed import setup_process, shard, shutdown
from mtbert.training.epoch_end import end_epoch, log_epoch
from mtbert.training.loop import Paths, clip_and_step, finish
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
    # chosen once, outside the step: captured only on a GPU with runtime.capture.cuda (training/capture.py)
    step = run.captured.step if run.captured is not None else eager_step
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
    if run.captured is not None:
        log.info("epoch %d: %s", progress.epoch + 1, run.captured.summary())


def eager_step(run: FineTuning, progress: Progress, tasks: tuple[str, ...], ends_update: bool) -> None:
    """One sampler step's gradients, then the optimiser update where the step ends one."""
    accumulate_gradients(run, progress, tasks)
    if ends_update:
        update(run, progress)


def accumulate_gradients(run: FineTuning, progress: Progress, tasks: tuple[str, ...]) -> None:
    """One step's gradients: for each task, its next batch (this rank's share) in pieces, forward, loss,
    backward. Each piece's loss is scaled by its share of the global batch and by 1 / grad_accum, so the
    gradients summed over pieces, ranks and accumulated steps are the global batch's mean."""
    for task in tasks:
        global_rows = run.streams[task].next()  # the same on every rank
        rows = shard(global_rows, run.ranks)  # every world_size-th row: all of them in one process
        encoding = run.model.encoding(task)  # cross (a pair as one sequence) or bi: how its rows are batched
        for piece in micro_batches(rows, run.row_lengths[task], run.train.max_batch_tokens, run.pad_multiple):
            batch = run.train_data[task].batch(piece, encoding, run.pad_multiple)
            tokens = padding_free_tokens(batch)  # counted on the host, before the copy
            batch = on_device(batch, run.device)
            loss = run.objective(run.model, task, batch)  # the task's loss (plus SMART's terms), weighted
            # both keep the loss on the device, unread: the step never waits for it. `finite` is read every
            # runtime.check_every steps (train_epoch); `totals` are the epoch's running sums, for its record.
            run.finite.add(loss.total, f"{task} loss",
                           f"at epoch {progress.epoch + 1} step {progress.step_in_epoch + 1}")
            progress.totals.add(task, len(piece), tokens, loss, weight=len(piece) / len(rows))
            share = len(piece) * run.ranks.world_size / len(global_rows)  # of the global batch
            run.hooks.backward(loss.total * share / run.train.grad_accum)  # frees the piece's activations
        progress.totals.batches[task] += bool(len(rows))
        for hook in run.hooks.after_task:
            hook()
    for hook in run.hooks.after_step:
        hook(progress)


def update(run: FineTuning, progress: Progress) -> None:
    """One optimiser update: the gradients clipped to a global norm, AdamW and the LR schedule's step, then
    what follows the weights (by default the moving average)."""
    for hook in run.hooks.before_update:
        hook()
    clip_and_step(run.model, run.optimizer, run.scheduler, run.train.grad_clip)  # as the masked-LM loop's update
    for hook in run.hooks.after_update:  # by default train.ema's average: avg += (1 - d) / (1 - d^t) * (w - avg)
        hook(run.model)
    progress.updates += 1
