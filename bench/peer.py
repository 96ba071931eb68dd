"""The peer of the training benchmark: what a user would run instead of mtbert, measured in the same run.

That is three Hugging Face `Trainer` fine-tunings of the same backbone, one per task, the way the
`run_glue` example script does it: `AutoModelForSequenceClassification` (SST-5 5 labels, QQP 2, STS 1 for
regression), `DataCollatorWithPadding`, `group_by_length`, `per_device_train_batch_size` = mtbert's batch
size for the task (32 by default), bf16 by the same rule as mtbert's `train.bf16` (`run.bf16`), the
Trainer's default optimiser (fused AdamW on recent versions) and linear schedule, `max_grad_norm` =
`train.grad_clip`; pairs cross-encoded as `[CLS] a [SEP] b [SEP]` (the tokenized Parquet's `input_ids` and
`token_type_ids`), whatever encoding mtbert's own head for the task uses.

A peer step is what `Trainer.train`'s inner loop does per batch with no gradient accumulation: collate
the batch with the Trainer's `DataCollatorWithPadding` (through `get_batch_samples` where the installed
version has it), `training_step`, gradient clipping, `optimizer.step`, `lr_scheduler.step`, `zero_grad`;
the model and optimiser prepared by the Trainer's `accelerator` as `train` prepares them (that is where
bf16 autocast comes from). An mtbert step is what the `train` stage runs: training/step.py's `step` (batch assembly, the
objective, backward, the optimiser, the weights' moving average, the LR schedule).

Both train the same task mix: the steps are a subsequence of mtbert's own schedule (`schedule(run, 0)`,
its first `steps_per_task` steps of each task, in schedule order), run by both sides alternating block by
block, so a change in the machine's speed hits both alike. The overall figures weight each task by its
share of an epoch's batches, so they are the rate of a whole epoch's mix.

Both sides train on the same examples: each timed peer step collates the rows of the batch mtbert's step
just trained on. Batches are sorted by length, so a dozen batches drawn by each side's own sampler can
differ in mean length by a third, and their examples/s with it. mtbert's timed batches are
spread evenly over an epoch of its batch order (the batches between them are drawn untimed and dropped):
the first batches of an epoch are no fair sample of it.

What the samplers themselves cost, padding, is counted apart, over one whole epoch of each side's own
batches and without training: mtbert's length-bucketed windows of `train.bucket_batches` batches against
the Trainer's `group_by_length` (megabatches of 50 batches, each sorted longest first).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import inspect
import math
import time
from pathlib import Path

import numpy as np
import torch

from mtbert.data.batches import TaskSplit, bucketed_batches
from mtbert.model.backbone import load_tokenizer, resolve_backbone, starting_point
from mtbert.runtime import UserError
from mtbert.training.build import FineTuning, schedule
from mtbert.training.progress import Progress
from mtbert.training.step import step


@dataclasses.dataclass
class Tally:
    """Timed batches of one task (or of everything) on one side."""
    seconds: float = 0.0
    examples: int = 0
    tokens: int = 0  # non-padding
    batches: int = 0

    def add(self, seconds: float, examples: int, tokens: int) -> None:
        self.seconds += seconds
        self.examples += examples
        self.tokens += tokens
        self.batches += 1

    def figures(self) -> dict:
        return {"examples_per_second": round(self.examples / self.seconds, 2),
                "tokens_per_second": round(self.tokens / self.seconds, 1), "seconds": round(self.seconds, 3),
                "examples": self.examples, "tokens": self.tokens, "batches": self.batches}


def mixed_rate(tallies: dict[str, Tally], share: dict[str, float]) -> dict:
    """Examples/s and tokens/s of a mix of tasks in which task t makes up share[t] of the batches: per
    batch means weighted by the shares (the rate of a whole epoch, not of the timed sample's mix)."""
    def weighted(value) -> float:
        return sum(share[t] * value(tally) / tally.batches for t, tally in tallies.items())

    seconds = weighted(lambda tally: tally.seconds)
    return {"examples_per_second": round(weighted(lambda tally: tally.examples) / seconds, 2),
            "tokens_per_second": round(weighted(lambda tally: tally.tokens) / seconds, 1)}


# --- the peer ---------------------------------------------------------------------------------------
class CrossEncodedRows(torch.utils.data.Dataset):
    """One task's training rows as a Trainer is fed them: per example `input_ids`, `token_type_ids` (pairs
    cross-encoded; for an encoder family that reads them) and `labels`, as Python lists and numbers, cut out
    of the Arrow columns on demand."""

    def __init__(self, split: TaskSplit, regression: bool, token_types: bool = True):
        self.ids = split.tokens["input_ids"]
        self.types = split.tokens["token_type_ids"] if token_types else None
        self.labels = split.labels.astype(np.float32 if regression else np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        ids, types = self.ids, self.types
        row = {"input_ids": ids.values[ids.offsets[i]:ids.offsets[i + 1]].tolist(), "labels": self.labels[i].item()}
        if types is not None:
            row["token_type_ids"] = types.values[types.offsets[i]:types.offsets[i + 1]].tolist()
        return row


def padding_fraction(batches: list[np.ndarray], lengths: list[np.ndarray]) -> float:
    """The share of the tokens an epoch of `batches` computes that are padding: each batch is padded to its
    longest row, once per token column (`lengths`: a bi-encoder's two sentences are padded apart)."""
    real = sum(int(column.sum()) for column in lengths)
    padded = sum(int(column[rows].max()) * len(rows) for column in lengths for rows in batches if len(rows))
    return round(1 - real / padded, 4)


def mtbert_padding(run: FineTuning, task: str) -> float:
    """Padding of one pass of the task's own stream: length-bucketed windows, as the model reads the rows."""
    stream, split = run.streams[task], run.train_data[task]
    batches = bucketed_batches(stream.lengths, stream.batch_size, stream.bucket_batches, np.random.default_rng(0))
    columns = ("input_ids_1", "input_ids_2") if run.model.encoding(task) == "bi" else ("input_ids",)
    return padding_fraction(batches, [split.tokens[column].lengths() for column in columns])


def num_labels(kind) -> int:
    """run_glue's: a class per label (binary: 2), 1 for regression."""
    return {"regression": 1, "binary": 2}.get(kind.name, kind.output_size)


def require_accelerate() -> None:
    if importlib.util.find_spec("accelerate") is None:
        raise UserError("the Trainer peer needs accelerate: `pip install -e .[bench]` (or `.[dev]`)")


def training_arguments(run: FineTuning, task: str, output_dir: Path):
    """run_glue's arguments for one task; only what this version of transformers calls them varies."""
    from transformers import TrainingArguments

    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    # transformers 5 replaced group_by_length=True by train_sampling_strategy="group_by_length"
    grouping = {"group_by_length": True} if "group_by_length" in fields else \
        {"train_sampling_strategy": "group_by_length"}
    return TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=run.train.batch_size[task],
                             bf16=run.bf16, use_cpu=run.device.type == "cpu", learning_rate=run.train.lr,
                             weight_decay=run.train.weight_decay, max_grad_norm=run.train.grad_clip,
                             num_train_epochs=run.train.epochs, seed=run.train.seed, report_to="none",
                             save_strategy="no", disable_tqdm=True, **grouping)


class TrainerPeer:
    """One task's Trainer fine-tuning, set up as `Trainer.train` sets itself up, stepped one batch at a time."""

    def __init__(self, run: FineTuning, task: str, output_dir: Path):
        from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, Trainer

        require_accelerate()
        start = starting_point(run.params.model.name, run.paths.pretrained)
        tokenizer = load_tokenizer(start)
        kind = run.tasks[task].kind
        model = AutoModelForSequenceClassification.from_pretrained(resolve_backbone(start),
                                                                   num_labels=num_labels(kind))
        dataset = CrossEncodedRows(run.train_data[task], regression=kind.name == "regression",
                                   token_types=run.model.family.token_types)
        args = training_arguments(run, task, output_dir)
        # transformers 4.46 renamed Trainer(tokenizer=) to processing_class=
        named = "processing_class" if "processing_class" in inspect.signature(Trainer.__init__).parameters \
            else "tokenizer"
        trainer = Trainer(model=model, args=args, data_collator=DataCollatorWithPadding(tokenizer),
                          train_dataset=dataset, **{named: tokenizer})
        # as Trainer.train: the optimiser, the model and optimiser prepared by accelerate (bf16 autocast
        # wraps the model's forward there), then the schedule, over `train.epochs` epochs of the task
        trainer.create_optimizer()
        self.model, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
        trainer.model_wrapped = self.model
        trainer.create_scheduler(num_training_steps=math.ceil(len(dataset) / args.per_device_train_batch_size)
                                 * run.train.epochs, optimizer=trainer.optimizer)
        self.trainer, self.args, self.dataset = trainer, args, dataset
        self.takes_items = "num_items_in_batch" in inspect.signature(trainer.training_step).parameters
        fetch = getattr(trainer, "get_batch_samples", None)  # 4.46+: the loop fetches through it
        self.fetch_takes_device = fetch is not None and "device" in inspect.signature(fetch).parameters
        self.model.zero_grad()

    def collate(self, rows: np.ndarray) -> tuple[dict, object]:
        """These rows as the Trainer's inner loop receives a batch: collated and padded by its collator, with
        the item count for the loss that `get_batch_samples` adds where the installed version has it."""
        batch = self.trainer.data_collator([self.dataset[int(row)] for row in rows])
        if not hasattr(self.trainer, "get_batch_samples"):
            return batch, None
        extra = (self.args.device,) if self.fetch_takes_device else ()
        batches, items = self.trainer.get_batch_samples(iter([batch]), 1, *extra)
        return batches[0], items

    def padding(self) -> float:
        """Padding of one epoch of the Trainer's own batches (its `group_by_length` sampler's order)."""
        with torch.random.fork_rng():  # the sampler shuffles with torch's global generator
            order = np.fromiter(iter(self.trainer._get_train_sampler()), dtype=np.int64)
        size = self.args.per_device_train_batch_size
        batches = [order[start:start + size] for start in range(0, len(order), size)]
        return padding_fraction(batches, [self.dataset.ids.lengths()])

    def step(self, rows: np.ndarray) -> tuple[int, int]:
        """One training step of the batch of these rows; its examples and non-padding tokens."""
        trainer = self.trainer
        inputs, items = self.collate(rows)
        examples, tokens = len(inputs["input_ids"]), int(inputs["attention_mask"].sum())
        trainer.current_gradient_accumulation_steps = 1
        trainer.training_step(self.model, inputs, **({"num_items_in_batch": items} if self.takes_items else {}))
        if self.args.max_grad_norm > 0:
            trainer.accelerator.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        self.model.zero_grad()
        return examples, tokens


# --- mtbert's side ----------------------------------------------------------------------------------
def mtbert_step(run: FineTuning, progress: Progress, tasks: tuple[str, ...]) -> tuple[int, int]:
    """One step of the `train` stage (training/step.py's `step`, with its optimiser update); its examples and
    non-padding tokens."""
    before = progress.totals.examples, progress.totals.tokens
    step(run, progress, tasks, ends_update=True)
    return progress.totals.examples - before[0], progress.totals.tokens - before[1]


def mtbert_skip(run: FineTuning, task: str, batches: int) -> None:
    """Draw `batches` of the task's batches from its stream and drop them, untimed."""
    for _ in range(batches):
        run.streams[task].next()


def next_rows(run: FineTuning, tasks: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The rows of each task's next batch, leaving the streams where they were."""
    rows = {}
    for task in tasks:
        stream = run.streams[task]
        state = stream.state()
        rows[task] = stream.next()
        stream.load_state(state)
    return rows


# --- the plan and the measurement -------------------------------------------------------------------
def timed_plan(run: FineTuning, steps_per_task: int) -> list[tuple[str, ...]]:
    """The first `steps_per_task` steps of each task in mtbert's schedule, in schedule order (the epochs'
    schedules one after another, as far as the run's epochs go)."""
    counts = dict.fromkeys(run.tasks, 0)
    plan = []
    for epoch in range(run.train.epochs):
        for tasks in schedule(run, epoch):
            if any(counts[task] < steps_per_task for task in tasks):
                plan.append(tasks)
                for task in tasks:
                    counts[task] += 1
            if all(count >= steps_per_task for count in counts.values()):
                return plan
    return plan


def batches_between(batches_per_epoch: int, timed_steps: int) -> int:
    """Batches to drop before each timed one, so that one untimed warm-up batch and `timed_steps` timed
    ones lie evenly over one epoch of `batches_per_epoch` (the next epoch is another order)."""
    return max(0, batches_per_epoch // (timed_steps + 1) - 1)


def task_share(run: FineTuning) -> dict[str, float]:
    """Each task's share of the batches of mtbert's first epoch."""
    counts = dict.fromkeys(run.tasks, 0)
    for tasks in schedule(run, 0):
        for task in tasks:
            counts[task] += 1
    total = sum(counts.values())
    return {task: count / total for task, count in counts.items()}


def peer_figures(run: FineTuning, progress: Progress, steps_per_task: int, block: int, scratch: Path) -> dict:
    """Examples/s and non-padding tokens/s of the Trainer peer and of mtbert's `train` step on the same
    batches' examples, per task and over an epoch's task mix, alternating block by block; the ratio
    mtbert / peer of examples/s; each side's padding over an epoch. mtbert's batch streams are left where
    they were."""
    from transformers.utils import logging as hf_logging

    threads, verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # not the fresh heads' load report three times over
    try:
        peers = {task: TrainerPeer(run, task, scratch / f"peer-{task}") for task in run.tasks}
    finally:
        hf_logging.set_verbosity(verbosity)
    torch.set_num_threads(threads)  # whatever the Trainer's set-up did, both sides run on the same threads
    plan = timed_plan(run, steps_per_task)
    share = task_share(run)
    streams = {task: stream.state() for task, stream in run.streams.items()}
    sides = ("peer", "mtbert")
    tallies = {side: {task: Tally() for task in run.tasks} for side in sides}
    whole = {side: Tally() for side in sides}  # everything timed, for steps of several tasks (sampler: joint)
    dropped = {task: batches_between(stream.batches_per_pass, steps_per_task) for task, stream in run.streams.items()}
    for task in run.tasks:  # warm-up, untimed: a batch of each task each way
        peers[task].step(next_rows(run, (task,))[task])
        mtbert_step(run, progress, (task,))
    for start in range(0, len(plan), block):
        trained = []  # each mtbert step's rows, by task, for the peer's steps after the block
        for tasks in plan[start:start + block]:
            for task in tasks:
                mtbert_skip(run, task, dropped[task])
            trained.append(next_rows(run, tasks))
            started = time.perf_counter()
            examples, tokens = mtbert_step(run, progress, tasks)
            seconds = time.perf_counter() - started
            whole["mtbert"].add(seconds, examples, tokens)
            if len(tasks) == 1:
                tallies["mtbert"][tasks[0]].add(seconds, examples, tokens)
        for rows in trained:
            for task, task_rows in rows.items():
                started = time.perf_counter()
                examples, tokens = peers[task].step(task_rows)
                seconds = time.perf_counter() - started
                whole["peer"].add(seconds, examples, tokens)
                tallies["peer"][task].add(seconds, examples, tokens)
    for task, stream in run.streams.items():
        stream.load_state(streams[task])
    padding = {task: {"peer": peers[task].padding(), "mtbert": mtbert_padding(run, task)} for task in run.tasks}
    peer_setup = peers[next(iter(peers))].args
    del peers
    gc.collect()
    return {**summarise(tallies, whole, share, steps_per_task, run.bf16, peer_setup), "padding": padding}


def summarise(tallies: dict[str, dict[str, Tally]], whole: dict[str, Tally], share: dict[str, float],
              steps_per_task: int, bf16: bool, args) -> dict:
    import transformers

    tasks = {}
    for task in share:
        row = {side: tallies[side][task].figures() if tallies[side][task].batches else None for side in tallies}
        row["ratio"] = round(row["mtbert"]["examples_per_second"] / row["peer"]["examples_per_second"], 3) \
            if row["mtbert"] and row["peer"] else None
        tasks[task] = row
    per_task = all(tallies[side][task].batches for side in tallies for task in share)
    # With steps of several tasks (sampler: joint) mtbert's time is not split by task: everything timed
    # is the mix then, the schedule's own.
    overall = {side: mixed_rate(tallies[side], share) if per_task else
               {key: value for key, value in whole[side].figures().items() if key.endswith("_per_second")}
               for side in tallies}
    overall["ratio"] = round(overall["mtbert"]["examples_per_second"] / overall["peer"]["examples_per_second"], 3)
    optim = getattr(args.optim, "value", args.optim)
    return {"tasks": tasks, "overall": overall, "task_share": {t: round(s, 4) for t, s in share.items()},
            "steps_per_task": steps_per_task, "precision": "bf16" if bf16 else "fp32",
            "peer_setup": {"transformers": transformers.__version__, "optim": str(optim),
                           "lr_scheduler": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
                           "sampling": "group_by_length (its padding; timed on mtbert's batches' rows)",
                           "collator": "DataCollatorWithPadding",
                           "pairs": "cross-encoded"}}
