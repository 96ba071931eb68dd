"""The weights after N training steps under a glibc threshold: a sha256 over every tensor's bytes.

    PYTHONPATH=<repo> python same_weights.py VARIANT TOKENIZED_DIR STEPS MB
"""
import hashlib
import sys
import tempfile
from pathlib import Path

from bench.common import scratch_run
from mtbert.params_file import variant_params, with_changes
from mtbert.runtime import setup_logging
from mtbert.training import build
from mtbert.training.step import step

variant, tokenized, steps, mb = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
setup_logging("WARNING")
params = variant_params(Path("params.yaml"), variant)
params = params.model_copy(update={"runtime": with_changes(params.runtime, malloc_threshold_mb=mb)})
with tempfile.TemporaryDirectory() as scratch:
    run, progress = scratch_run(params, variant, tokenized, Path(scratch))
    run.model.train()
    for tasks in build.schedule(run, 0)[:steps]:
        step(run, progress, tasks, ends_update=True)
    digest = hashlib.sha256()
    for name, tensor in sorted(run.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    print(f"{variant} {steps} steps, {mb} MB: {digest.hexdigest()}")
