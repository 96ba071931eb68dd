"""The params.yaml schema and its validation: one frozen pydantic dataclass per section.

params.yaml is the single source of every knob: a missing or unknown key is an error. Only the per-task settings
(`heads` and the PerTask knobs) have defaults. A bad file fails before any work, in one line naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import reprlib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import Discriminator, Field, Tag, ValidationError, field_validator, model_validator
from pydantic import StrictBool as Bool
from pydantic import StrictFloat as Float
from pydantic import StrictInt as Int
from pydantic import StrictStr as Str
from pydantic.dataclasses import dataclass as pydantic_dataclass

from mtbert.runtime import UserError

DEFAULT_PARAMS_FILE = Path("params.yaml")
VARIANT_NAME = re.compile(r"[A-Za-z0-9_-]+")


class ParamsError(UserError, ValueError):
    """A params.yaml key is unknown, missing or has a bad value."""


# Int, Float, Str, Bool are strict: no "128" for an int, no 1 for true; an int is a fine float (stored as a float).
CONFIG = pydantic.ConfigDict(extra="forbid", str_min_length=1, allow_inf_nan=False, validate_by_name=True,
                             validate_by_alias=True)


def section(cls: type) -> type:
    """A frozen, keyword-only pydantic dataclass; building one directly (dataclasses.replace) raises ParamsError."""
    cls = pydantic_dataclass(frozen=True, kw_only=True, config=CONFIG)(cls)
    init = cls.__init__

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except ValidationError as error:
            raise ParamsError(f"{cls.__name__}: {_one_line(error, cls, '')}") from None

    cls.__init__ = checked_init
    return cls


# bf16 autocast: true, false, or auto (on where the device has native bf16 arithmetic; runtime.use_bf16)
Bf16 = Annotated[Annotated[Bool, Tag("bool")] | Annotated[Literal["auto"], Tag("auto")],
                 Discriminator(lambda v: "bool" if isinstance(v, bool) else "auto" if v == "auto" else None,
                               custom_error_type="bf16", custom_error_message="true, false or 'auto'")]
_EVERY, _SOME = "<every task>", "<some tasks>"  # the form a per-task knob took; left out of error messages


def PerTask(value: Any, **bounds) -> Any:  # noqa: N802 (a type)
    """One value for every task, or {task: value} for some: the tasks it leaves out (all of them, when the key is
    left out) get TASK_DEFAULTS. Params resolves it into {task: value} for every task, in task order."""
    item = Annotated[value, Field(**bounds)]
    return Annotated[Annotated[item, Tag(_EVERY)] | Annotated[dict[Str, item], Tag(_SOME)],
                     Discriminator(lambda v: _SOME if isinstance(v, dict) else _EVERY), Field(default_factory=dict)]


TASK_DEFAULTS = {"train": {"batch_size": 32, "task_lr_mult": 1.0, "max_train_examples": 0},
                 "smart": {"task_lambda": None}}


@section
class DataParams:
    """Where the raw files are and how much of them may be rejected."""
    raw_dir: Str
    max_reject_fraction: Float = Field(ge=0.0, le=1.0)  # a stage fails if a file rejects a larger share of rows
    unescape_ptb: list[Str]  # tasks whose text has PTB escapes such as -LRB- to turn back


@section
class TaskFiles:
    """The raw files of a task: <raw_dir>/<prefix>-<split name>.csv."""
    prefix: Str
    train: Str
    dev: Str
    test: Str


@section
class SubmissionParams:
    """The task's submission file for the grader."""
    file: Str  # <file>-<split>-output.csv
    column: Str  # the prediction column's header


TaskKind = Literal["classification", "binary", "regression"]
KIND_METRICS = {"classification": ("accuracy", "macro_f1"), "binary": ("accuracy", "f1"),
                "regression": ("pearson", "spearman")}


@section
class TaskParams:
    """One task's declaration; its kind decides loss, outputs, metrics and dumps (mtbert/data/kinds.py)."""
    files: TaskFiles
    text: list[Str]  # one column (a sentence) or two (a pair)
    label: Str  # the label column
    kind: TaskKind
    classes: Int | None = Field(None, ge=2)  # classification only: labels 0..classes-1
    range: list[Float] | None = None  # regression only: [lowest, highest] label
    metric: Str  # the headline metric: ranks models and enters the overall score
    submission: SubmissionParams

    @model_validator(mode="after")
    def _fits_the_kind(self) -> TaskParams:
        if len(self.text) not in (1, 2) or len(set(self.text)) != len(self.text):
            raise ParamsError(f"text: expected one column or two distinct ones, got {self.text!r}")
        if (self.kind == "classification") != (self.classes is not None):
            raise ParamsError(f"classes: expected for kind classification only, got {self.classes!r} "
                              f"with kind {self.kind}")
        if self.kind == "regression":
            if self.range is None or len(self.range) != 2 or not self.range[0] < self.range[1]:
                raise ParamsError(f"range: kind regression expects [lowest, highest], got {self.range!r}")
        elif self.range is not None:
            raise ParamsError(f"range: expected for kind regression only, got {self.range!r}")
        if self.metric not in KIND_METRICS[self.kind]:
            raise ParamsError(f"metric: kind {self.kind} offers {', '.join(KIND_METRICS[self.kind])}, "
                              f"got {self.metric!r}")
        return self


@section
class TokenizeParams:
    """How the raw text becomes token ids (stage `tokenize`)."""
    max_length: Int = Field(ge=8, le=4096)  # tokens per model input; pairs are truncated longest-first
    batch_size: Int = Field(ge=1)  # texts per fast-tokenizer call


@section
class ModelParams:
    """The backbone and how the tasks share it."""
    name: Str  # a Hugging Face model id or a local directory
    arch: Literal["shared", "cerbertus", "independent", "shared+independent", "static"]  # mtbert/model/architectures.py
    task_layers: Int = Field(ge=0)  # cerbertus: top encoder layers each task has its own copy of
    license: Str  # the backbone's license, which the fine-tuned models inherit (their model cards say it)


@section
class PretrainParams:
    """Masked-LM further pretraining of the backbone on the tasks' text (stage `pretrain`)."""
    enabled: Bool  # false: the stage passes the backbone through unchanged
    corpus: list[Literal["train", "dev", "test"]]  # splits trained on (dev/test: transductive, labels never read)
    mask_prob: Float = Field(gt=0.0, lt=1.0)  # share of tokens (whole_word: of words) chosen
    whole_word: Bool  # choose whole words: all WordPiece pieces of a word together
    steps: Int = Field(ge=1)
    batch_size: Int = Field(ge=1)
    lr: Float = Field(gt=0.0)
    weight_decay: Float = Field(ge=0.0)
    warmup_fraction: Float = Field(ge=0.0, lt=1.0)
    layer_decay: Float = Field(gt=0.0, le=1.0)  # LR factor per encoder layer towards the input
    grad_clip: Float = Field(ge=0.0)  # 0 turns clipping off
    max_length: Int = Field(ge=8)  # tokens per sentence; longer ones are cut (ending in [SEP])
    bucket_batches: Int = Field(ge=1)
    eval_every: Int = Field(ge=1)  # steps between held-out evaluations
    eval_examples: Int = Field(ge=0)  # dev sentences in the held-out set; 0 = all
    bf16: Bf16
    seed: Int = Field(ge=0)
    nproc: Int = Field(ge=1)  # processes on this machine; > 1 relaunches the stage through torchrun

    @model_validator(mode="after")
    def _distinct_splits(self) -> PretrainParams:
        if not self.corpus or len(set(self.corpus)) != len(self.corpus):
            raise ParamsError(f"corpus: expected a non-empty list of distinct splits, got {self.corpus!r}")
        return self


# A routing head's sizes unless set: 4 vectors of 64 (256 features into the output layer, against the 384 of
# a pooled MiniLM vector), and the reference implementation's 2 iterations.
ROUTING_DEFAULTS = {"routing_vectors": 4, "routing_dim": 64, "routing_iters": 2}


@section
class HeadParams:
    """One task's head. Every key has a default; a task left out of `heads` gets them all."""
    # cls: the pooler output; attention: CLS-anchored; routing: Heinsen routing of the token vectors, in place
    # of pooling and the hidden layers (mtbert/model/heads.py)
    pooling: Literal["cls", "mean", "max", "attention", "routing"] = "mean"
    hidden_layers: Int = Field(1, ge=0, le=8)  # Linear-GELU-Dropout blocks before the output layer
    dropout: Float = Field(0.0, ge=0.0, lt=1.0)
    loss_weight: Float = Field(1.0, ge=0.0)
    # pairs only, default cross: one joint sequence [CLS] a [SEP] b [SEP] | bi: each sentence alone
    encoding: Literal["cross", "bi"] | None = None
    combine: Literal["cosine", "features"] | None = None  # pairs only, default features; bi: cos(u,v) | [u,v,|u-v|,u*v]
    target: Literal["raw", "unit"] | None = None  # regression only, default raw: the label | it scaled to 0-1
    # pooling routing only, defaults ROUTING_DEFAULTS. Left out of as_dict while null, so the saved params and
    # resume fingerprints of every other head stay as they were.
    routing_vectors: Int | None = Field(None, ge=2, le=64, exclude_if=lambda value: value is None)  # output vectors
    routing_dim: Int | None = Field(None, ge=1, le=4096, exclude_if=lambda value: value is None)  # each one's size
    routing_iters: Int | None = Field(None, ge=1, le=8, exclude_if=lambda value: value is None)  # routing iterations

    @property
    def is_bi(self) -> bool:
        return self.encoding == "bi"


@section
class TrainParams:
    """Fine-tuning on every task at once (stage `train`); see docs/training.md."""
    seed: Int = Field(ge=0)
    epochs: Int = Field(ge=1)
    lr: Float = Field(gt=0.0)
    weight_decay: Float = Field(ge=0.0)
    layer_decay: Float = Field(gt=0.0, le=1.0)  # LR factor per encoder layer towards the input
    head_lr_mult: Float = Field(gt=0.0)
    task_lr_mult: PerTask(Float, gt=0.0)  # per task (default 1.0): x the LR of the parameters only that task uses
    embedding_lr_factor: Float = Field(ge=0.0)  # on top of layer decay; 0 freezes the embeddings
    warmup_fraction: Float = Field(ge=0.0, lt=1.0)
    schedule: Literal["linear", "cosine", "constant"]
    grad_clip: Float = Field(ge=0.0)  # max global grad norm; 0 turns clipping off
    grad_accum: Int = Field(ge=1)
    batch_size: PerTask(Int, ge=1)  # per task (default 32): examples per training batch
    eval_batch_size: Int = Field(ge=1)
    # round_robin_smallest: the tasks in turn, each as many batches per epoch as the smallest task has
    sampler: Literal["round_robin", "round_robin_smallest", "proportional", "temperature", "annealed", "shuffled",
                     "joint"]
    temperature: Float = Field(gt=0.0)  # for sampler: temperature (p ~ n^(1/T))
    bucket_batches: Int = Field(ge=1)  # batches per length-sorting window; 1 turns bucketing off
    max_examples: Int = Field(ge=0)  # per task and split, for quick runs; 0 uses all
    max_train_examples: PerTask(Int, ge=0)  # per task (default 0 = all): the first N training rows only
    max_batch_tokens: Int = Field(ge=0)  # a longer batch runs in pieces, gradients summed; 0 = never split
    bf16: Bf16
    nproc: Int = Field(ge=1)  # processes on this machine; > 1 relaunches the stage through torchrun
    gradient: Literal["plain", "pcgrad"]  # pcgrad: gradient surgery across the tasks of a joint step
    select: Literal["task", "overall"]  # each task's model from its own best dev epoch, or all from the best overall
    ema: Float = Field(ge=0.0, lt=1.0)  # > 0: the moving average of the weights with this decay is the model
    dev_raw: Bool  # with ema: the raw weights' dev metrics beside the average's, each epoch (one more dev pass)
    snapshot_test: Bool  # every epoch's test predictions beside its dev ones (ensemble.snapshots needs them)

    @model_validator(mode="after")
    def _pcgrad_needs_joint_steps(self) -> TrainParams:
        if self.gradient == "pcgrad" and self.sampler != "joint":
            raise ParamsError(f"gradient: pcgrad works across the tasks of one step, so it needs sampler: joint "
                              f"(one batch of every task per step), got sampler: {self.sampler}")
        return self


@section
class SmartParams:
    """SMART adversarial regularisation and the Bregman proximal-point teacher (Jiang et al. 2020); docs/smart.md.

    Sizes are relative to each token's own vector x_t at the perturbed site, in `norm`:
    ||delta_t|| <= radius * ||x_t||, so a radius reads as a fraction of the input (0.1 = 10%).
    """
    lambda_: Float = Field(ge=0.0, alias="lambda")  # weight of the adversarial term; 0 turns SMART off
    task_lambda: PerTask(Float | None, ge=0.0)  # per task (default null): null inherits lambda, 0 turns it off
    mode: Literal["adversarial", "random"]  # K ascent steps on delta | noise of size radius, no ascent pass
    perturb: Literal["words", "embeddings"]  # the word-embedding lookup | the embedding output after LayerNorm
    radius: Float = Field(ge=0.0)  # ||delta_t|| <= radius * ||x_t||, per token
    norm: Literal["inf", "l2"]
    eta: Float | None = Field(gt=0.0)  # adversarial: ascent step, relative like radius; null = radius
    sigma: Float = Field(gt=0.0)  # adversarial: starting noise, a fraction of the radius (not 0: no gradient)
    steps: Int = Field(ge=1)  # adversarial: K ascent steps
    dropout: Literal["same", "off"]  # the regularisers' pairs: same dropout masks, or dropout off in both
    mu: Float = Field(ge=0.0)  # weight of the Bregman term; 0 turns the teacher off
    beta: Float = Field(ge=0.0, lt=1.0)  # teacher momentum

    @model_validator(mode="after")
    def _ascent_reaches_the_radius(self) -> SmartParams:
        # With K steps of eta from (almost) zero, |delta| <= K * eta: a smaller total makes the radius meaningless.
        if self.mode == "adversarial" and self.eta is not None and self.eta * self.steps < self.radius:
            raise ParamsError(f"eta: {self.steps} step(s) of {self.eta} never reach the radius {self.radius}, "
                              "so the radius would change nothing; set eta: null (= radius) or raise it")
        return self

    @property
    def step_size(self) -> float:
        """The relative ascent step: eta, or the radius when eta is null (K = 1 then reaches the ball's edge)."""
        return self.radius if self.eta is None else self.eta

    def task_weight(self, task: str) -> float:
        override = self.task_lambda.get(task) if isinstance(self.task_lambda, dict) else self.task_lambda
        return self.lambda_ if override is None else override


@section
class PredictParams:
    """Predictions of the trained models (stage `predict`)."""
    batch_size: Int = Field(ge=1)
    bf16: Bf16


@section
class ExportParams:
    """Deployable ONNX graphs of trained models (stage `export@<model>`, docs/inference.md)."""
    models: list[Str]  # which: keys of `models:` (variants) or of distill.students (students)
    opset: Int = Field(ge=14)  # the graphs' ONNX opset (14: the first with every op a BERT encoder needs)
    tolerance: Float = Field(gt=0.0)  # the fp32 graphs must match PyTorch within this, or the export fails
    check_rows: Int = Field(ge=1)  # dev rows per task run through both PyTorch and ONNX Runtime at export
    batch_size: Int = Field(ge=1)  # rows per ONNX Runtime call for the dev metrics
    int8: Bool  # also write int8 graphs: ONNX Runtime's dynamic quantization of the weights
    int8_per_channel: Bool  # int8: one scale per output channel of each weight instead of per tensor
    int8_max_drop: Float = Field(ge=0.0)  # int8 is the default engine only if no task's dev headline drops more
    speed_rows: Int = Field(ge=1)  # dev rows per task timed with fp32 and int8 to see which is faster here


@section
class CheckpointEvery:
    """Optimiser steps between resume checkpoints."""
    train: Int = Field(ge=1)
    pretrain: Int = Field(ge=1)


@section
class RuntimeParams:
    """How fast and how safely a stage runs, never what it computes: dvc.yaml tracks none of these keys,
    so changing them re-runs nothing (and resume checkpoints stay valid)."""
    threads: Int = Field(ge=0)  # CPU threads per stage, shared among its processes; 0 = torch's default
    checkpoint_every: CheckpointEvery
    onednn_cache: Int = Field(ge=0)  # oneDNN kernels kept (one per op and shape); 0 = oneDNN's default
    malloc_threshold_mb: Int = Field(ge=0)  # glibc mmap and trim threshold; 0 = glibc's adaptive default


@section
class EnsembleParams:
    """How the variants' predictions combine (stage `ensemble`)."""
    method: Literal["uniform", "greedy"]  # the plain average of every candidate | greedy forward selection
    criterion: Literal["metric", "smooth"]  # greedy: the task's headline metric | log-loss or squared error
    snapshots: Bool  # every epoch of every variant is a candidate, not only each variant's chosen epoch
    max_members: Int = Field(ge=1)  # greedy: per task, counting repeats
    with_replacement: Bool  # greedy: a model may be added again, weighting it more


@section
class TransferParams:
    """The transfer set: inputs beyond the training rows that the teacher labels for the students (stage
    `transfer`, mtbert/data/transfer.py). Only training-split text goes in; docs/ensembling.md."""
    rows: dict[Str, Int]  # task -> transfer rows (0 = none); a task left out gets none
    pairs_from: Literal["own", "all"]  # pair tasks: new pairs of the task's own training sentences, or of every task's
    neighbours: Float = Field(ge=0.0, le=1.0)  # pair tasks: share of new pairs joining a sentence to a near neighbour
    top_k: Int = Field(ge=1)  # neighbours: the partner is one of the sentence's top_k nearest, drawn at random
    swapped: Float = Field(ge=0.0, le=1.0)  # pair tasks: share of rows that are training pairs in swapped order
    weight: Float = Field(ge=0.0)  # a transfer row's loss: weight x the teacher's (it has no gold label)
    seed: Int


@section
class DistillParams:
    """A student trained on the ensemble's predictions of the training rows (stages `distill@<student>`);
    docs/ensembling.md."""
    enabled: Bool  # false: each student's stage writes outputs that say so, in seconds
    variant: Str  # the key of `models:` whose configuration the students train with
    students: dict[Str, Int]  # student name -> its train.seed; the students form one seed group in `stats`
    alpha: Float = Field(ge=0.0, le=1.0)  # the teacher's weight in each row's loss; 1 - alpha: the gold label's
    temperature: Float = Field(gt=0.0)  # classification and binary: teacher and student probabilities at T
    transfer: TransferParams


@section
class StatsParams:
    """Seed statistics (stage `stats`)."""
    resamples: Int = Field(ge=1)  # bootstrap resamples of the dev rows per comparison
    confidence: Float = Field(gt=0.0, lt=1.0)  # of the bootstrap interval


@section
class Params:
    """The whole of params.yaml; per-task knobs and heads come resolved for every task, in task order."""
    tasks: dict[Str, TaskParams]  # task name -> its declaration, in the order the pipeline runs them
    data: DataParams
    tokenize: TokenizeParams
    model: ModelParams
    pretrain: PretrainParams
    heads: dict[Str, HeadParams]  # task name -> its head; a task left out gets HeadParams' defaults
    train: TrainParams
    smart: SmartParams
    predict: PredictParams
    # Not in as_dict: train hashes as_dict (less the sections it names) into its fingerprint and mtbert.json,
    # and exporting a model changes nothing train computes.
    export: ExportParams = Field(exclude=True)
    ensemble: EnsembleParams
    # Not in as_dict either: it trains students after the ensemble and changes nothing a variant computes.
    distill: DistillParams = Field(exclude=True)
    stats: StatsParams
    runtime: RuntimeParams
    models: dict[Str, dict]  # named variants: overrides deep-merged over the sections above

    @field_validator("heads", "models", mode="before")
    @classmethod
    def _none_as_empty(cls, value: Any) -> Any:  # `heads:`, `models:` or `base:` with nothing under it: {}
        if isinstance(value, dict):
            return {key: {} if item is None else item for key, item in value.items()}
        return {} if value is None else value

    @model_validator(mode="after")
    def _resolve_per_task(self) -> Params:
        _check_task_names(self.tasks)
        unknown = [name for name in self.data.unescape_ptb if name not in self.tasks]
        if unknown:
            raise ParamsError(f"data.unescape_ptb: unknown task {unknown[0]!r}; tasks declares {', '.join(self.tasks)}")
        resolved = {"heads": check_heads(self.tasks, self.heads)}
        for name, knobs in TASK_DEFAULTS.items():
            values = getattr(self, name)
            resolved[name] = dataclasses.replace(values, **{
                knob: per_task(getattr(values, knob), self.tasks, default, f"{name}.{knob}")
                for knob, default in knobs.items()})
        for name, value in resolved.items():
            object.__setattr__(self, name, value)  # frozen: set here, once, to the resolved values
        return self

    @model_validator(mode="after")
    def _students_beside_the_variants(self) -> Params:
        if self.distill.enabled and self.distill.variant not in self.models:
            raise ParamsError(f"distill.variant: expected a key of models ({', '.join(self.models)}), "
                              f"got {self.distill.variant!r}")
        unknown = [name for name in self.distill.transfer.rows if name not in self.tasks]
        if unknown:
            raise ParamsError(f"distill.transfer.rows.{unknown[0]}: unknown task; tasks declares "
                              f"{', '.join(self.tasks)}")
        negative = [name for name, rows in self.distill.transfer.rows.items() if rows < 0]
        if negative:
            raise ParamsError(f"distill.transfer.rows.{negative[0]}: expected a count >= 0, got "
                              f"{self.distill.transfer.rows[negative[0]]}")
        if not self.distill.students:
            raise ParamsError("distill.students: expected at least one student, e.g. {distilled: 0}")
        for name in self.distill.students:
            if not VARIANT_NAME.fullmatch(name) or name in self.models or name in ("ensemble", "pretrained"):
                raise ParamsError(f"distill.students.{name}: a student name may use letters, digits, '_' and '-', "
                                  "and cannot be a variant's, 'ensemble' or 'pretrained' (they share models/)")
        for name in self.export.models:
            if name not in self.models and name not in self.distill.students:
                raise ParamsError(f"export.models: expected keys of models or of distill.students "
                                  f"({', '.join([*self.models, *self.distill.students])}), got {name!r}")
        return self


@section
class ModelSpec:
    """What shapes a saved model besides its encoders: its tasks and their heads (from mtbert.json)."""
    tasks: dict[Str, TaskParams]
    heads: dict[Str, HeadParams]  # a saved model names every task's head

    @model_validator(mode="after")
    def _a_head_per_task(self) -> ModelSpec:
        _check_task_names(self.tasks)
        object.__setattr__(self, "heads", check_heads(self.tasks, self.heads, every=True))
        return self


def _check_task_names(tasks: dict) -> None:
    if not tasks:
        raise ParamsError("tasks: expected at least one task declaration")
    for name in tasks:
        if not VARIANT_NAME.fullmatch(name):
            raise ParamsError(f"tasks.{name}: a task name may use letters, digits, '_' and '-'")


def per_task(value: Any, tasks: dict, default: Any, key: str) -> dict:
    """A per-task knob as {task: value} for every task, in task order: a scalar is every task's value."""
    if not isinstance(value, dict):
        return dict.fromkeys(tasks, value)
    unknown = [name for name in value if name not in tasks]
    if unknown:
        raise ParamsError(f"{key}.{unknown[0]}: unknown task; tasks declares {', '.join(tasks)}")
    return {task: value.get(task, default) for task in tasks}


def check_heads(tasks: dict[str, TaskParams], heads: dict[str, HeadParams], key: str = "heads", *,
                every: bool = False) -> dict[str, HeadParams]:
    """Every task's head, in task order, with the defaults its text and kind take filled in; a key the task
    cannot take fails. `every`: a task without a head fails too, rather than getting the defaults."""
    missing = [name for name in tasks if name not in heads]
    if every and missing:
        raise ParamsError(f"missing key '{key}.{missing[0]}': a saved model names every task's head")
    resolved = {}
    for name, head in per_task(heads, tasks, HeadParams(), key).items():
        task = tasks[name]
        pair, regression = len(task.text) == 2, task.kind == "regression"
        for option in ("encoding", "combine"):
            if not pair and getattr(head, option) is not None:
                raise ParamsError(f"{key}.{name}.{option}: task {name} has one sentence, so it takes no {option}")
        if not regression and head.target is not None:
            raise ParamsError(f"{key}.{name}.target: expected for regression tasks only (task {name} is "
                              f"{task.kind}), got {head.target!r}")
        head = dataclasses.replace(head, encoding=head.encoding or ("cross" if pair else None),
                                   combine=head.combine or ("features" if pair else None),
                                   target=head.target or ("raw" if regression else None))
        if head.is_bi and head.combine == "cosine" and task.kind == "classification":
            raise ParamsError(f"{key}.{name}.combine: cosine gives one score, but task {name} has "
                              f"{task.classes} classes; use features")
        resolved[name] = with_routing_sizes(head, f"{key}.{name}")
    return resolved


def with_routing_sizes(head: HeadParams, key: str) -> HeadParams:
    """A routing head with ROUTING_DEFAULTS for the sizes it leaves out; a size on another pooling fails."""
    if head.pooling != "routing":
        for option in ROUTING_DEFAULTS:
            if getattr(head, option) is not None:
                raise ParamsError(f"{key}.{option}: expected with pooling: routing only, got pooling: {head.pooling}")
        return head
    return dataclasses.replace(head, **{option: getattr(head, option) or default
                                        for option, default in ROUTING_DEFAULTS.items()})


def load_params(path: Path | str = DEFAULT_PARAMS_FILE) -> Params:
    """Read and validate params.yaml; raise ParamsError naming the first bad key."""
    return parse_params(_read_yaml(Path(path)), source=str(path))


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found (run from the repository root)") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ParamsError(f"{path}: not valid YAML{where}: {' '.join(problem.split())}") from None


def parse_params(raw: Any, *, source: str = "params") -> Params:
    try:
        params = _validate(Params, raw, "")
        for variant in params.models:
            if not VARIANT_NAME.fullmatch(variant) or variant == "ensemble":
                raise ParamsError(f"models.{variant}: a variant name may use letters, digits, '_' and '-', "
                                  "and cannot be 'ensemble'")
            _validate(Params, merged_variant(raw, variant), f"models.{variant}")
        return params
    except ParamsError as error:
        raise ParamsError(f"{source}: {error}") from None


def parse_section(cls: type, raw: Any, key: str, *, source: str = "params") -> Any:
    """One section (e.g. a ModelSpec from a saved model's config), validated like params.yaml."""
    try:
        return _validate(cls, raw, key)
    except ParamsError as error:
        raise ParamsError(f"{source}: {error}") from None


def variant_params(raw_or_path: Any, variant: str) -> Params:
    """The params of one named variant: its overrides deep-merged over the shared sections."""
    raw, source = raw_or_path, "params"
    if isinstance(raw_or_path, (str, Path)):
        raw, source = _read_yaml(Path(raw_or_path)), str(raw_or_path)
    parse_params(raw, source=source)
    return _validate(Params, merged_variant(raw, variant), f"models.{variant}")


def student_params(params_file: Path | str, student: str) -> Params:
    """The params of one distilled student: distill.variant's with the student's seed (distill.students)."""
    raw = _read_yaml(Path(params_file))
    distill = parse_params(raw, source=str(params_file)).distill
    require_student(distill, student, params_file)
    merged = deep_merge(merged_variant(raw, distill.variant), {"train": {"seed": distill.students[student]}})
    return parse_section(Params, merged, f"distill.students.{student}", source=str(params_file))


def require_student(distill: DistillParams, student: str, source: Path | str) -> None:
    if student not in distill.students:
        raise ParamsError(f"{source}: distill.students: no student {student!r}; it names "
                          f"{', '.join(distill.students)}")


def merged_variant(raw: dict, variant: str) -> dict:
    models = raw.get("models") or {}
    if variant not in models:
        raise ParamsError(f"unknown variant {variant!r}; models defines: {', '.join(models) or 'none'}")
    overrides = models[variant] or {}
    if not isinstance(overrides, dict):
        raise ParamsError(f"models.{variant}: expected a mapping of overrides, got {overrides!r}")
    for name in ("models", "tasks", "ensemble", "distill", "stats"):  # tokenize's tasks; what combines the variants
        if name in overrides:
            raise ParamsError(f"models.{variant}: a variant cannot override '{name}'")
    refuse_null_mappings(raw, overrides, f"models.{variant}")
    return deep_merge(with_scalars_as_maps(raw, overrides), overrides)


def refuse_null_mappings(base: dict, overrides: dict, key: str) -> None:
    """A variant's null where the shared params have a mapping (e.g. `heads: {sts: null}`) would reset all of
    it to the defaults without a word; refuse it."""
    for name, value in overrides.items():
        shared = base.get(name) if isinstance(base, dict) else None
        if value is None and isinstance(shared, dict):
            raise ParamsError(f"{key}.{name}: expected a mapping of overrides, got null (it would drop the shared "
                              f"{name} settings)")
        if isinstance(value, dict) and isinstance(shared, dict):
            refuse_null_mappings(shared, value, f"{key}.{name}")


def with_scalars_as_maps(raw: dict, overrides: dict) -> dict:
    """raw with each per-task scalar that a variant overrides with a mapping spelled out for every task, so
    the variant's mapping changes the tasks it names and the others keep the shared scalar."""
    tasks = raw.get("tasks") if isinstance(raw.get("tasks"), dict) else {}
    raw = dict(raw)
    for section, knobs in TASK_DEFAULTS.items():
        shared, override = raw.get(section), overrides.get(section)
        if not isinstance(shared, dict) or not isinstance(override, dict):
            continue
        spelled = {knob: dict.fromkeys(tasks, shared[knob]) for knob in knobs
                   if knob in shared and not isinstance(shared[knob], dict) and isinstance(override.get(knob), dict)}
        raw[section] = {**shared, **spelled}
    return raw


def deep_merge(base: dict, overrides: dict) -> dict:
    """A copy of base with overrides applied; nested mappings merge key by key, other values replace."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def as_dict(params: Any) -> Any:
    """Plain nested dicts and lists of params, keyed as in params.yaml (e.g. `lambda`), e.g. to save beside a model."""
    return _adapter(Any).dump_python(params, by_alias=True)


_adapter = functools.cache(pydantic.TypeAdapter)


def _validate(cls: type, raw: Any, key: str) -> Any:
    try:
        return _adapter(cls).validate_python(raw, by_name=False)  # params.yaml says `lambda`, never `lambda_`
    except ValidationError as error:
        raise ParamsError(_one_line(error, cls, key)) from None


_EXPECTED = {"int_type": "an integer", "float_type": "a finite number", "finite_number": "a finite number",
             "bool_type": "true or false", "string_type": "a non-empty string", "list_type": "a list",
             "string_too_short": "a non-empty string", "dict_type": "a mapping", "dataclass_type": "a mapping"}
_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
           "less_than": ("lt", "<")}


def _one_line(error: ValidationError, root: type, key: str) -> str:
    """pydantic's first error (unknown keys first, then missing ones) as one line naming the dotted key."""
    first = min(error.errors(), key=lambda e: {"unexpected_keyword_argument": 0, "missing": 1}.get(e["type"], 2))
    loc = [str(part) for part in first["loc"] if part not in (_EVERY, _SOME)]
    name, parent = ".".join(filter(None, [key, *loc])), ".".join(filter(None, [key, *loc[:-1]]))
    kind, ctx = first["type"], first.get("ctx", {})
    if kind == "unexpected_keyword_argument":
        section_type = root
        for part in loc[:-1]:
            section_type = (typing.get_args(section_type)[1] if typing.get_origin(section_type) is dict
                            else section_type.__pydantic_fields__[part].annotation)
        accepted = [field.alias or field_name for field_name, field in section_type.__pydantic_fields__.items()]
        return f"unknown key {name!r}; {parent or 'the top level'} accepts: {', '.join(accepted)}"
    if kind == "missing":
        return f"missing key {name!r}"
    if kind == "value_error":  # a rule across keys, its message naming the key within the section
        return ".".join(filter(None, [name, str(ctx["error"])]))
    if kind in _BOUNDS:
        expected = f"a value {_BOUNDS[kind][1]} {ctx[_BOUNDS[kind][0]]}"
    else:
        expected = ctx["expected"] if kind == "literal_error" else _EXPECTED.get(kind, first["msg"])
    return f"{name or 'the top level'}: expected {expected}, got {reprlib.repr(first['input'])}"
