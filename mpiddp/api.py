"""The public API for your own scripts: `dist = mpiddp.init()` gives a typed Dist with the process group up.

Under `python -m mpiddp run script.py` it reuses the runner's bootstrap (one rendezvous, one store, the runner's
failure handling). Under a plain `mpirun python script.py` it bootstraps itself and turns an unhandled exception
on any rank into the end of the whole job.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from mpiddp.collective import Dist, Rendezvous
from mpiddp.config import BACKENDS, DEVICES, MASTER_ADDR_ENV
from mpiddp.failfast import FailFast, flush_logs

if TYPE_CHECKING:
    from mpiddp.bootstrap import _Store


@dataclass
class Session:
    """A bootstrapped job whose process group is not up yet: MPI, topology, rendezvous store, thread share."""

    dist: Dist
    rendezvous: Rendezvous
    store: _Store
    num_threads: int


@dataclass(frozen=True)
class InitSettings:
    """What `init` asks of the bootstrap (the same fields the training command's Config has)."""

    device: str = "auto"
    backend: str = "auto"
    collective_timeout_s: float = 600.0
    amp: str = "off"
    sync_bn: bool = False
    master_addr: str | None = None
    iface: str | None = None
    rendezvous_timeout_s: float = 120.0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be positive, got {self.collective_timeout_s}")


_session: Session | None = None  # set by `mpiddp run` while the script runs
_initialised: Dist | None = None


def attach(session: Session) -> None:
    """`mpiddp run` hands its bootstrap to the script's `init()` (internal)."""
    global _session
    _session = session


def detach() -> None:
    global _session, _initialised
    _session = _initialised = None


def init(device: str = "auto", backend: str = "auto", collective_timeout_s: float = 600.0) -> Dist:
    """Collective, on every rank: bootstrap the job once and start torch's default process group.

    device: "auto" (cuda:<local rank> when CUDA is available, else cpu), "cuda" or "cpu".
    backend: "auto" (nccl on CUDA, gloo on CPU), "gloo", "nccl" or "mpi".
    Returns the Dist: rank, local_rank, world_size, is_main, topology (hosts), device, and cross-rank helpers
    (reduce, allgather, gather, barrier, agree, from_main). Calling it again returns the same Dist. Exported
    environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and friends.
    """
    global _initialised
    if _initialised is not None:
        return _initialised
    from mpiddp.bootstrap import start_process_group

    settings = InitSettings(device, backend, collective_timeout_s, master_addr=os.environ.get(MASTER_ADDR_ENV))
    session = _session or _bootstrap(settings)
    _initialised = start_process_group(settings, session.dist, session.rendezvous, session.store, session.num_threads)
    return _initialised


def _bootstrap(settings: InitSettings) -> Session:
    """Plain `mpirun python script.py`: mpiddp's bootstrap, an exception hook that ends the whole job, and a
    teardown when the script ends normally."""
    from mpiddp.bootstrap import connect, open_rendezvous, set_threads, teardown

    guard = FailFast()
    _abort_on_unhandled_exception(guard)
    dist = connect(guard)
    num_threads = set_threads(settings, dist.topology)
    rendezvous, store = open_rendezvous(settings, dist, guard)
    atexit.register(teardown, dist, store)
    return Session(dist, rendezvous, store, num_threads)


def _abort_on_unhandled_exception(guard: FailFast) -> None:
    """Like `python -m mpi4py`: an exception that reaches the top on any rank ends every rank."""

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        code, text = guard.decide(exc)
        if text:
            flush_logs()
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        if guard.dist is not None and guard.dist.world_size > 1:
            guard.dist.abort(code)
        os._exit(code)

    sys.excepthook = hook
