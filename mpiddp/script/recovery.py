"""The process's one in-job recovery for scripts (mpiddp.elastic.api.Manager), and mpiddp's public functions that
hand it to elastic: `mpiddp.run_recoverable(train, state)`, `mpiddp.on_membership_change(callback)`,
`mpiddp.watch_gradients(ddp)`, `mpiddp.wait(work)` (mpiddp.script.wrappers: `mpiddp.DistributedDataParallel`). The
Manager is made on first use and lives as long as the process (a recovery changes what it holds, never which one it
is); elastic/ itself holds none, so a test hands its own to elastic's classes. Loads no torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from mpiddp.elastic.api import Manager, MembershipChange, ScriptRecovery, State

if TYPE_CHECKING:
    from torch.distributed import Work
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from mpiddp.elastic.api import OwnJob
    from mpiddp.job.collective import Dist

T = TypeVar("T")

_manager: Manager | None = None  # this process's, made on first use


def manager() -> Manager:
    """This process's in-job recovery for scripts."""
    global _manager
    if _manager is None:
        _manager = Manager()
    return _manager


def adopt(job: OwnJob | None) -> None:
    """`mpiddp.init()` or `mpiddp run` hands over the job it bootstrapped (internal)."""
    manager().adopt(job)


def hold(dist: Dist) -> None:
    """`mpiddp.init()` under `mpiddp run` (internal): see Manager.hold."""
    manager().hold(dist)


def wait_for_every_rank(dist: Dist) -> None:
    """Collective, once this rank's script has finished (internal): see Manager.wait_for_every_rank."""
    manager().wait_for_every_rank(dist)


def active() -> ScriptRecovery | None:
    """The job's in-job recovery once `run_recoverable` (or mpiddp's wrappers) turned it on, else None."""
    return manager().active()


def on_membership_change(callback: Callable[[MembershipChange], None]) -> Callable[[MembershipChange], None]:
    """Run `callback(change)` on every survivor after each recovery, once the state is synced and before the
    training function runs again (rescale a learning rate, reopen a per-rank file). Usable as a decorator."""
    return manager().on_membership_change(callback)


def run_recoverable(train: Callable[[State], T], state: State, min_world_size: int | None = None) -> T:
    """Collective: run `train(state)` and return what it returns; when a rank dies, the survivors recover in the
    job (mpiddp.elastic.api) and run `train(state)` again, with `state` synced. `min_world_size`: the fewest ranks
    the job may go on with (default MPIDDP_MIN_NP, which `launch --min-np` sets, else 1). Needs `mpiddp.init()`
    first. Where recovery cannot work, one line on rank 0 says why and `train(state)` runs as without it."""
    return manager().run_recoverable(train, state, min_world_size)


def watch_gradients(ddp: TorchDDP, compression: str = "none") -> TorchDDP:
    """Collective-free: under in-job recovery, DDP's gradient all-reduce runs on the process group as DDP's own
    does (`compression`: "none", "fp16" or "bf16" sends half the bytes) but is waited for under MPI's failure
    watch, so a rank whose peer dies while it waits in gloo's all-reduce learns it at once. Without recovery,
    DDP's own all-reduce (or `compression`'s hook). Returns `ddp`. Call it on each new DDP wrapper."""
    return manager().watch_gradients(ddp, compression)


def wait(work: Work) -> None:
    """Wait for a torch collective of your own, issued with `async_op=True`: under in-job recovery, under MPI's
    failure watch (a blocking gloo collective would wait out its whole timeout for a dead peer)."""
    manager().wait(work)


__all__ = ["MembershipChange", "State", "manager", "on_membership_change", "run_recoverable", "wait", "watch_gradients"]
