"""The one in-job recovery engine, for the built-in trainer and for scripts: the survivors of a failed rank detect
it, agree and shrink (membership), follow the shrunk job (survivors), then the user's Policy syncs from the
furthest survivor and re-wraps, records and says. Where recovery cannot work, one line says why and the job takes
the fail-fast path (NotRecovered: it ends, and `launch` relaunches it)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, NoReturn, Protocol, TypeVar, cast

from mpiddp.contract import MIN_NP_ENV
from mpiddp.elastic.decide import Position, furthest
from mpiddp.elastic.grow import GrowBack, Regrown
from mpiddp.elastic.hooks import OutcomeT, Phases, RecoveryHooks
from mpiddp.elastic.membership import (MembersLost, Membership, RecoveryFailed, WatchedTransport, members_lost,
                                       mpi_error_of)
from mpiddp.elastic.survivors import bind_topology, mark_recovered, shrunk_topology, unless_end_decided
from mpiddp.errors import PeersLost
from mpiddp.job.abort import abort_within
from mpiddp.job.collective import Dist, MpiTransport, set_end_everyone

if TYPE_CHECKING:
    import torch

    from mpiddp.job.failfast import FailFast
    from mpiddp.job.topology import Topology

log = logging.getLogger("mpiddp")
T = TypeVar("T")
V = TypeVar("V")  # what a sync sends: any picklable value
P = TypeVar("P")  # a sync's payload


class NotRecovered(PeersLost):
    """A failure in-job recovery does not cover: FailFast ends the job, its record naming the lost peers and their
    hosts (PeersLost), so `launch` leaves those hosts out of the relaunch; the message names them in MPI's words."""


def refused(dist: Dist, reason: str | None, level: int) -> bool:
    """Whether in-job recovery is off (`reason`, said on rank 0 at `level`; a failure then ends the job)."""
    if reason is not None and dist.is_main:  # a local log line, no collective
        log.log(level, "%s", reason)
    return reason is not None


class Comm(Protocol):
    """What a sync needs of the survivors' communicator (DistComm, or a test's fake)."""

    rank: int

    def allgather(self, value: V) -> list[V]: ...
    def bcast(self, value: V, root: int) -> V: ...


class DistComm:
    """The survivors' MPI communicator, for a sync (pickles over 2 GiB too: the state of a big model)."""

    def __init__(self, dist: Dist) -> None:
        transport = dist.transport
        assert isinstance(transport, MpiTransport)
        self.rank, self._transport = dist.rank, transport

    def allgather(self, value: V) -> list[V]:
        return self._transport.allgather(value)

    def bcast(self, value: V, root: int) -> V:
        return self._transport.large.bcast(value, root=root)


def from_furthest(comm: Comm, position: Position, payload: Callable[[], P], load: Callable[[P], None]) -> int | None:
    """Collective over the survivors: a collective can complete on some ranks only, so the survivor whose
    `position` is furthest (decide.furthest) gives every other its `payload()`, which they `load`. Returns that
    rank, None when every survivor is at the same position."""
    leader = furthest(comm.allgather(position))
    if leader is not None:
        taken = comm.bcast(payload() if comm.rank == leader else None, root=leader)
        if comm.rank != leader:
            load(cast(P, taken))  # the leader's payload()
    return leader


class Policy(RecoveryHooks[OutcomeT]):
    """The base of a user's policy (the trainer's: mpiddp.trainer.elastic_policy; scripts': elastic.api): the
    contract is mpiddp.elastic.hooks.RecoveryHooks (asked in its order on every survivor), and GrowHooks where the
    policy grows back. This binds the engine's side and gives the optional hooks their defaults; a policy writes
    alive_at, records_dir, resume and settle. The engine sets `engine`, `members` and `dists`."""

    engine: Engine[OutcomeT]
    members: Membership
    dists: list[Dist]
    guard: FailFast | None = None  # follows the survivors with every Dist (survivors.bind_topology), as log_level
    log_level: str | None = None
    hide_cause = False  # a fall-back's NotRecovered without the exception it was raised in (a script's report)
    grower: GrowBack | None = None  # growing back after a recovery (mpiddp.elastic.grow), where the policy grows

    def refusal(self) -> str | None:  # a failure this policy does not recover from, in one line
        return None

    def before_shrink(self) -> None:  # note or stop what must be, before the shrink (the hang watchdog)
        pass

    def after_rebind(self, dist: Dist) -> None:  # follow the survivors before the state moves (a finish watch)
        pass

    def regrown(self) -> None:  # new ranks joined (mpiddp.elastic.grow): before the body runs again
        pass

    def fall_back(self, reason: str, ranks: tuple[int, ...]) -> NoReturn:
        self.engine.fall_back(reason, ranks)

    def bind(self, topology: Topology, verb: str = "goes on") -> None:
        """Every holder of the job's Dist now sees `topology` (after a grow: mpiddp.elastic.grow)."""
        bind_topology(self.dists, self.members, topology, self.guard, self.log_level, verb)


class Engine(Generic[OutcomeT]):
    """One per process; every method named collective is called by every survivor at the same point. `policy`:
    the user's (its hooks: mpiddp.elastic.hooks.RecoveryHooks), whose resume hands its settle an OutcomeT."""

    def __init__(self, members: Membership, dists: list[Dist], min_size: int, policy: Policy[OutcomeT]) -> None:
        self.members = members
        self.dists = dists  # the placed Dist first, then every other holder of the job's world (the guard's)
        self.min_size = min_size
        self.initial_world = dists[0].world_size  # a rank that joined a grown job: the first job's (its hello)
        self.policy = policy
        self.lost_in: Topology | None = None  # during a recovery: the world its lost ranks are numbered in
        policy.engine, policy.members, policy.dists = self, members, dists
        # a watch that ends the job from its thread (the finish watch, a hang's fallback) must end every rank: this
        # rank's exit alone would be a failure the others recover from (seen: a finish watch's end of the job
        # started a recovery on another rank that a finished rank never joined, and the job hung)
        set_end_everyone(lambda code: abort_within(members.comm, code))

    @classmethod
    def enable(cls, dists: list[Dist], collective_timeout_s: float, min_world_size: int | None,
               policy: Policy[OutcomeT], backend: str = "gloo", device: torch.device | None = None,
               ) -> Engine[OutcomeT]:
        """Collective, where in-job recovery can work (not `refused`): a Membership over the job's communicator
        (its process groups on `backend`, NCCL's on `device`), every Dist on a transport it watches.
        `min_world_size`: the fewest ranks the job goes on with (default MPIDDP_MIN_NP, which `launch --min-np`
        sets, else 1)."""
        dist = dists[0]
        members = Membership(dist.transport.comm, collective_timeout_s,  # type: ignore[attr-defined]
                             backend=backend, device=device)
        transport = WatchedTransport(members)  # a revoke reaches a rank blocked in a metric reduction too
        for each in dists:
            each.rebind(each.topology, transport, None)
        min_size = max(1, min_world_size or int(os.environ.get(MIN_NP_ENV) or 1))
        if dist.is_main:
            log.info("in-job recovery is on (MPI fault tolerance): a failed rank is left behind and the job goes on "
                     "with at least %d ranks", min_size)
        return cls(members, dists, min_size, policy)

    def run(self, body: Callable[[], T]) -> T:
        """Collective: `body()`, run again on the survivors after each recovery (and after a grow: Regrown)."""
        while True:
            lost: MembersLost | None = None
            try:
                return body()
            except Regrown:  # new ranks joined at a step boundary: the same body goes on with the new split
                pass
            except Exception as exc:
                lost = members_lost(self.members, exc)
                if lost is None:
                    raise
                # not the raised one: its traceback holds the failed call's frames, and with them its DDP wrapper
                lost = MembersLost(lost.ranks, lost.detected_at)
            # out of the except block: the exception and the frames of the body it ended are gone
            if lost is None:
                self.policy.regrown()
            else:
                self.recover(lost)

    def recover(self, lost: MembersLost) -> None:
        """Collective over the survivors: shrink, rebuild, the policy's resume and settle; NotRecovered (the job
        ends) where it cannot."""
        policy, dist = self.policy, self.dists[0]
        self.lost_in = dist.topology
        # detect: from this rank's last sign of life of the job (its last step, or the start of the collective
        # that failed) to MPI's report: an upper bound on the detection latency
        waited_from = max(self.members.waiting_since or 0.0, policy.alive_at()) or lost.detected_at
        if policy.grower is not None:  # also where the job ends now: a grow under way spans the old world
            policy.grower.members_lost(dist, lost.ranks, policy.records_dir())
        unless_end_decided(policy.records_dir(), lost.ranks)
        reason = policy.refusal()
        if reason is not None:
            self.fall_back(reason, lost.ranks)
        policy.before_shrink()
        before = dist.topology
        try:
            recovered = self.members.recover(self.min_size)
        except RecoveryFailed as exc:  # the shrink's account of who failed, where it got that far
            self.fall_back(str(exc), exc.failed or lost.ranks)
        mark_recovered()
        failed = recovered.failed_ranks
        bind_topology(self.dists, self.members, shrunk_topology(before, recovered.old_ranks_alive, recovered.rank),
                      policy.guard, policy.log_level)
        policy.after_rebind(dist)
        started = time.monotonic()
        try:
            phase, outcome = policy.resume(dist, before, failed)
        except (RuntimeError, mpi_error_of(self.members)) as exc:
            if isinstance(exc, NotRecovered):
                raise
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.fall_back(f"a second failure during recovery ({first_line})", failed)
        phases: Phases = {"detect": max(0.0, lost.detected_at - waited_from), **recovered.phases,
                  phase: time.monotonic() - started}
        policy.settle(before, failed, phases, outcome)
        self.lost_in = None

    def fall_back(self, reason: str, ranks: tuple[int, ...]) -> NoReturn:
        """One line why, then today's fail-fast path (FailFast aborts the job, recording `ranks` and their hosts as
        the failure; `launch` relaunches it without them). `ranks`: in a recovery, of the world that lost them
        (lost_in). Outside one (a grow's new ranks failing as they join) they are named in the message only, and
        FailFast's record says what MPI reports failed, as before."""
        log.error("in-job recovery not possible: %s; ending the job", reason)
        names = ", ".join(map(str, ranks)) or "?"
        now, world = self.dists[0].topology, self.lost_in
        known = [rank for rank in ranks if world is not None and 0 <= rank < world.world_size]
        hosts = tuple(dict.fromkeys(world.host_of(rank) for rank in known)) if world is not None else ()
        # once the survivors follow the shrunk job its new rank 0 rewrites the placement `launch` maps ranks with:
        # the lost ranks, of the old world, are then named by their hosts only
        error = NotRecovered(f"in-job recovery not possible: {reason} (MPI_ERR_PROC_FAILED: ranks {names} failed)",
                             tuple(known) if world is now else (), hosts)
        if self.policy.hide_cause:
            raise error from None
        raise error

    def say_reduced(self, first: bool) -> None:
        """On rank 0, after the first change of size: how far from full size the job runs."""
        if first and self.dists[0].is_main:
            log.warning("running at reduced size %d of %d ranks", self.dists[0].world_size, self.initial_world)
