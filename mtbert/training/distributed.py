"""Data parallelism across processes started by torchrun: one rank per process, gloo on CPU, nccl on GPU.

Every rank builds the same global batch (same seeds, same task at every step) and takes its own
interleaved share of the rows, so ranks see disjoint examples and all-reduces never wait on a rank
that took another task. Gradients are averaged with one all-reduce of a flat buffer per optimiser
step, after backward and before clipping.

Why not torch's DistributedDataParallel wrapper: SMART and the Bregman teacher run several forward
passes of the same module before one backward (one of them differentiated with respect to the input
only), which DDP's reducer does not allow; averaging the finished gradients is what DDP computes,
minus its overlap of communication with the backward pass.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist

from mtbert.runtime import setup_torch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Only the main rank writes checkpoints, metrics, curves and models."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def die_with_launcher() -> None:
    """End this worker when torchrun ends. torchrun starts each worker in a session of its own, so a
    SIGKILL of the job's process group (or of torchrun alone) would leave the workers training on, writing
    into the checkpoints a resumed run reads."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != int(os.environ.get("MTBERT_LAUNCHER_PID", os.getppid())):
        os._exit(1)  # the launcher died before the signal was armed


def init_ranks() -> Ranks:
    """This process's place among torchrun's processes (a single rank when not under torchrun)."""
    if not under_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return Ranks()
    die_with_launcher()
    ranks = Ranks(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                  local_rank=int(os.environ["LOCAL_RANK"]),
                  local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(ranks.local_rank)
        dist.init_process_group(backend)
        log.info("rank %d of %d (%s backend)", ranks.rank, ranks.world_size, backend)
    return ranks


def device_for(ranks: Ranks) -> torch.device:
    return torch.device(f"cuda:{ranks.local_rank}") if torch.cuda.is_available() else torch.device("cpu")


def setup_process(seed: int, threads: int) -> tuple[Ranks, torch.device]:
    """This process's rank (joining torchrun's group if there is one), seeded torch, and its device."""
    ranks = init_ranks()
    device = setup_torch(seed, threads_per_rank(threads, ranks))
    return ranks, device_for(ranks) if ranks.distributed else device


def threads_per_rank(threads: int, ranks: Ranks) -> int:
    """CPU threads for one rank: the configured total shared among this machine's ranks (0 keeps torch's)."""
    return max(1, threads // ranks.local_world_size) if threads else 0


def shard(rows: np.ndarray, ranks: Ranks) -> np.ndarray:
    """This rank's rows of a global batch: every world_size-th row, starting at its rank."""
    return rows[ranks.rank::ranks.world_size]


def average_gradients(parameters: list[torch.nn.Parameter], ranks: Ranks) -> None:
    """Sum every rank's .grad and divide by the number of ranks, in one flat all-reduce.

    A parameter no rank has a gradient for keeps .grad None, so the optimiser skips it as it would in
    one process (a zero gradient would still move it through Adam's momentum and weight decay); one
    that only some ranks have (a rank with no rows this step) counts as zeros on the others.
    """
    if not ranks.distributed:
        return
    device = parameters[0].device
    has_grad = torch.tensor([p.grad is not None for p in parameters], dtype=torch.uint8, device=device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
    reduced = [p for p, flag in zip(parameters, has_grad.tolist(), strict=True) if flag]
    if not reduced:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in reduced]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= ranks.world_size
    offset = 0
    for parameter in reduced:
        parameter.grad = flat[offset:offset + parameter.numel()].view_as(parameter).clone()
        offset += parameter.numel()


def average_tensor(tensor: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    if ranks.distributed:
        dist.all_reduce(tensor)
        tensor /= ranks.world_size
    return tensor


def broadcast(value, ranks: Ranks):
    """The main rank's `value` on every rank (any picklable object)."""
    if not ranks.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value, ranks: Ranks) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if not ranks.distributed:
        return [value]
    values = [None] * ranks.world_size
    dist.all_gather_object(values, value)
    return values


def sync_parameters(module: torch.nn.Module, ranks: Ranks) -> None:
    """Start every rank from the main rank's weights (fresh heads are random)."""
    if ranks.distributed:
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)


def barrier(ranks: Ranks) -> None:
    if ranks.distributed:
        dist.barrier()


def shutdown(ranks: Ranks) -> None:
    if ranks.distributed and dist.is_initialized():
        dist.destroy_process_group()


def relaunch_with_torchrun(nproc: int, module: str, argv: list[str]) -> None:
    """Replace this process by `torchrun --standalone --nproc_per_node nproc -m module argv` (one machine)."""
    torchrun = shutil.which("torchrun") or ""
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    command += ["--standalone", f"--nproc_per_node={nproc}", "-m", module, *argv]
    log.info("train.nproc is %d: relaunching as %s", nproc, " ".join(command))
    os.environ["MTBERT_LAUNCHER_PID"] = str(os.getpid())  # execv keeps the pid: torchrun's, the workers' parent
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)
