"""What a script's new rank runs its own start on before it joins (mpiddp.elastic.grow.LateJoin).

A rank that grows a script's job back runs the script from its top (imports, data, the model, a compile, its first
iteration alone) while the survivors train, and joins them only at its first step. Until then the others are
past every collective of that start: a barrier has nothing to wait for, and any other collective would wait for
ranks that never come (torch's collective timeout, then the job's end) or, on torch's fake backend, hand back
memory nobody wrote. So torch's default group is a stand-in that knows this rank's place in the grown job
(get_rank, get_world_size, is_initialized answer as after the join) and reaches nobody: a barrier returns at
once, and any other collective of torch.distributed, or of mpiddp's Dist, raises BeforeJoining with one line that
says what to do; the new rank then leaves and the job goes on without it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

if TYPE_CHECKING:
    import numpy as np

    from mpiddp.job.collective import GradientSupport, HalfFloat

T = TypeVar("T")

# torch.distributed's collectives a script may call by name in its start (barriers are answered at once)
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "gather", "gather_object", "scatter", "scatter_object_list", "broadcast_object_list",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "batch_isend_irecv", "all_reduce_coalesced")
BARRIERS = ("barrier", "monitored_barrier")


class BeforeJoining(RuntimeError):
    """A collective of the script's own start on a rank that has not joined the grown job yet."""

    def __init__(self, operation: str) -> None:
        super().__init__(
            f"{operation} before the first training step on a rank that grows the job back: the other ranks "
            f"are past it and never meet it: take what it would bring from the survivors instead (mpiddp.keep, or "
            f"run_recoverable's State), or do it after the first step")


class StandInGroup:
    """torch's default group until the join: the fake backend (it reaches nobody) at this rank's place, and
    torch.distributed's collectives replaced by name while it stands (put back by `remove`).

    A script may take a collective by name during its start (`from torch.distributed import all_reduce` at its
    top, `reduce = dist.all_reduce`): what it took must work after the join, so each replacement forwards to
    torch's own once the group is removed. torch's own calls between its collectives go through
    distributed_c10d's names (all_gather_object calls all_gather there): both modules are covered."""

    def __init__(self) -> None:
        self._replaced: list[tuple[Any, str, Any]] = []  # (module, name, torch's own function)
        self.standing = False

    def install(self, rank: int, world_size: int) -> None:
        import torch.distributed as tdist
        from torch.distributed import distributed_c10d
        from torch.testing._internal.distributed import fake_pg  # registers the "fake" backend (torch 2.4 to 2.14)

        tdist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)
        self.standing = True
        for module in (tdist, distributed_c10d):
            for name in COLLECTIVES + BARRIERS:
                if hasattr(module, name):
                    original = getattr(module, name)
                    self._replaced.append((module, name, original))
                    setattr(module, name, self._stand_in_for(name, original))

    def _stand_in_for(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def stand_in(*args: object, **kwargs: object) -> Any:
            if not self.standing:  # taken by name before the join, called after it
                return original(*args, **kwargs)
            if name in BARRIERS:
                return None  # the others passed it long ago
            raise BeforeJoining(f"torch.distributed.{name}()")

        return stand_in

    def remove(self) -> None:
        import torch.distributed as tdist

        self.standing = False
        for module, name, original in self._replaced:
            setattr(module, name, original)
        self._replaced.clear()
        if tdist.is_initialized():
            tdist.destroy_process_group()


class StandInTransport:
    """mpiddp's Dist before the join: this rank's place in the grown job; a barrier answered at once, any other
    collective refused (BeforeJoining)."""

    def __init__(self, rank: int, size: int, end: Callable[[int], NoReturn]) -> None:
        self.rank, self.size = rank, size
        self._end = end  # how this process ends at once (it never joined: nothing of the job goes with it)

    def allgather(self, value: T) -> list[T]:
        raise BeforeJoining("mpiddp's allgather()")

    def gather(self, value: T) -> list[T] | None:
        raise BeforeJoining("mpiddp's gather()")

    def bcast(self, value: T) -> T:
        raise BeforeJoining("mpiddp's broadcast (from_main or agree)")

    def scatter(self, values: list[T] | None) -> T:
        raise BeforeJoining("mpiddp's scatter()")

    def allreduce(self, values: np.ndarray, op: str) -> np.ndarray:
        raise BeforeJoining("mpiddp's reduce()")

    def barrier(self) -> None:
        pass

    def idle_barrier(self, poll_s: float) -> None:
        pass

    def abort(self, code: int) -> NoReturn:
        self._end(code)

    def failed_ranks(self) -> tuple[int, ...]:
        return ()

    def pingpong(self, peer: int, nbytes: int, repeats: int) -> float:
        raise BeforeJoining("mpiddp's pingpong()")

    def allreduce_inplace(self, values: object, sum_as: HalfFloat | None = None) -> None:
        raise BeforeJoining("mpiddp's gradient all-reduce")

    def gradient_support(self) -> GradientSupport:
        from mpiddp.job.collective import GradientSupport

        return GradientSupport("multiple", True, True)  # asked again over the job's communicator once it joined
