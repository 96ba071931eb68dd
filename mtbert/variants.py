"""A variant's overrides merged over the shared sections of params.yaml, on the raw YAML (mtbert/params_file.py
validates the result). Nested mappings merge key by key; a per-task knob that the shared params give as one
value and a variant as {task: value} changes only the tasks the variant names. A variant may not override
what combines the variants (`models`, `tasks`, `data`, `ensemble`, `distill`, `stats`), nor null a shared
mapping. It may change its encoder (`model.name`): it has its own tokenized data and pretraining.
"""

from __future__ import annotations

from mtbert.params import ParamsError
from mtbert.per_task import PER_TASK_KNOBS


def merged_variant(raw: dict, variant: str) -> dict:
    models = raw.get("models") or {}
    if variant not in models:
        raise ParamsError(f"unknown variant {variant!r}; models defines: {', '.join(models) or 'none'}")
    overrides = models[variant] or {}
    if not isinstance(overrides, dict):
        raise ParamsError(f"models.{variant}: expected a mapping of overrides, got {overrides!r}")
    for name in ("models", "tasks", "data", "ensemble", "distill", "stats"):  # the rows they share; what combines them
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
    for section, knobs in PER_TASK_KNOBS.items():
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
