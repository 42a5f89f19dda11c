"""The global batch (samples per optimizer step: per-rank batch x ranks x accumulation) kept on another number of
ranks. Pure arithmetic, standard library only: the job applies it (--global-batch) and the supervisor checks it
before it shrinks a run (launch --min-np)."""

from __future__ import annotations


class GlobalBatchError(ValueError):
    """A global batch that no exact split over the ranks gives: one line naming the numbers."""


def split(global_batch: int, world_size: int, max_per_rank: int) -> tuple[int, int]:
    """(per-rank batch, accumulation steps) with per_rank x world_size x accumulation == global_batch exactly.

    The per-rank batch stays `max_per_rank` when that divides (only the accumulation grows, so each micro-batch
    is as big as before); otherwise it is the largest divisor of global_batch / world_size below it."""
    assert global_batch >= 1 and world_size >= 1 and max_per_rank >= 1
    if global_batch % world_size:
        raise GlobalBatchError(f"the global batch {global_batch} does not split over {world_size} ranks "
                               f"({global_batch} is not a multiple of {world_size})")
    per_world = global_batch // world_size
    per_rank = next(b for b in range(min(max_per_rank, per_world), 0, -1) if per_world % b == 0)
    return per_rank, per_world // per_rank


def describe(per_rank: int, world_size: int, accumulation: int) -> str:
    return f"{per_rank * world_size * accumulation} ({per_rank} per rank x {world_size} ranks x {accumulation} accumulation)"


def share(global_batch: int, world_size: int, rank: int) -> int:
    """Rank `rank`'s samples of one optimizer step when `global_batch` does not split evenly: the first
    global_batch % world_size ranks take one more (rank r takes the step's positions r, r + W, r + 2W, ...)."""
    return len(range(rank, global_batch, world_size))


def uneven_split(global_batch: int, world_size: int, max_per_rank: int) -> tuple[int, int]:
    """(the most samples a rank takes in one micro-batch, accumulation steps) when `global_batch` does not split
    evenly over `world_size` ranks: each rank's share (share(): G // W, or one more) in `accumulation` micro-batches
    of balanced sizes, at most `max_per_rank` each. Every rank runs the same number of micro-batches; each weighs
    its gradient by its share (the trainer's loss scale), so the update is the full job's. GlobalBatchError where a
    rank would get an empty micro-batch or no sample at all."""
    assert global_batch >= 1 and world_size >= 1 and max_per_rank >= 1
    if global_batch < world_size:
        raise GlobalBatchError(f"the global batch {global_batch} is smaller than the {world_size} ranks: some would "
                               "train on nothing")
    most = -(-global_batch // world_size)
    accumulation = -(-most // max_per_rank)
    if global_batch // world_size < accumulation:
        raise GlobalBatchError(f"the global batch {global_batch} over {world_size} ranks at most {max_per_rank} per "
                               f"micro-batch leaves a rank an empty micro-batch")
    return -(-most // accumulation), accumulation


def balanced(count: int, parts: int) -> list[int]:
    """`count` items cut into `parts` consecutive pieces whose sizes differ by at most one, larger first."""
    return [count // parts + (1 if index < count % parts else 0) for index in range(parts)]
