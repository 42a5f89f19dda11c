"""In-job recovery's decisions, pure (no MPI, no torch): whether a job can recover in the job at all (its device,
backend, compression, torch), whether a failure can be recovered from where it struck,
how the global batch splits over the survivors, and where the survivors' data position lies.

Each refusal is one line saying why; the caller then takes today's fail-fast path (the job ends and `launch`
relaunches it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mpiddp.globalbatch import GlobalBatchError, split

PHASES = ("detect", "agree_and_shrink", "process_group", "ddp", "first_step")


def refusal(where: str, stepped: bool, device_type: str, compression: str) -> str | None:
    """None when a failure that struck in `where` (train, eval, save, ...) can be recovered in the job, else one
    line why not. `stepped`: whether this job completed a training step."""
    if not stepped:
        return "a rank failed before the first training step: in-job recovery starts with training"
    if where == "save":
        return "a rank failed during a save: the snapshot may be incomplete"
    if device_type not in ("cpu", "cuda"):
        return f"in-job recovery on {device_type} is not built"
    if compression == "powersgd":
        return POWERSGD
    return None


POWERSGD = "in-job recovery does not carry PowerSGD's per-rank error feedback"
NCCL_ERRORS_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"  # torch's NCCL watchdog: what it does on a NCCL error
NCCL_ERRORS_QUIET = ("0", "2")  # no handling, clean-up only: neither ends the process (1 and 3 do)


def job_refusal(device_type: str, backend: str, compression: str, can_abort_nccl: bool, torch_version: str,
                env: Mapping[str, str]) -> str | None:
    """None when this job's settings let it recover in the job wherever a failure strikes after its first step,
    else one line why not. Fixed for the whole job: the trainer asks once at start, and `check` asks the same.
    `can_abort_nccl`: whether torch can abort a NCCL communicator (distributed_c10d._abort_process_group)."""
    reason = refusal("train", True, device_type, compression)
    if reason is not None or device_type != "cuda" or backend != "nccl":
        return reason  # gloo over CUDA tensors takes the CPU path: the old gloo group is left, not aborted
    if not can_abort_nccl:
        return (f"in-job recovery on GPUs needs torch.distributed's _abort_process_group (torch 2.5 or newer) to "
                f"abort the NCCL communicator that waits on the dead rank; this is torch {torch_version}")
    handling = env.get(NCCL_ERRORS_ENV, "3")  # unset: torch's default, 3, ends the process
    if handling not in NCCL_ERRORS_QUIET:
        return (f"{NCCL_ERRORS_ENV}={handling} makes torch end a rank on a NCCL error, survivors included: set it "
                "to 0 (mpiddp's trainer does when the user has not set it)")
    return None


def nccl_errors_env(env: Mapping[str, str]) -> dict[str, str]:
    """What to set before the NCCL process group starts so that torch's NCCL watchdog does not end a survivor
    when a peer dies (MPI notices the failure, and the survivors abort the communicator themselves); nothing
    where the user chose (job_refusal then says whether their choice allows recovery)."""
    return {} if NCCL_ERRORS_ENV in env else {NCCL_ERRORS_ENV: "0"}


@dataclass(frozen=True)
class Resplit:
    """The survivors' per-rank batch, accumulation and data position (micro-batches done in the epoch)."""

    batch_size: int
    grad_accum: int
    batches_done: int


def resplit(batch_size: int, grad_accum: int, world_before: int, world_after: int,
            batches_done: int, max_per_rank: int | None = None, epoch_samples: int | None = None) -> Resplit | str:
    """The same global batch and the same global sample position on `world_after` ranks, or one line why not.
    `max_per_rank`: the most samples a rank takes at once (default `batch_size`; a job growing back may return
    to the per-rank batch it started with). `epoch_samples`: the samples of an epoch (None: synthetic batches,
    counted per rank).

    Ranks take the epoch's order interleaved (rank r's i-th sample is position r + i x W), so after
    `batches_done` micro-batches of `batch_size` on each of `world_before` ranks the job has trained exactly the
    first batches_done x batch_size x world_before positions; the survivors continue at that position. A position
    at or past the epoch's samples (the last round is padded with repeats) is the epoch's end: no sample is left."""
    global_batch = batch_size * world_before * grad_accum
    try:
        per_rank, accumulation = split(global_batch, world_after, max_per_rank or batch_size)
    except GlobalBatchError as exc:
        return f"{exc}: the job cannot keep its global batch on the survivors"
    position = batches_done * batch_size * world_before
    if epoch_samples is not None and position >= epoch_samples:  # skips every rank's whole shard: nothing left
        return Resplit(per_rank, accumulation, -(-position // (per_rank * world_after)))
    if position % (per_rank * world_after):
        return (f"the data position {position} does not fall on a batch of {per_rank} x {world_after} ranks: "
                "the survivors cannot continue at the same sample")
    return Resplit(per_rank, accumulation, position // (per_rank * world_after))


class Regrown(Exception):
    """New ranks joined the job at a step boundary (mpiddp.trainer.grow): the epoch goes on with the new split."""
