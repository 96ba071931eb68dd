"""Process-wide setup shared by the stage commands."""

from __future__ import annotations

import gc
import logging
import math
import os
import sys
from pathlib import Path


class UserError(Exception):
    """Bad params, data or model folder: the message names the file, row or key and what was expected.

    A stage run through `run_app` prints it as one line and exits 1; MTBERT_DEBUG=1 shows the traceback.
    """


class MissingInputError(UserError, FileNotFoundError):
    """A stage's input file is not there (an earlier stage has not run)."""


class UnreadableInputError(UserError, ValueError):
    """A stage's input file is there but cut short, damaged or not what the stage that writes it writes."""


def run_app(app) -> None:
    """Run a stage's typer app, turning a UserError or an OSError into one line on stderr and exit status 1."""
    try:
        app()
    except (UserError, OSError) as error:
        if os.environ.get("MTBERT_DEBUG"):
            raise
        print(f"error: {error if isinstance(error, UserError) else os_error_line(error)}", file=sys.stderr)
        sys.exit(1)


def os_error_line(error: OSError) -> str:
    """An OSError a user can cause (a path that cannot be written or read, a full disk, a port in use) in one
    line naming the file."""
    where = f"{error.filename}: " if error.filename else ""
    return " ".join(f"{where}{error.strerror or error}".split())


def setup_logging(level: str | None = None) -> None:
    """Timestamped log lines on stderr, so a long stage always says what it is doing."""
    logging.basicConfig(level=level or os.environ.get("MTBERT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def limit_memory_growth(onednn_cache: int, malloc_threshold_mb: int) -> None:
    """Cap what grows with the number of distinct batch shapes (docs/performance.md): oneDNN's cache of
    kernels built per shape, and glibc's heap, which keeps freed activation buffers of every size instead
    of handing them back. 0 leaves either as it is. Call before the first oneDNN kernel runs (it reads
    the capacity once)."""
    if onednn_cache:
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(onednn_cache)
    if malloc_threshold_mb and sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        size = malloc_threshold_mb * 2 ** 20
        # blocks above `size` get their own mapping, returned on free; free heap above it is trimmed
        for parameter in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD):
            if libc.mallopt(parameter, size) != 1:
                raise UserError(f"runtime.malloc_threshold_mb: glibc's mallopt refused {malloc_threshold_mb} MB; "
                                "expected a size it accepts, or 0 to leave glibc's default")


def graph_heap_mb(model_dirs: list[Path], floor_mb: int) -> int:
    """glibc's mmap threshold for a stage that exports the models in `model_dirs`: twice their largest weights
    file, or `floor_mb` (runtime.malloc_threshold_mb) if larger. An export copies the whole graph, about one
    encoder's weights, dozens of times (the exporter, the fusions' shape inference, int8). Above the threshold
    each copy gets its own mapping, returned on free, so the next one faults in fresh zeroed pages
    (docs/performance.md, the memory knobs)."""
    sizes = [path.stat().st_size for folder in model_dirs for path in folder.rglob("*.safetensors")]
    return max(floor_mb, math.ceil(2 * max(sizes, default=0) / 2 ** 20))


def release_heap() -> None:
    """Free what unreachable cycles hold, then hand glibc's free heap pages back to the system, so that the
    next phase of a stage starts from what is still in use (a no-op for the pages off Linux)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_rss_gib() -> float:
    """This process's peak resident memory, in GiB. On Linux it is VmHWM, which counts from the process's
    own start: getrusage's ru_maxrss also holds the parent's resident memory at fork, carried across exec,
    so a child reads at least its parent's size at fork, whatever it does (docs/performance.md, figure 6)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2 ** 20  # kB
    except OSError:
        pass  # not Linux: the inherited part is the lesser evil
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2 ** 30 if sys.platform == "darwin" else peak / 2 ** 20  # bytes on macOS, KiB elsewhere


def use_bf16(setting: bool | str, device) -> bool:
    """Whether to run bf16 autocast: `true`/`false` as set; `auto` where the device computes bf16 natively
    (a GPU with bf16, a CPU with AVX512-BF16 or AMX). Emulated (a CPU without bf16 units), bf16 is many
    times slower than fp32 (docs/performance.md)."""
    import torch

    if setting != "auto":
        return bool(setting)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def setup_torch(seed: int, threads: int):
    """Seed torch, set CPU threads (0 keeps torch's default) and pick the device."""
    import torch

    torch.manual_seed(seed)
    if threads:
        torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def open_live(live_dir, history: list[dict], log_record) -> object:
    """A fresh DVCLive folder with `history` replayed through `log_record`, so a resumed run logs each
    point once (DVCLive's own resume would append to what a killed run already wrote)."""
    import shutil

    from dvclive import Live

    shutil.rmtree(live_dir, ignore_errors=True)
    live = Live(dir=str(live_dir), resume=False, report=None, save_dvc_exp=False, dvcyaml=None)
    for record in history:
        log_record(live, record)
    return live
