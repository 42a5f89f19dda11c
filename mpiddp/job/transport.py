"""MPI as the gradient transport of your own DDP model: `ddp.register_comm_hook(*mpiddp.comm_hook())`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpiddp.job.collective import Dist

if TYPE_CHECKING:
    from mpiddp.job.compression import GradientHook

HOOK_COMPRESSIONS = ("none", "fp16", "bf16")


def comm_hook(dist: Dist | None = None, compression: str = "none") -> tuple[GradientHook, Callable[..., Any]]:
    """(state, hook) for `DistributedDataParallel.register_comm_hook`: every gradient bucket is all-reduced by
    one MPI_Allreduce instead of the process group (gloo), averaged as DDP's own hook does; `compression`
    "fp16" or "bf16" sends half the bytes. `dist`: `mpiddp.init()`'s, or by default the job's own (under
    `python -m mpiddp run`, or after `mpiddp.init()`). CPU tensors; GPU tensors only with a CUDA-aware MPI
    started at a thread level that lets autograd's GPU thread call it (the hook raises otherwise, saying so)."""
    from mpiddp.job.collective import current
    from mpiddp.job.compression import GradientHook, _run

    if compression not in HOOK_COMPRESSIONS:
        raise ValueError(f"compression must be one of {', '.join(HOOK_COMPRESSIONS)}, got {compression!r}")
    if dist is None:
        dist = current()
    if dist is None:
        raise RuntimeError("mpiddp.comm_hook() needs mpiddp's job: run the script under `python -m mpiddp run`, "
                           "or call mpiddp.init() first (or pass its Dist)")
    import torch.distributed as tdist

    if tdist.is_initialized() and tdist.get_world_size() != dist.world_size:
        raise RuntimeError(f"mpiddp.comm_hook(): torch's process group has {tdist.get_world_size()} ranks and "
                           f"MPI's world {dist.world_size}: the hook needs the same ranks in both")
    return GradientHook(compression, [], lambda: None, mpi=dist), _run
