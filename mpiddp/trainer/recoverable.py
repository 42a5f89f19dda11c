"""In-job recovery's decisions, pure (no MPI, no torch): whether a failure can be recovered from where it struck,
how the global batch splits over the survivors, and where the survivors' data position lies.

Each refusal is one line saying why; the caller then takes today's fail-fast path (the job ends and `launch`
relaunches it).
"""

from __future__ import annotations

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
    if device_type != "cpu":
        return f"in-job recovery on {device_type} (NCCL) is not built yet"
    if compression == "powersgd":
        return "in-job recovery does not carry PowerSGD's per-rank error feedback"
    return None


@dataclass(frozen=True)
class Resplit:
    """The survivors' per-rank batch, accumulation and data position (micro-batches done in the epoch)."""

    batch_size: int
    grad_accum: int
    batches_done: int


def resplit(batch_size: int, grad_accum: int, world_before: int, world_after: int,
            batches_done: int, max_per_rank: int | None = None) -> Resplit | str:
    """The same global batch and the same global sample position on `world_after` ranks, or one line why not.
    `max_per_rank`: the most samples a rank takes at once (default `batch_size`; a job growing back may return
    to the per-rank batch it started with).

    Ranks take the epoch's order interleaved (rank r's i-th sample is position r + i x W), so after
    `batches_done` micro-batches of `batch_size` on each of `world_before` ranks the job has trained exactly the
    first batches_done x batch_size x world_before positions; the survivors continue at that position."""
    global_batch = batch_size * world_before * grad_accum
    try:
        per_rank, accumulation = split(global_batch, world_after, max_per_rank or batch_size)
    except GlobalBatchError as exc:
        return f"{exc}: the job cannot keep its global batch on the survivors"
    position = batches_done * batch_size * world_before
    if position % (per_rank * world_after):
        return (f"the data position {position} does not fall on a batch of {per_rank} x {world_after} ranks: "
                "the survivors cannot continue at the same sample")
    return Resplit(per_rank, accumulation, position // (per_rank * world_after))
