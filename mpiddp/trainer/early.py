"""Training's stop handlers, installed by the first line of `python -m mpiddp`: light on purpose (no numpy, torch
or MPI loads before them), so that a scheduler's SIGTERM in a rank's first moments stops it with exit 3."""

from __future__ import annotations

from mpiddp.commands import split_command
from mpiddp.job.stopping import StopRequest


def install_stop(args: list[str]) -> StopRequest | None:
    """For `python -m mpiddp ARGS`, before anything heavy is imported: training's stop request, installed now;
    None for the other commands (`run`'s script owns its signals; `launch` has its own)."""
    command, _ = split_command(args)
    return StopRequest().install() if command == "train" else None
