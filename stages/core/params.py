"""The params.yaml schema and its validation.

params.yaml is the single source of every knob: the dataclasses below declare each key's type and
allowed range but carry no defaults, so a key missing from params.yaml is an error, as is a key the
schema does not know. Validation runs before a stage does any work and names the offending key.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from stages.core.runtime import UserError

DEFAULT_PARAMS_FILE = Path("params.yaml")
VARIANT_NAME = re.compile(r"[A-Za-z0-9_-]+")


class ParamsError(UserError, ValueError):
    """A params.yaml key is unknown, missing or has a bad value."""


def _bounded(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
             lt: float | None = None, key: str | None = None) -> Any:
    """A required dataclass field whose numeric value must lie in the given bounds.

    `key` is its name in params.yaml when that is not a valid Python name (e.g. `lambda`).
    """
    return dataclasses.field(metadata={"ge": ge, "gt": gt, "le": le, "lt": lt, "key": key})


def _optional(**bounds) -> Any:
    """A field that may be absent from params.yaml (then None): a key only some tasks or heads need."""
    field = _bounded(**bounds)
    return dataclasses.field(metadata={**field.metadata, "optional": True})


def _yaml_key(field: dataclasses.Field) -> str:
    return field.metadata.get("key") or field.name


@dataclasses.dataclass(frozen=True)
class DataParams:
    raw_dir: str
    max_reject_fraction: float = _bounded(ge=0.0, le=1.0)
    unescape_ptb: list[str]  # tasks whose text has PTB escapes such as -LRB- to turn back


@dataclasses.dataclass(frozen=True)
class TaskFiles:
    """The raw files of a task: <raw_dir>/<prefix>-<split name>.csv."""
    prefix: str
    train: str
    dev: str
    test: str


@dataclasses.dataclass(frozen=True)
class SubmissionParams:
    file: str  # <file>-<split>-output.csv
    column: str  # the prediction column's header


TaskKind = Literal["classification", "binary", "regression"]
KIND_METRICS = {"classification": ("accuracy", "macro_f1"), "binary": ("accuracy", "f1"),
                "regression": ("pearson", "spearman")}


@dataclasses.dataclass(frozen=True)
class TaskParams:
    """One task's declaration; its kind decides loss, outputs, metrics and dumps (stages/core/data/kinds.py)."""
    files: TaskFiles
    text: list[str]  # one column (a sentence) or two (a pair)
    label: str  # the label column
    kind: TaskKind
    classes: int | None = _optional(ge=2)  # classification only: labels 0..classes-1
    range: list[float] | None = _optional()  # regression only: [lowest, highest] label
    metric: str  # the headline metric: ranks models and enters the overall score
    submission: SubmissionParams

    def __post_init__(self):
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


@dataclasses.dataclass(frozen=True)
class TokenizeParams:
    max_length: int = _bounded(ge=8, le=4096)
    batch_size: int = _bounded(ge=1)


Arch = Literal["shared", "cerbertus", "independent", "shared+independent", "static"]


@dataclasses.dataclass(frozen=True)
class ModelParams:
    name: str
    arch: Arch  # which encoders each task's head reads: see stages/core/model/architectures.py
    task_layers: int = _bounded(ge=0)  # cerbertus: top encoder layers each task has its own copy of
    license: str  # the backbone's license, which the fine-tuned models inherit (their model cards say it)


# bf16 autocast: true, false, or auto (on where the device has native bf16 arithmetic; runtime.use_bf16)
Bf16 = bool | Literal["auto"]
Split = Literal["train", "dev", "test"]


@dataclasses.dataclass(frozen=True)
class PretrainParams:
    """Masked-LM further pretraining of the backbone on the tasks' text (stage `pretrain`)."""
    enabled: bool  # false: the stage passes the backbone through unchanged
    corpus: list[Split]  # splits whose text is trained on; dev/test text is transductive (labels never read)
    mask_prob: float = _bounded(gt=0.0, lt=1.0)  # share of tokens (whole_word: of words) chosen
    whole_word: bool  # choose whole words: all WordPiece pieces of a word together
    steps: int = _bounded(ge=1)
    batch_size: int = _bounded(ge=1)
    lr: float = _bounded(gt=0.0)
    weight_decay: float = _bounded(ge=0.0)
    warmup_fraction: float = _bounded(ge=0.0, lt=1.0)
    layer_decay: float = _bounded(gt=0.0, le=1.0)  # LR factor per encoder layer towards the input
    grad_clip: float = _bounded(ge=0.0)  # 0 turns clipping off
    max_length: int = _bounded(ge=8)  # tokens per sentence; longer ones are cut (ending in [SEP])
    bucket_batches: int = _bounded(ge=1)
    eval_every: int = _bounded(ge=1)  # steps between held-out evaluations
    eval_examples: int = _bounded(ge=0)  # dev sentences in the held-out set; 0 = all
    bf16: Bf16
    seed: int = _bounded(ge=0)
    nproc: int = _bounded(ge=1)  # processes on this machine; > 1 relaunches the stage through torchrun

    def __post_init__(self):
        if not self.corpus or len(set(self.corpus)) != len(self.corpus):
            raise ParamsError(f"corpus: expected a non-empty list of distinct splits, got {self.corpus!r}")


Pooling = Literal["cls", "mean", "max", "attention"]


@dataclasses.dataclass(frozen=True)
class HeadParams:
    """One task's head. Pair tasks also set encoding and combine; regression tasks set target."""
    pooling: Pooling
    hidden_layers: int = _bounded(ge=0, le=8)  # Linear-GELU-Dropout blocks before the output layer
    dropout: float = _bounded(ge=0.0, lt=1.0)
    loss_weight: float = _bounded(ge=0.0)
    encoding: Literal["cross", "bi"] | None = _optional()  # one joint sequence, or each sentence alone
    combine: Literal["cosine", "features"] | None = _optional()  # bi only: cos(u, v), or [u, v, |u-v|, u*v]
    target: Literal["raw", "unit"] | None = _optional()  # regress on the label, or on it scaled to 0-1

    @property
    def is_bi(self) -> bool:
        return self.encoding == "bi"


def check_heads(tasks: dict[str, TaskParams], heads: dict[str, HeadParams], key: str = "heads") -> None:
    """Each task has one head, with the keys its text and kind need and no others."""
    check_task_keys(tasks, heads, key)
    for name, head in heads.items():
        task = tasks[name]
        pair = len(task.text) == 2
        for option in ("encoding", "combine"):
            if pair and getattr(head, option) is None:
                raise ParamsError(f"missing key '{key}.{name}.{option}': task {name} is a sentence pair")
            if not pair and getattr(head, option) is not None:
                raise ParamsError(f"{key}.{name}.{option}: task {name} has one sentence, so it takes no {option}")
        if (task.kind == "regression") != (head.target is not None):
            raise ParamsError(f"{key}.{name}.target: expected for regression tasks only (task {name} is "
                              f"{task.kind}), got {head.target!r}")
        if head.is_bi and head.combine == "cosine" and task.kind == "classification":
            raise ParamsError(f"{key}.{name}.combine: cosine gives one score, but task {name} has "
                              f"{task.classes} classes; use features")


def check_task_keys(tasks: dict, mapping: dict, key: str) -> None:
    """A per-task map names exactly the declared tasks."""
    unknown = [name for name in mapping if name not in tasks]
    if unknown:
        raise ParamsError(f"{key}.{unknown[0]}: unknown task; tasks declares {', '.join(tasks)}")
    missing = [name for name in tasks if name not in mapping]
    if missing:
        raise ParamsError(f"missing key '{key}.{missing[0]}': every task declared in tasks needs one")


Sampler = Literal["round_robin", "proportional", "temperature", "annealed", "shuffled", "joint"]


@dataclasses.dataclass(frozen=True)
class TrainParams:
    seed: int = _bounded(ge=0)
    epochs: int = _bounded(ge=1)
    lr: float = _bounded(gt=0.0)
    weight_decay: float = _bounded(ge=0.0)
    layer_decay: float = _bounded(gt=0.0, le=1.0)  # LR factor per encoder layer towards the input
    head_lr_mult: float = _bounded(gt=0.0)
    task_lr_mult: dict[str, float] = _bounded(gt=0.0)  # per task, on the parameters only that task uses
    embedding_lr_factor: float = _bounded(ge=0.0)  # on top of layer decay; 0 freezes the embeddings
    warmup_fraction: float = _bounded(ge=0.0, lt=1.0)
    schedule: Literal["linear", "cosine", "constant"]
    grad_clip: float = _bounded(ge=0.0)  # max global grad norm; 0 turns clipping off
    grad_accum: int = _bounded(ge=1)
    batch_size: dict[str, int] = _bounded(ge=1)  # per task
    eval_batch_size: int = _bounded(ge=1)
    sampler: Sampler
    temperature: float = _bounded(gt=0.0)  # for sampler: temperature (p ~ n^(1/T))
    bucket_batches: int = _bounded(ge=1)  # batches per length-sorting window; 1 turns bucketing off
    max_examples: int = _bounded(ge=0)  # per task and split, for quick runs; 0 uses all
    max_train_examples: dict[str, int] = _bounded(ge=0)  # per task, the train split only (learning curves); 0 = all
    max_batch_tokens: int = _bounded(ge=0)  # a longer batch runs in pieces, gradients summed; 0 = never split
    bf16: Bf16
    nproc: int = _bounded(ge=1)  # processes on this machine; > 1 relaunches the stage through torchrun
    gradient: Literal["plain", "pcgrad"]  # pcgrad: gradient surgery across the tasks of a joint step
    select: Literal["task", "overall"]  # each task's model from its own best dev epoch, or all from the best overall
    ema: float = _bounded(ge=0.0, lt=1.0)  # > 0: the moving average of the weights with this decay is the model

    def __post_init__(self):
        if self.gradient == "pcgrad" and self.sampler != "joint":
            raise ParamsError(f"gradient: pcgrad works across the tasks of one step, so it needs sampler: joint "
                              f"(one batch of every task per step), got sampler: {self.sampler}")


@dataclasses.dataclass(frozen=True)
class SmartParams:
    """SMART adversarial regularisation and the Bregman proximal-point teacher (Jiang et al. 2020).

    Sizes are relative to each token's own vector x_t at the perturbed site, in `norm`:
    ||delta_t|| <= radius * ||x_t||, so a radius reads as a fraction of the input (0.1 = 10%).
    """
    lambda_: float = _bounded(ge=0.0, key="lambda")  # weight of the adversarial term; 0 turns SMART off
    task_lambda: dict[str, float | None] = _bounded(ge=0.0)  # per task: null inherits lambda, 0 turns it off
    mode: Literal["adversarial", "random"]  # K ascent steps on delta | noise of size radius, no ascent pass
    perturb: Literal["words", "embeddings"]  # the word-embedding lookup | the embedding output after LayerNorm
    radius: float = _bounded(ge=0.0)  # ||delta_t|| <= radius * ||x_t||, per token
    norm: Literal["inf", "l2"]
    eta: float | None = _bounded(gt=0.0)  # adversarial: ascent step, relative like radius; null = radius
    sigma: float = _bounded(gt=0.0)  # adversarial: starting noise, a fraction of the radius (not 0: no gradient)
    steps: int = _bounded(ge=1)  # adversarial: K ascent steps
    dropout: Literal["same", "off"]  # the regularisers' pairs: same dropout masks, or dropout off in both
    mu: float = _bounded(ge=0.0)  # weight of the Bregman term; 0 turns the teacher off
    beta: float = _bounded(ge=0.0, lt=1.0)  # teacher momentum

    def __post_init__(self):
        # With K steps of eta from (almost) zero, |delta| <= K * eta: a smaller total makes the radius meaningless.
        if self.mode == "adversarial" and self.eta is not None and self.eta * self.steps < self.radius:
            raise ParamsError(f"smart.eta: {self.steps} step(s) of {self.eta} never reach the radius {self.radius}, "
                              "so the radius would change nothing; set eta: null (= radius) or raise it")

    @property
    def step_size(self) -> float:
        """The relative ascent step: eta, or the radius when eta is null (K = 1 then reaches the ball's edge)."""
        return self.radius if self.eta is None else self.eta

    def task_weight(self, task: str) -> float:
        override = self.task_lambda[task]
        return self.lambda_ if override is None else override


@dataclasses.dataclass(frozen=True)
class PredictParams:
    batch_size: int = _bounded(ge=1)
    bf16: Bf16


@dataclasses.dataclass(frozen=True)
class CheckpointEvery:
    train: int = _bounded(ge=1)  # optimiser steps between resume checkpoints
    pretrain: int = _bounded(ge=1)


@dataclasses.dataclass(frozen=True)
class RuntimeParams:
    """How fast and how safely a stage runs, never what it computes: dvc.yaml tracks none of these keys,
    so changing them re-runs nothing (and resume checkpoints stay valid)."""
    threads: int = _bounded(ge=0)  # CPU threads per stage, shared among its processes; 0 = torch's default
    checkpoint_every: CheckpointEvery
    onednn_cache: int = _bounded(ge=0)  # oneDNN kernels kept (one per op and shape); 0 = oneDNN's default
    malloc_threshold_mb: int = _bounded(ge=0)  # glibc mmap and trim threshold; 0 = glibc's adaptive default


@dataclasses.dataclass(frozen=True)
class EnsembleParams:
    method: Literal["uniform", "greedy"]  # the plain average of every candidate | greedy forward selection
    criterion: Literal["metric", "smooth"]  # greedy: the task's headline metric | log-loss or squared error
    snapshots: bool  # every epoch of every variant is a candidate, not only each variant's chosen epoch
    max_members: int = _bounded(ge=1)  # greedy: per task, counting repeats
    with_replacement: bool  # greedy: a model may be added again, weighting it more


@dataclasses.dataclass(frozen=True)
class StatsParams:
    resamples: int = _bounded(ge=1)  # bootstrap resamples of the dev rows per comparison
    confidence: float = _bounded(gt=0.0, lt=1.0)  # of the bootstrap interval


@dataclasses.dataclass(frozen=True)
class Params:
    tasks: dict[str, TaskParams]  # task name -> its declaration, in the order the pipeline runs them
    data: DataParams
    tokenize: TokenizeParams
    model: ModelParams
    pretrain: PretrainParams
    heads: dict[str, HeadParams]  # task name -> its head
    train: TrainParams
    smart: SmartParams
    predict: PredictParams
    ensemble: EnsembleParams
    stats: StatsParams
    runtime: RuntimeParams
    models: dict[str, dict]  # named variants: overrides deep-merged over the sections above

    def __post_init__(self):
        if not self.tasks:
            raise ParamsError("tasks: expected at least one task declaration")
        for name in self.tasks:
            if not VARIANT_NAME.fullmatch(name):
                raise ParamsError(f"tasks.{name}: a task name may use letters, digits, '_' and '-'")
        unknown = [name for name in self.data.unescape_ptb if name not in self.tasks]
        if unknown:
            raise ParamsError(f"data.unescape_ptb: unknown task {unknown[0]!r}; tasks declares {', '.join(self.tasks)}")
        check_heads(self.tasks, self.heads)
        check_task_keys(self.tasks, self.train.batch_size, "train.batch_size")
        check_task_keys(self.tasks, self.train.task_lr_mult, "train.task_lr_mult")
        check_task_keys(self.tasks, self.train.max_train_examples, "train.max_train_examples")
        check_task_keys(self.tasks, self.smart.task_lambda, "smart.task_lambda")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What shapes a saved model besides its encoders: its tasks and their heads (from mtbert.json)."""
    tasks: dict[str, TaskParams]
    heads: dict[str, HeadParams]

    def __post_init__(self):
        if not self.tasks:
            raise ParamsError("tasks: expected at least one task declaration")
        check_heads(self.tasks, self.heads)


def load_params(path: Path | str = DEFAULT_PARAMS_FILE) -> Params:
    """Read and validate params.yaml; raise ParamsError naming the first bad key."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found (run from the repository root)") from None
    except yaml.YAMLError as error:
        raise ParamsError(f"{path}: not valid YAML: {error}") from None
    return parse_params(raw, source=str(path))


def parse_params(raw: Any, *, source: str = "params") -> Params:
    try:
        params = _build(Params, raw, "")
        for variant in params.models:
            if not VARIANT_NAME.fullmatch(variant) or variant == "ensemble":
                raise ParamsError(f"models.{variant}: a variant name may use letters, digits, '_' and '-', "
                                  "and cannot be 'ensemble'")
            _build(Params, merged_variant(raw, variant), f"models.{variant}")
        return params
    except ParamsError as error:
        raise ParamsError(f"{source}: {error}") from None


def parse_section(cls: type, raw: Any, key: str, *, source: str = "params") -> Any:
    """One section (e.g. a ModelSpec from a saved model's config), validated like params.yaml."""
    try:
        return _build(cls, raw, key)
    except ParamsError as error:
        raise ParamsError(f"{source}: {error}") from None


def variant_params(raw_or_path: Any, variant: str) -> Params:
    """The params of one named variant: its overrides deep-merged over the shared sections."""
    raw = raw_or_path
    if isinstance(raw_or_path, (str, Path)):
        raw = yaml.safe_load(Path(raw_or_path).read_text(encoding="utf-8"))
    parse_params(raw)
    return _build(Params, merged_variant(raw, variant), f"models.{variant}")


def merged_variant(raw: dict, variant: str) -> dict:
    models = raw.get("models") or {}
    if variant not in models:
        raise ParamsError(f"unknown variant {variant!r}; models defines: {', '.join(models) or 'none'}")
    overrides = models[variant] or {}
    if not isinstance(overrides, dict):
        raise ParamsError(f"models.{variant}: expected a mapping of overrides, got {overrides!r}")
    for section in ("models", "tasks", "ensemble", "stats"):  # tokenize's tasks; what combines the variants
        if section in overrides:
            raise ParamsError(f"models.{variant}: a variant cannot override '{section}'")
    return deep_merge(raw, overrides)


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
    """Plain nested dict of a params dataclass, keyed as in params.yaml, e.g. to save beside a model."""
    if dataclasses.is_dataclass(params):
        return {_yaml_key(f): as_dict(getattr(params, f.name)) for f in dataclasses.fields(params)}
    if isinstance(params, dict):
        return {key: as_dict(value) for key, value in params.items()}
    if isinstance(params, list):
        return [as_dict(value) for value in params]
    return params


def _build(cls: type, raw: Any, key: str) -> Any:
    label = key or "the top level"
    if not isinstance(raw, dict):
        raise ParamsError(f"{label}: expected a mapping, got {type(raw).__name__}")
    fields = {_yaml_key(f): f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ParamsError(f"unknown key {_join(key, unknown[0])!r}; "
                          f"{label} accepts: {', '.join(fields)}")
    missing = [name for name, field in fields.items() if name not in raw and not field.metadata.get("optional")]
    if missing:
        raise ParamsError(f"missing key {_join(key, missing[0])!r}")
    values = {}
    for name, field in fields.items():
        full_key = _join(key, name)
        value = _convert(hints[field.name], raw[name], full_key) if name in raw else None
        _check_bounds(field.metadata, value, full_key)
        values[field.name] = value
    try:
        return cls(**values)
    except ParamsError as error:  # a rule across keys, raised by the dataclass itself
        raise ParamsError(_join(key, str(error))) from None


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [arg for arg in args if arg is not type(None)]
        if len(inner) == 1:
            return _convert(inner[0], value, key)
        errors = []
        for arg in inner:  # the first alternative the value fits
            try:
                return _convert(arg, value, key)
            except ParamsError as error:
                errors.append(str(error).removeprefix(f"{key}: expected ").split(", got ")[0])
        raise ParamsError(f"{key}: expected {' or '.join(errors)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ParamsError(f"{key}: expected one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ParamsError(f"{key}: expected a list, got {value!r}")
        return [_convert(args[0], item, f"{key}[{i}]") for i, item in enumerate(value)]
    if origin is dict or hint is dict:
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ParamsError(f"{key}: expected a mapping, got {value!r}")
        if not args:
            return value
        return {k: _convert(args[1], v, _join(key, str(k))) for k, v in value.items()}
    return _convert_scalar(hint, value, key)


def _convert_scalar(hint: type, value: Any, key: str) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            raise ParamsError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamsError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ParamsError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str) or not value:
            raise ParamsError(f"{key}: expected a non-empty string, got {value!r}")
        return value
    raise TypeError(f"params schema: unsupported type {hint!r} for {key}")


_COMPARISONS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"),
                "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def _check_bounds(metadata: typing.Mapping[str, Any], value: Any, key: str) -> None:
    if isinstance(value, dict):  # a per-task map: the bounds hold for each value
        for name, item in value.items():
            _check_bounds(metadata, item, _join(key, str(name)))
        return
    if value is None:
        return
    for name, (compare, symbol) in _COMPARISONS.items():
        bound = metadata.get(name)
        if bound is not None and not compare(value, bound):
            raise ParamsError(f"{key}: expected a value {symbol} {bound}, got {value!r}")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
