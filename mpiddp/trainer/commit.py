"""When the trainer's optimizer step may use the step's gradients: at once, or committed one step late.

Under in-job recovery on GPUs the step's all-reduces are known complete on every rank before its update is
agreed on. Strictly (CPU, and where the late commit is refused) the CPU waits for them before the optimizer step,
which costs a GPU step 6-12%; late (mpiddp.elastic.latecommit) it does not wait, and the ranks agree on the step
at the next one, each holding an undo copy on the device. A failure then rolls the held step back on every
survivor alike, with the loop's position (its step and batch counters), before they recover.

Settled strictly where the loop syncs with the GPU anyway: a metric line, a save, a stop, the epoch's end, a grow
(`settle`), and at the first step of a process group (DDP's first iteration over it rebuilds its buckets).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from mpiddp.elastic.latecommit import LateCommit, late_refusal
from mpiddp.elastic.undo import StepUndo, room_for

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mpiddp.elastic.membership import Membership
    from mpiddp.job.compression import GradientHook


class TrainState(Protocol):
    """What the commit reads and winds back of the trainer's state (mpiddp.trainer.state.TrainState, which holds
    the commit: a protocol here, so neither module imports the other)."""

    unwrapped: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    gradient_hook: GradientHook | None
    step: int
    batches_done: int

log = logging.getLogger("mpiddp")


def trainer_refusal(mode: str, state: TrainState, undo: StepUndo) -> str | None:
    """Why this run waits for each step's all-reduces (strict) where `mode` would commit late, None where it may
    commit late. fp16's GradScaler on a non-fused optimizer syncs with the GPU in every step (its inf check); the
    MPI transport's all-reduce is blocking: the late commit has nothing to gain from either."""
    hook = state.gradient_hook
    if mode != "strict" and hook is not None and hook.mpi is not None:
        return "the MPI gradient transport's all-reduce is waited for anyway"
    if mode != "strict" and hook is not None and hook.watched is None:
        return "the gradient all-reduce is not watched (PowerSGD)"
    if mode != "strict" and state.scaler.is_enabled() and not _fused(state.optimizer):
        return "fp16's GradScaler checks for infs on the CPU in every step"
    device = next(state.unwrapped.parameters()).device
    return late_refusal(mode, device.type, room_for(undo) if mode != "strict" else None)


def _fused(optimizer: object) -> bool:
    return any(group.get("fused") for group in getattr(optimizer, "param_groups", ()))


class StepCommit:
    """The trainer's commit of each step (see the module): `late` None commits strictly (today's wait)."""

    def __init__(self, late: LateCommit | None) -> None:
        self.late = late
        self.strict_next = True  # the first step over a process group is settled strictly
        self.position = (0, 0)  # the loop's (step, batches_done) before the held step
        self.undone = 0  # held steps rolled back (summary.json's recoveries count them as lost)
        self._uncount: Callable[[], None] | None = None  # takes the held step out of the epoch's meters

    @classmethod
    def arm(cls, mode: str, state: TrainState, members: Membership | None, is_main: bool) -> StepCommit:
        """The commit for this run, one line on rank 0 saying which mode is in force (under in-job recovery)."""
        if members is None:
            late_refusal(mode, "cpu", None)  # an unknown mode is an error with or without recovery
            return cls(None)
        undo = StepUndo(state.unwrapped, state.optimizer, state.scaler, state.scheduler)
        refusal = trainer_refusal(mode, state, undo)
        if is_main:  # a local log line, no collective
            if refusal is None:
                log.info("in-job recovery: each step commits one step late (--commit %s; an undo copy of %.1f MB)",
                         mode, undo.device_bytes() / 2**20)
            else:
                log.info("in-job recovery: each step waits for its all-reduces before the optimizer step (--commit "
                         "%s: %s)", mode, refusal)
        return cls(LateCommit(members, undo) if refusal is None else None)

    def before_step(self, state: TrainState) -> None:
        """Collective, on the main thread once backward returned, before the optimizer step: strictly, the step's
        all-reduces waited for (MembersLost where a peer failed); late, the held step agreed on (MembersLost on
        every survivor alike where a rank failed) and this one held."""
        hook = state.gradient_hook
        if self.late is None or self.strict_next:
            if hook is not None:
                hook.settle()
                if self.strict_next:  # DDP's first step over this process group: its bucket re-layout, watched
                    hook.rebuild_buckets()
            # strict until DDP has laid its buckets out (after its second step with a static graph)
            self.strict_next = hook is not None and hook.layout_pending()
            return
        works = hook.watched.take_pending() if hook is not None and hook.watched is not None else []
        if not self.late.agree():
            raise self.late.members_lost()
        self.position = (state.step, state.batches_done)
        self._uncount = None
        self.late.hold(works)

    def counted(self, uncount: Callable[[], None]) -> None:
        """The loop counted the step it just took in its meters; `uncount()` takes it out again."""
        self._uncount = uncount if self.late is not None and self.late.holding else None

    def settle(self) -> None:
        """Collective, where the loop syncs with the GPU: the held step agreed on now (MembersLost where a rank
        failed: the caller's in-job recovery rolls it back)."""
        if self.late is not None and self.late.holding:
            self.late.settle()

    def roll_back(self, state: TrainState) -> bool:
        """After a failure, before the survivors shrink (on every survivor alike): the held step undone, the loop's
        position with it. The first step over the new process group is strict again."""
        self.strict_next = True
        if self.late is None or not self.late.roll_back():
            return False
        state.step, state.batches_done = self.position
        if self._uncount is not None:  # trained again after the recovery, and counted then
            self._uncount()
            self._uncount = None
        self.undone += 1
        return True
