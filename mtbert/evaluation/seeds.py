"""Seed statistics: is a difference between two configurations more than seed noise and dev-set noise?

Variants whose params differ only in `train.seed` form a group (named after its first variant). Per
group and task, each dev metric's mean, sample std, min and max over the seeds. Per pair of groups, the
difference of the seed-averaged headline metrics with a paired bootstrap confidence interval: the dev
rows are resampled with replacement, every model of both groups is scored on the same resample, and the
percentiles of the resampled differences bound the difference.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mtbert.data.tasks import Task
from mtbert.evaluation.candidates import epoch_folders
from mtbert.evaluation.ensemble import honest_epoch_choice
from mtbert.evaluation.metrics import headline
from mtbert.evaluation.predictions import read_aligned
from mtbert.params import Params
from mtbert.params_file import variant_params
from mtbert.runtime import MissingInputError
from mtbert.variants import merged_variant

# Params that decide how fast a variant runs or how others are combined, not what the variant computes.
NOT_CONFIGURATION = ("models", "runtime", "ensemble", "stats")


def seed_groups(raw_params: dict) -> dict[str, list[str]]:
    """Group name (its first variant in params order) -> the variants that differ from it only in seed."""
    groups: dict[str, list[str]] = {}
    first_of: dict[str, str] = {}
    for variant in raw_params["models"]:
        merged = merged_variant(raw_params, variant)
        configuration = {key: value for key, value in merged.items() if key not in NOT_CONFIGURATION}
        configuration["train"] = {key: value for key, value in merged["train"].items() if key != "seed"}
        key = json.dumps(configuration, sort_keys=True)
        groups.setdefault(first_of.setdefault(key, variant), []).append(variant)
    return groups


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one seed), min and max."""
    array = np.asarray(values, dtype=np.float64)
    return {"mean": float(array.mean()), "std": float(array.std(ddof=1)) if len(array) > 1 else 0.0,
            "min": float(array.min()), "max": float(array.max())}


def group_statistics(per_variant: list[dict], tasks: dict[str, Task]) -> dict:
    """per_variant: each seed's {task: {metric: value}, 'overall': value} -> the same keys, each a spread."""
    statistics: dict = {name: {metric: spread([variant[name][metric] for variant in per_variant])
                               for metric in per_variant[0][name]} for name in tasks}
    statistics["overall"] = spread([variant["overall"] for variant in per_variant])
    return statistics


def bootstrap_replicates(task: Task, group_a: list[np.ndarray], group_b: list[np.ndarray], labels: np.ndarray,
                         resamples: int, rng: np.random.Generator) -> np.ndarray:
    """The seed-averaged headline difference A - B on `resamples` resamples of the dev rows."""
    replicates = np.empty(resamples)
    for index in range(resamples):
        rows = rng.integers(0, len(labels), len(labels))
        replicates[index] = seed_mean_difference(task, [v[rows] for v in group_a], [v[rows] for v in group_b],
                                                 labels[rows])
    return replicates


def seed_mean_difference(task: Task, group_a: list[np.ndarray], group_b: list[np.ndarray],
                         labels: np.ndarray) -> float:
    return float(np.mean([headline(task, v, labels) for v in group_a])
                 - np.mean([headline(task, v, labels) for v in group_b]))


def interval(difference: float, replicates: np.ndarray, confidence: float) -> dict:
    """The difference, its percentile interval, and whether the interval excludes 0."""
    low, high = np.percentile(replicates, [50 * (1 - confidence), 50 * (1 + confidence)])
    return {"difference": difference, "low": float(low), "high": float(high),
            "excludes_zero": bool(low > 0 or high < 0)}


def compare_groups(tasks: dict[str, Task], group_a: dict[str, list[np.ndarray]], group_b: dict[str, list[np.ndarray]],
                   labels: dict[str, np.ndarray], *, resamples: int, confidence: float, seed: int = 0) -> dict:
    """Per task and overall: A's seed-mean headline minus B's, with a paired bootstrap interval.

    group_*: task -> the dev predictions of each of the group's seeds. The overall replicates average the
    tasks' replicates (each task's dev set resampled on its own).
    """
    rng = np.random.default_rng(seed)
    result, all_replicates, differences = {}, [], []
    for name, task in tasks.items():
        difference = seed_mean_difference(task, group_a[name], group_b[name], labels[name])
        replicates = bootstrap_replicates(task, group_a[name], group_b[name], labels[name], resamples, rng)
        result[name] = interval(difference, replicates, confidence)
        all_replicates.append(replicates)
        differences.append(difference)
    result["overall"] = interval(float(np.mean(differences)), np.mean(all_replicates, axis=0), confidence)
    return result


# --- the groups of stage `stats` ---------------------------------------------------------------------------
def honest_group(variants: list[str], snapshots_dir: Path, dev_splits: dict, tasks: dict) -> dict:
    """The group's per-task epoch choice estimated honestly (mtbert/evaluation/ensemble.py
    `honest_epoch_choice`) from each variant's every-epoch dev dumps: mean ± std over the seeds of each
    task's headline and of their overall mean."""
    per_variant = []
    for variant in variants:
        folders = epoch_folders(snapshots_dir / variant)
        if not folders:
            raise MissingInputError(f"{snapshots_dir / variant} has no epoch-<E> dumps; run `dvc repro` for "
                                    f"the stage that trains {variant} (train@{variant} or distill@{variant})")
        scores = {name: honest_epoch_choice(task, [read_aligned(folder, task, "dev", dev_splits[name].ids)
                                                   for folder in folders], dev_splits[name].labels,
                                            dev_splits[name].ids)["score"] for name, task in tasks.items()}
        per_variant.append({**scores, "overall": float(np.mean(list(scores.values())))})
    return {name: spread([scores[name] for scores in per_variant]) for name in [*tasks, "overall"]}


def student_groups(params: Params) -> dict[str, list[str]]:
    """The distilled students as one seed group, named after the first; none with distill.enabled false."""
    students = list(params.distill.students) if params.distill.enabled else []
    return {students[0]: students} if students else {}


def seed_of(params_file: Path, params: Params, name: str) -> int:
    """The train.seed of a variant or a distilled student."""
    if params.distill.enabled and name in params.distill.students:
        return params.distill.students[name]
    return variant_params(params_file, name).train.seed
