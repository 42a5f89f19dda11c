"""The process's one in-job recovery for scripts (mpiddp.elastic.api.Manager), and mpiddp's public functions that
hand it to elastic: `mpiddp.run_recoverable(train, state)`, `mpiddp.on_membership_change(callback)`,
`mpiddp.watch_gradients(ddp)`, `mpiddp.wait(work)` (mpiddp.script.wrappers: `mpiddp.DistributedDataParallel`). The
Manager is made on first use and lives as long as the process (a recovery changes what it holds, never which one it
is); elastic/ itself holds none, so a test hands its own to elastic's classes. Loads no torch."""

from __future__ import annotations

import sys
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

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


def keep(where: MutableMapping[str, Any] | object, *names: str) -> None:
    """Declare which of the loop's own variables hold its position, for a loop under mpiddp.Optimizer to grow back
    (`where`: the module's `globals()`, or an object whose attributes they are), e.g.
    `mpiddp.keep(globals(), "iter_num", "best_val_loss")` before the loop. A new rank a grow brings in runs the script
    from the top and, at its first `optimizer.step()`, takes rank 0's values of these names (an object with
    `state_dict`, such as a GradScaler or an LR scheduler, is loaded in place), with every model and optimizer:
    it then stands where the survivors stand. `mpiddp.keep(globals())` where `optimizer.steps` is the position.
    Without it such a loop recovers but does not grow back (its spares are released at its first step)."""
    caller = sys._getframe(1)
    bad = [name for name in names if not isinstance(name, str) or not name.isidentifier()]
    if bad:
        raise ValueError(f"mpiddp.keep(where, *names): names are the variables' names as strings, got {bad!r}")
    if where is not caller.f_globals and isinstance(where, dict) and names and all(
            name in caller.f_code.co_varnames + caller.f_code.co_cellvars for name in names):
        raise ValueError("mpiddp.keep(locals(), ...): a function's local variables cannot be written back: keep the "
                         "loop's position in the module's globals() or in an object's attributes "
                         "(mpiddp.keep(progress, \"step\")), or hand the loop to mpiddp.run_recoverable")
    manager().keep(where, tuple(names))


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


__all__ = ["MembershipChange", "State", "keep", "manager", "on_membership_change", "run_recoverable", "wait",
           "watch_gradients"]
