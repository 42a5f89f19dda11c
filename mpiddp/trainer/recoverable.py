"""In-job recovery's decisions in the trainer, pure (no MPI, no torch): how the global batch splits over the
survivors, and where the survivors' data position lies. Whether a job or a failure can be recovered from at all:
mpiddp.job.recoverability (`check` asks it too)."""

from __future__ import annotations

from dataclasses import dataclass

from mpiddp.globalbatch import GlobalBatchError, split

PHASES = ("detect", "agree_and_shrink", "process_group", "ddp", "first_step")


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
