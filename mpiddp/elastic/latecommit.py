"""Each optimizer step committed one step late, so that arming in-job recovery costs a GPU step nothing.

Strictly, a step's gradients are known complete on every rank before its optimizer step: the CPU waits for the
step's all-reduces (on NCCL: until the GPU has finished the backward and the last bucket) and the ranks agree.
That wait stops the CPU running ahead of the GPU, so everything it does between steps (the optimizer's launch,
the next batch, the next forward's first kernels) shows on the GPU's timeline: 6-12% of an H100 step.

Late, step N is not waited for. An undo record of everything step N's optimizer changes is taken in stream order
(it runs on the GPU after the all-reduce, before the update: it always holds the pre-step state), the optimizer
step is queued, and step N's works are held. At step N+1 the held works (long done by then) are waited for and
the ranks agree once (MPI_Comm_agree: the same answer on every survivor): step N commits and its record goes.
Where a rank failed, the agreement says so on every survivor alike and every survivor puts back the same
pre-step copy: nothing moves between survivors, and the step in flight is skipped, as strictly.

Why every survivor holds the same step: agreements are uniform, a survivor takes step N right after the agreement
on step N-1 with no communication in between, and nothing is held after a strict settle. So after any failure,
wherever it is noticed (a step's all-reduce, the stop agreement, a metric reduction), "the state after the last
agreed step" is the same on every survivor. At most two steps are lost to a failure: the held one and the one in
flight.

Settle strictly (`settle`) where the loop syncs with the GPU anyway (a metric line, an evaluation, a save, a grow
boundary, the end): a sync while a step is held would wait, on the GPU, for an all-reduce a dead peer never
finishes. `LateCommit` is the state machine alone: the undo record (mpiddp.elastic.undo.StepUndo) and the failure
watch (Membership) are handed in, so it runs under test with driven works and agreements.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from mpiddp.elastic.membership import MembersLost

if TYPE_CHECKING:
    from torch.distributed import Work

log = logging.getLogger("mpiddp")

COMMIT_MODES = ("auto", "late", "strict")  # auto: late on GPUs where the undo copy fits, strict on CPU


class Undo(Protocol):
    """The undo record of one optimizer step (mpiddp.elastic.undo.StepUndo)."""

    def take(self) -> None: ...

    def restore(self) -> None: ...

    def drop(self) -> None: ...

    @property
    def held(self) -> bool: ...


class Agreement(Protocol):
    """What the commit asks of the failure watch (mpiddp.elastic.membership.Membership)."""

    def wait(self, work: Work) -> None: ...

    def all_completed(self, completed: bool) -> bool: ...

    def failed(self) -> tuple[int, ...] | None: ...

    @property
    def lost_at(self) -> float | None: ...


class LateCommit:
    """The commit of one held step (see the module). `members`: the failure watch and the agreement; `undo`: the
    step's undo record. Every method but `hold` and `roll_back` is collective over the members."""

    def __init__(self, members: Agreement, undo: Undo) -> None:
        self.members = members
        self.undo = undo
        self.works: list[Work] = []  # the held step's collectives
        self.lost: MembersLost | None = None  # a failure seen while waiting for them

    @property
    def holding(self) -> bool:
        """A step was taken and not yet agreed on."""
        return self.undo.held

    def hold(self, works: Iterable[Work]) -> None:
        """Just before the optimizer step, on the main thread: the undo record taken (queued on the device after
        the step's all-reduces), the step's collectives held for the next agreement."""
        self.undo.take()
        self.works = list(works)

    def agree(self, completed_since: bool = True) -> bool:
        """Collective over the members (MPI_Comm_agree; where nothing is held and `completed_since`, nothing is
        exchanged): True when the held step, if any, completed on every member and each says it `completed_since`
        (no failure seen since); the record is dropped. False on every survivor alike otherwise: the record stays
        for `roll_back`, and `lost` says what this rank saw, where it saw it."""
        if not self.holding and completed_since:
            return True
        completed = completed_since and self._held_works_done()
        agreed = self.members.all_completed(completed)
        if agreed:
            self.undo.drop()
        return agreed

    def settle(self) -> None:
        """Collective: where the loop syncs with the GPU (or ends): the held step agreed on now. MembersLost where
        a member failed (the record stays for `roll_back`): the caller recovers as from any failure."""
        if not self.agree():
            raise self.members_lost()

    def roll_back(self) -> bool:
        """After a failure, on every survivor alike (see the module): the held step undone (its copies are queued
        on the device behind the step itself, so after NCCL's abort they run last). True where a step was held."""
        self.works = []
        if not self.holding:
            return False
        self.undo.restore()
        self.undo.drop()
        return True

    def members_lost(self) -> MembersLost:
        """After an agreement said no: the failure as this rank knows it (another member may have seen it first)."""
        if self.lost is not None:
            return self.lost
        return MembersLost(self.members.failed() or (), self.members.lost_at or time.time())

    def _held_works_done(self) -> bool:
        works, self.works = self.works, []
        for work in works:
            try:
                self.members.wait(work)
            except MembersLost as lost:
                self.lost = lost
                return False
        return True


def late_refusal(mode: str, device_type: str, room: str | None) -> str | None:
    """None where commit mode `mode` ("auto", "late", "strict") means the late commit on `device_type`, else why
    the step is waited for (strict), in a few words. `room`: why the undo copy does not fit, where it does not."""
    if mode not in COMMIT_MODES:
        raise ValueError(f"commit mode {mode!r}: one of {', '.join(COMMIT_MODES)}")
    if mode == "strict":
        return "asked for (strict)"
    if mode == "auto" and device_type != "cuda":
        return f"on {device_type} the all-reduce is waited for in backward anyway"
    return room
