"""Training's front door for `python -m mpiddp [train]`: a process spawned by a job growing back joins it
(mpiddp.trainer.join); every other rank starts the job (mpiddp.trainer.run)."""

from __future__ import annotations

from typing import Any


def main(args: list[str], stop: Any = None, check: Any = None) -> int:
    """The rank's exit status. `stop`: training's stop request when `python -m mpiddp` installed it already;
    `check`: the check to run instead of training (mpiddp.trainer.run.CheckFn)."""
    from mpiddp.elastic.grow import joining, wait_until_released

    if joining() and check is not None:  # a hot spare of a check, which never grows back: it waits for the end
        return wait_until_released()
    if joining():  # spawned by a job growing back after a recovery, or a hot spare (mpiddp.elastic.grow)
        from mpiddp.trainer.join import main as join

        return join(args, stop)
    from mpiddp.trainer.run import main as train

    return train(args, stop, check)
