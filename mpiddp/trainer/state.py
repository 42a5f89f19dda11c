"""What training changes: the model (plain, DDP-wrapped, maybe compiled), optimizer, schedule, scaler, counters."""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mpiddp.errors import UserError
from mpiddp.job import compression
from mpiddp.job.collective import Dist
from mpiddp.trainer.config import Config, TrainingSettings

if TYPE_CHECKING:
    from mpiddp.trainer.commit import StepCommit

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Everything a snapshot holds, plus the wrapped model the loop runs."""

    model: nn.Module  # what forward() is called on: DDP, possibly compiled
    ddp: DistributedDataParallel  # for no_sync()
    unwrapped: nn.Module  # the plain model: evaluation and state_dict
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    gradient_hook: compression.GradientHook | None = None  # the all-reduce: PowerSGD's state, the clock's signal
    commit: StepCommit | None = None  # when the optimizer step may use the step's gradients (in-job recovery)
    epoch: int = 0  # completed epochs
    step: int = 0  # completed optimizer steps
    batches_done: int = 0  # batches already trained in epoch `epoch + 1` (a run stopped part-way)
    batches_per_epoch: int = 0  # this job's (micro-)batches per epoch: where a restored position falls in its schedule
    # The training half of epoch `epoch`'s record while its evaluation is still to do (after a stop past its last
    # step): a resume evaluates that epoch first. None once the epoch is evaluated.
    pending_epoch: dict[str, Any] | None = None


def configure_torch(training: TrainingSettings) -> None:
    if training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True


def device_check(training: TrainingSettings, label: str) -> Callable[[str], None]:
    """What training asks of the device the bootstrap chose (its `fits`): --amp bf16 needs a GPU with bfloat16,
    --sync-bn a GPU; a UserError otherwise. `label`: this rank, as its errors name it."""
    def fits(device: str) -> None:
        if device == "cuda" and training.amp == "bf16" and not torch.cuda.is_bf16_supported():
            raise UserError(f"--amp bf16, but the GPU of {label} has no bfloat16 support: use --amp fp16")
        if training.sync_bn and device != "cuda":
            raise UserError("--sync-bn needs CUDA devices (torch's SyncBatchNorm is GPU-only): drop it on CPU")

    return fits


def optimizer_steps_per_epoch(num_batches: int, grad_accum: int) -> int:
    return -(-num_batches // grad_accum)


def schedule_position(epoch: int, batches_done: int, batches_per_epoch: int, grad_accum: int) -> int:
    """Optimizer steps into this job's schedule at `epoch` completed epochs plus `batches_done` batches: counted
    in this job's steps per epoch, so a resume with another batch size, accumulation or world size lands where
    its own curve says, not where the snapshot's step count would on the old curve."""
    steps = optimizer_steps_per_epoch(batches_per_epoch, grad_accum)
    return epoch * steps + min(steps, optimizer_steps_per_epoch(batches_done, grad_accum))


def build_state(cfg: Config, dist: Dist, num_classes: int, channels: int, batches_per_epoch: int,
                members: Any = None) -> TrainState:
    """Collective (DDP broadcasts rank 0's weights): model, DDP wrapper, optimizer, schedule and scaler. `members`:
    in-job recovery's Membership, which the gradient hook polls."""
    from mpiddp.trainer.models import build_model
    from mpiddp.trainer.optim import build_optimizer, build_scheduler

    torch.manual_seed(cfg.training.seed)  # identical initial weights everywhere (DDP also broadcasts rank 0's)
    model = build_model(cfg.data.model_name, num_classes, channels, cfg.data.input_size)
    if cfg.training.sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    memory_format = torch.channels_last if cfg.training.channels_last else torch.contiguous_format
    model = model.to(dist.device, memory_format=memory_format)
    ddp, hook, wrapped = wrap(cfg, dist, model, members)
    optimizer = build_optimizer(cfg.training, ddp.parameters())
    scheduler = build_scheduler(cfg.training, optimizer, optimizer_steps_per_epoch(batches_per_epoch, cfg.training.grad_accum))
    scaler = torch.amp.GradScaler(dist.device.type, enabled=cfg.training.amp == "fp16")
    # Same weights everywhere, but each rank its own stream for augmentation and dropout.
    torch.manual_seed(cfg.training.seed + 1 + dist.rank)
    return TrainState(wrapped, ddp, model, optimizer, scheduler, scaler, hook, batches_per_epoch=batches_per_epoch)


# At 16k GPUs the broadcast of a model of many GB is a phase of its own that a recovery does not need.
DDP_CAN_SKIP_INIT_SYNC = "init_sync" in inspect.signature(DistributedDataParallel.__init__).parameters


def keeps_first_bucket_layout(training: TrainingSettings) -> bool:
    """--deterministic: DDP's buckets keep their first layout for the whole run. DDP lays them out again after a
    job's first step (in the order the gradients were ready), so a resumed job's first step would all-reduce
    another layout than the uninterrupted run's same step; with 3 ranks or more a ring all-reduce (gloo's,
    measured) sums each element in an order set by its place in the bucket, and the weights would differ in the
    last bits (two ranks are exact: a + b = b + a). find_unused_parameters turns the new layout off, at one walk
    of the autograd graph per step (its one-time C++ warning about that shows only where torch's C++ warnings
    are, as with --log-level debug); --static-graph lays the buckets out again all the same."""
    return training.deterministic and not training.static_graph


def wrap(cfg: Config, dist: Dist, model: nn.Module, members: Any = None,
         transport: compression.TransportChoice | None = None, replicas_agree: bool = False,
         ) -> tuple[DistributedDataParallel, compression.GradientHook, nn.Module]:
    """Collective (DDP broadcasts rank 0's weights): `model` in DDP on the current process group, with mpiddp's
    gradient hook, maybe compiled. `members` (in-job recovery) lets the hook notice a failed peer through MPI.
    A recovery wraps the same module again over the survivors, keeping the job's `transport` (no new probe);
    `replicas_agree`: every rank already holds the same weights (survivors made consistent), so DDP skips its
    broadcast of the whole model where this torch lets it (DDP's init_sync; torch 2.4 has none)."""
    device = dist.device
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cfg.training.bucket_cap_mb,
        static_graph=cfg.training.static_graph,
        gradient_as_bucket_view=True,  # gradients live in the all-reduce buckets: one copy less per step
        find_unused_parameters=keeps_first_bucket_layout(cfg.training),
        **({"init_sync": False} if replicas_agree and DDP_CAN_SKIP_INIT_SYNC else {}),
    )
    quiet = transport is not None
    if transport is None:
        transport = compression.choose_transport(cfg.training.grad_transport, cfg.training.grad_compression, dist,
                                                 compression.gradient_bytes(model, cfg.training.bucket_cap_mb))
        log.info("%s", transport.describe())
    hook = compression.register(ddp, cfg.training.grad_compression, cfg.training.powersgd_rank, cfg.training.powersgd_warmup_steps,
                                dist.backend, mpi=dist if transport.chosen == "mpi" else None, members=members)
    hook.transport = transport
    if cfg.training.grad_compression != "none" and not quiet:
        log.info("gradient all-reduce: %s%s; buckets of %g MB", cfg.training.grad_compression,
                 f" (rank {cfg.training.powersgd_rank}, after {cfg.training.powersgd_warmup_steps} plain steps)"
                 if cfg.training.grad_compression == "powersgd" else "", cfg.training.bucket_cap_mb)
    return ddp, hook, torch.compile(ddp) if cfg.training.compile else ddp
