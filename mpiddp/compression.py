"""Gradient communication: DDP's built-in communication hooks (fp16/bf16 compression, PowerSGD).

PowerSGD's error feedback is not saved in snapshots: it is kept per DDP bucket, in the bucket's memory layout,
and a resumed job's first step runs on DDP's initial buckets (it rebuilds them after that step), so a restored
error tensor would land on the wrong gradients. A resumed PowerSGD run starts its error feedback afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


def one_bucket_at_a_time(hook: Callable[[Any, Any], torch.futures.Future]) -> Callable[[Any, Any], torch.futures.Future]:
    """PowerSGD starts its second all-reduce from a callback of the first; with several buckets in flight,
    ranks can issue those in different orders, which gloo (matching collectives by order) cannot survive
    ("Received data size doesn't match expected size"). Finishing each bucket before the next keeps the
    order the same on every rank; on CPU the overlap it gives up is small."""

    def run(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks hook annotations: real classes or none
        done = torch.futures.Future()
        done.set_result(hook(state, bucket).wait())
        return done

    return run


def register(ddp: DistributedDataParallel, compression: str, rank: int = 1, warmup_steps: int = 10,
             backend: str = "nccl") -> Any:
    """Install the communication hook for `compression` on `ddp`; the PowerSGD state (None for the others)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if compression == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif compression == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif compression == "powersgd":
        # Plain all-reduce for the first `warmup_steps` steps, then rank-`rank` approximations with error
        # feedback (what the approximation missed is added to the next step's gradient) and warm start.
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=warmup_steps,
            use_error_feedback=True, warm_start=True, random_seed=0,
        )
        hook = powerSGD_hook.powerSGD_hook if backend == "nccl" else one_bucket_at_a_time(powerSGD_hook.powerSGD_hook)
        ddp.register_comm_hook(state, hook)
        return state
    return None
