"""Fine-tuning runs set up as the `train` stage sets them up, for tests that look inside the loop."""

from __future__ import annotations

import dataclasses

from mtbert.params import Params
from mtbert.training import finetune
from mtbert.training.loop import Paths
from stages.train import setup


@dataclasses.dataclass
class Run:
    """A prepared run with its progress; `train()` takes it to the end."""
    run: finetune.FineTuning
    progress: finetune.Progress

    def train(self) -> dict:
        return finetune.train(self.run, self.progress)


def prepared(params: Params, paths: Paths, variant: str = "base") -> Run:
    return Run(*setup(params, variant, paths))
