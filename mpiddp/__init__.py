"""mpiddp: one mpirun command trains with PyTorch DDP on every GPU of every host.

Public API for your own scripts (importing mpiddp never initialises MPI):
    dist = mpiddp.init()          # collective: bootstrap once, process group up, typed Dist back
    mpiddp.setup_logging(dist)    # rank-prefixed logging: rank 0 at INFO, the others at WARNING
    ddp.register_comm_hook(*mpiddp.comm_hook())   # MPI carries DDP's gradient all-reduce
    state = mpiddp.State(model=model, optimizer=opt, epoch=0)   # in-job recovery (mpirun --with-ft ulfm):
    mpiddp.run_recoverable(train, state)          # train(state) runs again on the survivors when a rank dies
    ddp = mpiddp.DistributedDataParallel(model)   # or keep your loop: torch's DDP that survives a recovery,
    optimizer = mpiddp.Optimizer(optimizer, ddp)  # and an optimizer whose step() skips a step a rank failed
    mpiddp.keep(globals(), "iter_num")            # the loop's position, for a new rank to grow back into

The names load on first use (PEP 562): `import mpiddp` alone, or `python -m mpiddp launch`, loads no numpy,
mpi4py or torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from mpiddp.errors import AgreedError, UserError
from mpiddp.version import __version__

if TYPE_CHECKING:
    from mpiddp.script.api import init
    from mpiddp.script.recovery import (MembershipChange, State, keep, on_membership_change, run_recoverable,
                                        wait, watch_gradients)
    from mpiddp.script.wrappers import (BatchShare, DistributedDataParallel, Optimizer, share_global_batch,
                                        split_global_batch)
    from mpiddp.job.collective import Dist, Rendezvous
    from mpiddp.job.topology import Topology
    from mpiddp.job.transport import comm_hook

__all__ = ["AgreedError", "BatchShare", "Dist", "DistributedDataParallel", "MembershipChange", "Optimizer",
           "Rendezvous", "State", "Topology", "UserError", "__version__", "comm_hook", "init", "keep",
           "on_membership_change", "run_recoverable", "setup_logging", "share_global_batch", "split_global_batch", "wait",
           "watch_gradients"]

# Lazy: `python -m mpiddp` imports this package before its first line runs, and that line installs the stop
# handlers; a numpy or torch import here would be a window in which a scheduler's SIGTERM kills a rank.
_LAZY = {"init": "mpiddp.script.api", "Dist": "mpiddp.job.collective", "Rendezvous": "mpiddp.job.collective",
         "Topology": "mpiddp.job.topology", "comm_hook": "mpiddp.job.transport",
         **dict.fromkeys(["MembershipChange", "State", "keep", "on_membership_change", "run_recoverable", "wait",
                          "watch_gradients"], "mpiddp.script.recovery"),
         **dict.fromkeys(["BatchShare", "DistributedDataParallel", "Optimizer", "share_global_batch",
                          "split_global_batch"], "mpiddp.script.wrappers")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # once loaded, an ordinary attribute
        return value
    raise AttributeError(f"module 'mpiddp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def setup_logging(dist: Dist, level: str = "info") -> None:
    """stdlib logging with a rank prefix on every line; rank 0 at `level`, the others warnings and errors."""
    from mpiddp.job.log import setup_logging as configure

    configure(dist.topology, level)
