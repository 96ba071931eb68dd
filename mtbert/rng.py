"""The run's random streams, by name.

torch's global generator, seeded with the run's seed, draws the heads' starting weights and the dropout
masks, in the order the forward pass needs them (so a resumed run restores its state). The numpy streams
below are seeded with [seed, stream, position...]: a stream of its own, so that drawing more from one never
shifts another, and a position (an epoch, a step) that a resumed run passes again. Others keep their own
seeding beside them: each task's batch stream ([seed, the task's index, the pass], data/sampling.py), the
transfer set ([seed, the task name's CRC], data/transfer.py), masked-LM's masking generator and SMART's
noise generator (torch generators of their own, restored on resume).
"""

from __future__ import annotations

import numpy as np

TASK_ORDER = 7919  # the order of an epoch's task batches (mtbert/data/sampling.py)
PCGRAD_ORDER = 4099  # the order PCGrad projects a task onto the others (mtbert/training/pcgrad.py)
HELD_OUT_SENTENCES = 31  # masked-LM pretraining's held-out dev sentences (mtbert/training/masked_lm.py)


def generator(seed: int, stream: int, *position: int) -> np.random.Generator:
    """The numpy generator of `stream` at `position`, for the run seeded with `seed`."""
    return np.random.default_rng([seed, stream, *position])
