"""mpiddp: one mpirun command trains with PyTorch DDP on every GPU of every host.

Public API for your own scripts (importing mpiddp never initialises MPI):
    dist = mpiddp.init()          # collective: bootstrap once, process group up, typed Dist back
    mpiddp.setup_logging(dist)    # rank-prefixed logging: rank 0 at INFO, the others at WARNING
    ddp.register_comm_hook(*mpiddp.comm_hook())   # MPI carries DDP's gradient all-reduce
"""

from mpiddp.errors import AgreedError, UserError
from mpiddp.job.api import init
from mpiddp.job.collective import Dist, Rendezvous
from mpiddp.job.topology import Topology
from mpiddp.job.transport import comm_hook
from mpiddp.version import __version__

__all__ = ["AgreedError", "Dist", "Rendezvous", "Topology", "UserError", "__version__", "comm_hook", "init", "setup_logging"]


def setup_logging(dist: Dist, level: str = "info") -> None:
    """stdlib logging with a rank prefix on every line; rank 0 logs at `level`, the others warnings and errors."""
    from mpiddp.job.log import setup_logging as configure

    configure(dist.topology, level)
