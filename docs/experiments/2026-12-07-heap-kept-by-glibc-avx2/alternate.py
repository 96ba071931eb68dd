"""Seconds per step under glibc mmap thresholds switched in turn, block by block, in one process
(mallopt applies from the next allocation), so a slow spell of the machine hits every arm alike.

    PYTHONPATH=<repo> python alternate.py VARIANT TOKENIZED_DIR ROUNDS BLOCK MB [MB ...]
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.common import scratch_run
from mtbert.params_file import variant_params
from mtbert.runtime import limit_memory_growth, setup_logging
from mtbert.training import build
from mtbert.training.step import compute, next_pieces

variant, tokenized, rounds, block = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
arms = [int(mb) for mb in sys.argv[5:]]
setup_logging("WARNING")
params = variant_params(Path("params.yaml"), variant)
run, progress = scratch_run(params, variant, tokenized, Path(os.environ.get("PROBE_SCRATCH", f"/tmp/probe-{variant}")))
schedule = [tasks for epoch in range(3) for tasks in build.schedule(run, epoch)]
run.model.train()
steps = iter(schedule)


def timed_block(mb: int, blocks: list) -> float:
    """The same steps' pieces (batches drawn once) computed under each threshold."""
    limit_memory_growth(0, mb)  # both of glibc's thresholds, as the stages set them
    start = time.perf_counter()
    for pieces in blocks:
        compute(run, progress, pieces, True)
    run.finite.check()
    return (time.perf_counter() - start) / block


def draw() -> list:
    return [next_pieces(run, next(steps)) for _ in range(block)]


warm = draw()
for mb in arms:  # warm-up, untimed
    timed_block(mb, warm)
times = {mb: [] for mb in arms}
for round_ in range(rounds):
    blocks = draw()
    for mb in (arms if round_ % 2 == 0 else arms[::-1]):
        times[mb].append(timed_block(mb, blocks))
base = arms[0]
ratios = {mb: [a / b for a, b in zip(times[mb], times[base], strict=True)] for mb in arms[1:]}  # per round
print(json.dumps({"variant": variant, "block": block, "rounds": rounds,
                  **{f"{mb} MB s/step": round(statistics.mean(t), 4) for mb, t in times.items()},
                  **{f"{mb} MB / {base} MB": round(statistics.mean(r), 3) for mb, r in ratios.items()},
                  "per round": {mb: [round(x, 3) for x in t] for mb, t in times.items()}}), flush=True)
