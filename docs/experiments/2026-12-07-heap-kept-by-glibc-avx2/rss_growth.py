"""RSS, its peak and glibc's heap through a run's steps: is the growth memory in use or freed heap kept?

    PYTHONPATH=<repo> python rss_growth.py VARIANT STEPS EVERY TOKENIZED_DIR
env: PROBE_TRIM_EVERY=k (malloc_trim(0) after every k-th step), PROBE_MALLOC_MB, PROBE_PAD (cpu pad multiple)
"""
import ctypes
import json
import os
import sys
import time
from pathlib import Path

from bench.common import scratch_run
from mtbert.evaluation.evaluate import evaluate
from mtbert.params_file import variant_params, with_changes
from mtbert.runtime import release_heap, setup_logging
from mtbert.training import build
from mtbert.training.step import step


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2


def status(key):
    return int([line for line in open("/proc/self/status") if line.startswith(key)][0].split()[1]) / 2**20


def sample(label):
    info = libc.mallinfo2()
    print(json.dumps({"at": label, "rss_gib": round(status("VmRSS"), 3), "peak_gib": round(status("VmHWM"), 3),
                      "heap_in_use_gib": round(info.uordblks / 2**30, 3),
                      "heap_free_gib": round(info.fordblks / 2**30, 3), "mmapped_gib": round(info.hblkhd / 2**30, 3),
                      "arena_gib": round(info.arena / 2**30, 3)}), flush=True)


variant, steps, every, tokenized = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
trim_every = int(os.environ.get("PROBE_TRIM_EVERY", "0"))
setup_logging("WARNING")
params = variant_params(Path("params.yaml"), variant)
runtime = params.runtime
if "PROBE_MALLOC_MB" in os.environ:
    runtime = with_changes(runtime, malloc_threshold_mb=int(os.environ["PROBE_MALLOC_MB"]))
if "PROBE_PAD" in os.environ:
    runtime = with_changes(runtime, pad_to_multiple=with_changes(runtime.pad_to_multiple,
                                                                 cpu=int(os.environ["PROBE_PAD"])))
params = params.model_copy(update={"runtime": runtime})
print(json.dumps({"trim_every": trim_every, "malloc_mb": runtime.malloc_threshold_mb,
                  "pad_cpu": runtime.pad_to_multiple.cpu}), flush=True)
# kept: the next probe reuses the frozen states
scratch = Path(os.environ.get("PROBE_SCRATCH", f"/tmp/probe-{variant}"))
run, progress = scratch_run(params, variant, tokenized, scratch)
release_heap()
open("/proc/self/clear_refs", "w").write("5")  # the peak from here: the steps' alone
sample("built")
schedule = build.schedule(run, 0)[:steps]
run.model.train()
start = time.perf_counter()
for index, tasks in enumerate(schedule, 1):
    step(run, progress, tasks, ends_update=True)
    if trim_every and index % trim_every == 0:
        libc.malloc_trim(0)
    if index % every == 0:
        run.finite.check()
        sample(f"step {index} ({(time.perf_counter() - start) / index:.3f} s/step)")
release_heap()
sample("after trim")
if os.environ.get("PROBE_DEV") == "1":  # the dev pass after the trim, its peak alone
    open("/proc/self/clear_refs", "w").write("5")
    start = time.perf_counter()
    evaluate(run.model, run.dev_data, run.train.eval_batch_size, run.device, run.bf16)
    sample(f"dev pass ({time.perf_counter() - start:.1f} s)")
    release_heap()
    sample("after trim")
