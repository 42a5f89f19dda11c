"""Training's front door for `python -m mpiddp [train]`: a process spawned by a job growing back joins it
(mpiddp.trainer.join); every other rank starts the job (mpiddp.trainer.run)."""

from __future__ import annotations

from typing import Any


def main(args: list[str], stop: Any = None) -> int:
    """The rank's exit status. `stop`: training's stop request when `python -m mpiddp` installed it already."""
    from mpiddp.elastic.grow import joining

    if joining():  # it has an MPI parent: spawned by a job growing back after a recovery (mpiddp.elastic.grow)
        from mpiddp.trainer.join import main as join

        return join(args, stop)
    from mpiddp.trainer.run import main as train

    return train(args, stop)
