"""Greedy forward selection of ensemble members per task, on dev, over unrounded predictions.

Start from the best single model; repeatedly add the model whose inclusion gives the best dev metric
of the averaged predictions, as long as the metric improves or stays equal (Caruana et al. 2004).
The honest estimate selects on one half of dev and scores on the other, both ways, and averages.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from stages.core.data.tasks import Task
from stages.core.evaluation.metrics import headline


@dataclasses.dataclass
class Selection:
    members: list[str]  # in the order they were added, repeats allowed
    score: float  # dev headline metric of the average

    def counts(self) -> dict[str, int]:
        return {name: self.members.count(name) for name in dict.fromkeys(self.members)}


def average(predictions: dict[str, np.ndarray], members: list[str]) -> np.ndarray:
    return np.mean([predictions[name] for name in members], axis=0)


def greedy_select(task: Task, predictions: dict[str, np.ndarray], labels: np.ndarray, *, max_members: int,
                  with_replacement: bool) -> Selection:
    """predictions: model name -> values on the same rows as labels. Ties go to the earlier name.

    A candidate whose inclusion leaves the averaged predictions unchanged (a duplicate of the current
    ensemble) is never added: it could only pad the member list.
    """
    names = sorted(predictions)
    singles = {name: headline(task, predictions[name], labels) for name in names}
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
                scored[name] = headline(task, candidate, labels)
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


def honest_estimate(task: Task, predictions: dict[str, np.ndarray], labels: np.ndarray, ids: np.ndarray, *,
                    max_members: int, with_replacement: bool) -> dict:
    """Select on one half of dev, score on the other, both ways; the mean is an unbiased-ish estimate."""
    half_b = dev_halves(ids)
    scores = []
    for select_on, score_on in ((~half_b, half_b), (half_b, ~half_b)):
        chosen = greedy_select(task, {n: v[select_on] for n, v in predictions.items()}, labels[select_on],
                               max_members=max_members, with_replacement=with_replacement)
        scores.append(headline(task, average({n: v[score_on] for n, v in predictions.items()}, chosen.members),
                               labels[score_on]))
    return {"score": float(np.mean(scores)), "halves": [float(s) for s in scores],
            "half_sizes": [int((~half_b).sum()), int(half_b.sum())]}
