"""Ensembles per task over unrounded dev predictions: the uniform average of every candidate, or greedy
forward selection (Caruana et al. 2004).

Greedy starts from the best single candidate and repeatedly adds the one whose inclusion gives the best
criterion of the averaged predictions, as long as it improves or stays equal. The criterion is the task's
headline metric (`metric`, a step function of the predictions that small dev sets overfit) or a smooth
one (`smooth`: log-loss for classes, squared error for scores). The honest estimate chooses on one half
of dev and scores the headline metric on the other, both ways, and averages.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from mtbert.data.tasks import Task
from mtbert.deploy.members import average
from mtbert.evaluation.metrics import headline, task_metrics
from mtbert.evaluation.selection import best_epoch
from mtbert.params import EnsembleParams
from mtbert.params_file import with_changes


@dataclasses.dataclass
class Selection:
    members: list[str]  # in the order they were added, repeats allowed
    score: float  # the criterion of the average on the rows it was chosen on (higher is better)

    def counts(self) -> dict[str, int]:
        return {name: self.members.count(name) for name in dict.fromkeys(self.members)}


def criterion(task: Task, values: np.ndarray, labels: np.ndarray, kind: str) -> float:
    """Higher is better: the headline metric, or minus the smooth loss."""
    return headline(task, values, labels) if kind == "metric" else -task.kind.smooth_loss(values, labels)


def select(task: Task, predictions: dict[str, np.ndarray], labels: np.ndarray, options: EnsembleParams) -> Selection:
    """The members of the task's ensemble by options.method."""
    if options.method == "uniform":
        members = sorted(predictions)
        return Selection(members, criterion(task, average(predictions, members), labels, options.criterion))
    return greedy_select(task, predictions, labels, max_members=options.max_members,
                         with_replacement=options.with_replacement, kind=options.criterion)


def greedy_select(task: Task, predictions: dict[str, np.ndarray], labels: np.ndarray, *, max_members: int,
                  with_replacement: bool, kind: str = "metric") -> Selection:
    """predictions: model name -> values on the same rows as labels. Ties go to the earlier name.

    A candidate whose inclusion leaves the averaged predictions unchanged (a duplicate of the current
    ensemble) is never added: it could only pad the member list.
    """
    names = sorted(predictions)
    singles = {name: criterion(task, predictions[name], labels, kind) for name in names}
    first = max(names, key=lambda name: singles[name])
    selection = Selection([first], singles[first])
    while len(selection.members) < max_members:
        current = average(predictions, selection.members)
        scored = {}
        for name in names:
            if not with_replacement and name in selection.members:
                continue
            candidate = average(predictions, [*selection.members, name])
            if not np.allclose(candidate, current, rtol=0, atol=1e-12):
                scored[name] = criterion(task, candidate, labels, kind)
        if not scored:
            break
        best = max(scored, key=lambda name: scored[name])
        if scored[best] < selection.score:
            break
        selection = Selection([*selection.members, best], scored[best])
    return selection


def dev_halves(ids: np.ndarray) -> np.ndarray:
    """A fixed split of dev into two halves by a hash of the id: True for half B."""
    return np.array([hashlib.sha256(str(i).encode()).digest()[0] & 1 == 1 for i in ids])


def honest_estimate(task: Task, predictions: dict[str, np.ndarray], labels: np.ndarray, ids: np.ndarray,
                    options: EnsembleParams) -> dict:
    """Choose on one half of dev, score the headline metric on the other, both ways; the mean estimates
    what the ensemble method gives on unseen data."""
    half_b = dev_halves(ids)
    scores = []
    for select_on, score_on in ((~half_b, half_b), (half_b, ~half_b)):
        chosen = select(task, {n: v[select_on] for n, v in predictions.items()}, labels[select_on], options)
        scores.append(headline(task, average({n: v[score_on] for n, v in predictions.items()}, chosen.members),
                               labels[score_on]))
    return {"score": float(np.mean(scores)), "halves": [float(s) for s in scores],
            "half_sizes": [int((~half_b).sum()), int(half_b.sum())]}


def honest_epoch_choice(task: Task, epochs: list[np.ndarray], labels: np.ndarray, ids: np.ndarray) -> dict:
    """A single model's epoch choice for a task, estimated as the ensemble's choice is: the epoch with the
    best headline on one half of dev (ties to the earlier, as `train` breaks them), scored on the other,
    both ways. `epochs`: the task's dev predictions after each epoch, epoch 1 first (the snapshot dumps)."""
    half_b = dev_halves(ids)
    scores = []
    for select_on, score_on in ((~half_b, half_b), (half_b, ~half_b)):
        best = best_epoch([headline(task, values[select_on], labels[select_on]) for values in epochs])
        scores.append(headline(task, epochs[best - 1][score_on], labels[score_on]))
    return {"score": float(np.mean(scores)), "halves": [float(s) for s in scores]}


def method_name(options: EnsembleParams) -> str:
    """e.g. `greedy-smooth+snapshots`, `uniform`: how metrics/ensemble.json names a method."""
    name = "uniform" if options.method == "uniform" else f"greedy-{options.criterion}"
    return name + ("+snapshots" if options.snapshots else "")


def every_method(options: EnsembleParams) -> list[EnsembleParams]:
    """The methods the ensemble stage compares, with and without snapshots, on the params' other options."""
    methods = [("uniform", "metric"), ("greedy", "metric"), ("greedy", "smooth")]
    return [with_changes(options, method=method, criterion=kind, snapshots=snapshots)
            for snapshots in (False, True) for method, kind in methods]


@dataclasses.dataclass
class TaskEnsemble:
    """One task's ensemble as the `ensemble` stage writes it."""
    report: dict  # the task's section of metrics/ensemble.json
    dev_values: np.ndarray  # the average on dev, in the dev dumps' row order
    test_values: np.ndarray  # the same members' average on test, in the test candidates' row order
    methods: dict[str, float]  # every compared method's honest estimate (method_name -> score)


def ensemble_task(task: Task, dev: dict[bool, dict[str, np.ndarray]], labels: np.ndarray, dev_ids: np.ndarray,
                  test: dict[str, np.ndarray], options: EnsembleParams) -> TaskEnsemble:
    """Choose the task's members on dev by `options`, average them on dev and test, and estimate every
    method honestly. `dev[snapshots]`: the candidates' dev predictions without and with snapshots; `test`:
    the candidates' test predictions (with snapshots as `options` says)."""
    estimates = {method_name(method): honest_estimate(task, dev[method.snapshots], labels, dev_ids, method)
                 for method in every_method(options)}
    candidates = dev[options.snapshots]
    selection = select(task, candidates, labels, options)
    dev_values = average(candidates, selection.members)
    report = {**task_metrics(task, dev_values, labels), "members": selection.counts(),
              "order": selection.members,  # the average's summation order, to redo it exactly
              "single_best": {name: headline(task, dev[False][name], labels) for name in sorted(dev[False])},
              "honest": estimates[method_name(options)]}  # with its halves
    methods = {name: estimate["score"] for name, estimate in estimates.items()}
    return TaskEnsemble(report, dev_values, average(test, selection.members), methods)
