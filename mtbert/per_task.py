"""What params.yaml says per task, beyond a field's type and bounds: mtbert/params.py attaches these as its
validators, and imports them (they import nothing from it).

- `every_task`: a per-task knob (`PER_TASK_KNOBS`) written as one value for every task, or as {task: value}
  for some, the others getting the knob's default;
- `check_task_names` and `task_fits_its_kind`: a task's name, and its columns, classes, range and metric
  against its kind (`KIND_METRICS`);
- `resolve_heads`: every task's head, with the defaults its shape takes filled in (a pair's encoding and
  combine, a regression's target, a routing head's sizes) and the keys it cannot take refused.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationInfo

NAME = re.compile(r"[A-Za-z0-9_-]+")  # what task, variant and student names may use
PER_TASK_KNOBS = {"train": ("task_lr_mult", "batch_size", "max_train_examples"), "smart": ("task_lambda",)}
KIND_METRICS = {"classification": ("accuracy", "macro_f1"), "binary": ("accuracy", "f1"),
                "regression": ("pearson", "spearman")}
# A routing head's sizes unless set: 4 vectors of 64 (256 features into the output layer, against the 384 of
# a pooled MiniLM vector), and the reference implementation's 2 iterations.
ROUTING_DEFAULTS = {"routing_vectors": 4, "routing_dim": 64, "routing_iters": 2}


def every_task(cls, value: Any, info: ValidationInfo) -> Any:
    """A per-task knob as {task: value} for every task, in task order: a scalar is every task's value; a
    mapping sets the tasks it names, and the others get the knob's default. The tasks come from the context
    that parse_section passes."""
    tasks = (info.context or {}).get("tasks")
    if tasks is None:  # a section validated on its own (with_changes): its mapping is already resolved
        return value
    if not isinstance(value, dict):
        return dict.fromkeys(tasks, value)
    for name in value:
        if name not in tasks:
            raise ValueError(f"{name}: unknown task; tasks declares {', '.join(tasks)}")
    return {task: value.get(task, cls.model_fields[info.field_name].default) for task in tasks}


def check_task_names(tasks: dict) -> dict:
    """At least one task, each named with letters, digits, '_' and '-'."""
    if not tasks:
        raise ValueError(": expected at least one task declaration")
    for name in tasks:
        if not NAME.fullmatch(name):
            raise ValueError(f"{name}: a task name may use letters, digits, '_' and '-'")
    return tasks


def task_fits_its_kind(task):
    """A TaskParams whose columns, classes, range and metric fit its kind; the first misfit fails."""
    if len(task.text) not in (1, 2) or len(set(task.text)) != len(task.text):
        raise ValueError(f"text: expected one column or two distinct ones, got {task.text!r}")
    if (task.kind == "classification") != (task.classes is not None):
        raise ValueError(f"classes: expected for kind classification only, got {task.classes!r} with kind "
                         f"{task.kind}")
    if task.kind == "regression":
        if task.range is None or len(task.range) != 2 or not task.range[0] < task.range[1]:
            raise ValueError(f"range: kind regression expects [lowest, highest], got {task.range!r}")
    elif task.range is not None:
        raise ValueError(f"range: expected for kind regression only, got {task.range!r}")
    if task.metric not in KIND_METRICS[task.kind]:
        raise ValueError(f"metric: kind {task.kind} offers {', '.join(KIND_METRICS[task.kind])}, "
                         f"got {task.metric!r}")
    return task


def resolve_heads(tasks: dict, heads: dict, default_head, *, every: bool = False) -> dict:
    """Every task's head (a HeadParams), in task order, with the defaults its text and kind take filled in; a
    key the task cannot take fails. A task without a head gets `default_head`, or with `every` fails. A
    ValueError names `<task>.<option>`."""
    for name in heads:
        if name not in tasks:
            raise ValueError(f"{name}: unknown task; tasks declares {', '.join(tasks)}")
    missing = [name for name in tasks if name not in heads]
    if every and missing:
        raise ValueError(f"{missing[0]}: missing; a saved model names every task's head")
    resolved = {}
    for name, task in tasks.items():
        head = heads.get(name, default_head)
        pair, regression = len(task.text) == 2, task.kind == "regression"
        for option in ("encoding", "combine"):
            if not pair and getattr(head, option) is not None:
                raise ValueError(f"{name}.{option}: task {name} has one sentence, so it takes no {option}")
        if not regression and head.target is not None:
            raise ValueError(f"{name}.target: expected for regression tasks only (task {name} is {task.kind}), "
                             f"got {head.target!r}")
        head = head.model_copy(update={"encoding": head.encoding or ("cross" if pair else None),
                                       "combine": head.combine or ("features" if pair else None),
                                       "target": head.target or ("raw" if regression else None)})
        if head.is_bi and head.combine == "cosine" and task.kind == "classification":
            raise ValueError(f"{name}.combine: cosine gives one score, but task {name} has {task.classes} "
                             "classes; use features")
        if head.pooling == "routing":
            head = head.model_copy(update={option: getattr(head, option) or default
                                           for option, default in ROUTING_DEFAULTS.items()})
        else:
            for option in ROUTING_DEFAULTS:
                if getattr(head, option) is not None:
                    raise ValueError(f"{name}.{option}: expected with pooling: routing only, got pooling: "
                                     f"{head.pooling}")
        resolved[name] = head
    return resolved
