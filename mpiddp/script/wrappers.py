"""mpiddp's step-level wrappers for a torchrun-style loop (mpiddp.elastic.steps), as the public names give them:
`mpiddp.DistributedDataParallel(model, ...)` takes torch's arguments and is handed the process's in-job recovery
(mpiddp.script.recovery); `mpiddp.Optimizer(optimizer, ddp)` finds it on the wrapper it trains."""

from __future__ import annotations

from torch import nn

from mpiddp.elastic import steps
from mpiddp.elastic.steps import BatchShare, Optimizer, share_global_batch, split_global_batch
from mpiddp.script.recovery import manager


class DistributedDataParallel(steps.DistributedDataParallel):
    __doc__ = steps.DistributedDataParallel.__doc__

    def __init__(self, module: nn.Module, *args: object, **kwargs: object) -> None:
        super().__init__(module, *args, manager=manager(), **kwargs)

    def __setstate__(self, state: dict[str, object]) -> None:
        """A copy (torch.load of a whole wrapper, copy.deepcopy) joins the loading process's in-job recovery."""
        super().__setstate__(state)
        self.manager = manager()


__all__ = ["BatchShare", "DistributedDataParallel", "Optimizer", "share_global_batch", "split_global_batch"]
