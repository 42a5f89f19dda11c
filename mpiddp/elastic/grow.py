"""Growing back after an in-job recovery: new ranks join the survivors without stopping the job. Both sides side
by side: the survivors' (GrowBack: when to grow, spawn, merge, hand over the state) and the joining rank's
(join: merge, hello, process group, the state).

The mechanism is MPI's own (mpiddp.elastic.spawning): the survivors' shrunk communicator spawns the missing
ranks (`MPI_Comm_spawn`, onto the spare hosts mpirun was given beyond `-np`: its DVM has a daemon there), and the
parent/child intercommunicator is merged into one intracommunicator, survivors first, so every survivor keeps its
rank and the new ranks come last. Measured on four fake hosts under `mpirun --with-ft ulfm` (Open MPI 5.0.11),
after a Shrink: Spawn 1.1 s (the child's interpreter and MPI_Init), Merge 0.04 s. A spawned process that ends
without MPI_Finalize makes mpirun exit 1, so a grown rank finalises (the survivors still end with os._exit).

Where the spares come from: the job's hot spares (mpiddp.job.spares: MPIDDP_SPARE_RANKS, which `launch` sets for
its spare hosts), taken in without a spawn; else MPIDDP_SPARE_HOSTS (`host[:slots],...`), which a user of plain
mpirun sets beside `-H`, spawned onto. The failed host counts once it is named there again.

A grow takes two step boundaries, and the survivors train between them while the new ranks warm up:
  1. after a recovery (and one step at reduced size) the survivors spawn the missing ranks, merge them in after
     themselves and say hello (rank 0's topology and settings; every host name): a fraction of a second. Then
     they go back to training. Each new rank meanwhile imports torch, reads its config, loads its data and builds
     its model (the trainer's: mpiddp.trainer.join), then says it is ready to rank 0 (a message on the merged
     communicator).
  2. at each later boundary rank 0 looks (MPI_Test, no wait) and tells the survivors (one small broadcast); once
     every new rank is ready, rank 0 tells them to join, and both sides run the same collectives in the same
     order over the merged communicator: Membership + process group  ->  the state (what the user's policy hands
     over, from rank 0's memory; nothing from disk)  ->  DDP  ->  the loop (the survivors go on in their epoch,
     the new ranks enter it at the same batch), re-split at the same sample as a recovery does, the other way.
A grow under way is given up (the merged communicator revoked: the new ranks leave, exit 0) when a survivor
fails before it ends; a new rank that dies while warming up leaves the survivors as they were, said once.
Where growing cannot work (no spare slot, the spawn fails, the global batch does not split) rank 0 says why
once, and the job goes on at reduced size.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypedDict, TypeVar, cast

from mpiddp import failure
from mpiddp.elastic import spawning as mpigrow  # MPI's side of growing back: spawn, merge, the parent
from mpiddp.elastic.decide import GrowPlan, grow_due, grow_record, plan_growth, regrow_refusal, spare_hosts_in
from mpiddp.elastic.membership import JoinedStore, MembersLost, Membership, PreparedDups, mpi_error_of
from mpiddp.elastic.standin import StandInGroup, StandInTransport
from mpiddp.elastic.survivors import end_without_finalize, mark_recovered, recovered_in_this_process, topology_over
from mpiddp.errors import EXIT_HANG, ScriptError, ScriptExit
from mpiddp.job.spares import spare_world

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI
    from torch.distributed import Store

    from mpiddp.elastic.hooks import GrowHooks
    from mpiddp.job.collective import Dist
    from mpiddp.job.topology import Topology

log = logging.getLogger("mpiddp")
SplitT = TypeVar("SplitT")  # a policy's split of the grown job (hooks.GrowHooks)
# A spawn that has not returned by then never will (a spare lost during it: seen under the relay layout, where its
# daemon's loss no longer ends the job). A healthy one takes 0.2-3 s here; a cold start on a busy shared file
# system can take tens of seconds.
SPAWN_TIMEOUT_S = 60.0
# A grow given up at a survivor's failure keeps its spawn mark this long after (then launch no longer counts it as
# a spawn under way; a launcher that crashes later is still read as crashing after a spawn):
# Open MPI 5.0.11's prterun can lose a survivor's daemon in its own bookkeeping of the spawn (PRRTE 3.0's
# connect_release), the survivors notice that rank's end first, and prterun then ends the whole job, naming that
# healthy host (seen in CI, within a second). launch must read that end as the spawn's; a launcher that outlived
# the failure this long failed for other reasons.
SPAWN_MARK_HOLD_S = 30.0


# the merged communicator's tags between rank 0 and a new rank warming up (its only point-to-point messages)
# (LOST_TAG: never sent; under ULFM a receive on it completes, with an error, only when that rank fails)
READY_TAG, JOIN_TAG, LOST_TAG, HELLO_TAG = 7701, 7702, 7703, 7707
CONNECT_BOUND_S = 10.0  # a new rank's connect to rank 0's store: unreachable, the take-in builds a new store


class GrowerView(TypedDict):
    """The survivors' view of growing, which a joining rank takes over (GrowBack.joined)."""

    used: dict[str, int]  # spare slots taken by earlier grows, per host
    lost_after_grow: bool


class Hello(TypedDict):
    """Rank 0's first word to the new ranks: what they need before the process group."""

    topology: Topology  # rank 0's
    backend: str
    initial_world: int
    interface_per_host: dict[str, str]
    min_size: int
    collective_timeout_s: float
    grower: GrowerView  # this job's view of growing once they joined
    store: tuple[str, int] | None  # rank 0's store, which the new ranks connect to before the take-in (None: none yet)
    hostnames: list[str]  # every rank's host in the merged job, to hot spares (empty: a spawned rank gathers them)


# a new rank's word to rank 0 while it warms up: ("ready", its warm-up seconds, whether it holds a connection to rank
# 0's store) or ("failed", why)
Word = tuple[Any, ...]


class Speaker(Protocol):
    """Whoever says a line for the job: a Dist, or a survivor that knows whether it becomes rank 0."""

    @property
    def is_main(self) -> bool: ...


@dataclass(frozen=True)
class NextMain:
    """A survivor before the shrink: `is_main` when it becomes the shrunk job's rank 0 (it says the lines)."""

    is_main: bool


@dataclass(frozen=True)
class HeldStore:
    """A joining rank's one connection to rank 0's store (Membership.store), held as the bootstrap holds its own
    (Rendezvous.opened: what Rendezvous.client hands out)."""

    store: object


class Regrown(Exception):
    """New ranks joined the job at a step boundary: the epoch goes on with the new split."""


class Abandoned(Exception):
    """A new rank's grow was given up before it joined: a survivor failed, or the job ended, meanwhile."""


class CouldNotWarmUp(Abandoned):
    """A new rank's own warm-up failed: it told rank 0 and said why (cannot_warm_up)."""


class GivenUp(Abandoned):
    """The survivors gave this rank's grow up before it joined (they revoked it: a rank failed, or the job ended).
    A hot spare is healthy all the same: it waits again (wait_again)."""


@dataclass
class Warming:
    """A grow under way on the survivors: the new ranks were spawned and merged in, and warm up while the
    survivors train (mpiddp.elastic.grow's step 1 done, step 2 not yet)."""

    merged: MPI.Intracomm  # the merged intracommunicator: survivors first, then the new ranks
    plan: GrowPlan
    template: Topology  # rank 0's, as the new ranks got it in the hello
    hostnames: list[str]  # every rank's host in the merged job
    phases: dict[str, float]  # spawn, merge (the survivors' stand-still at step 1)
    stall: float  # this survivor's seconds stood still at step 1 (spawn, merge, hello)
    ready: list[MPI.Request]  # rank 0's receives of each new rank's Word
    lost: list[MPI.Request]  # rank 0's receives that complete (in error) only when a new rank fails (LOST_TAG)
    records: Path | None = None  # rank 0's failures directory, where the spawn's mark stands until the grow ends
    dups: PreparedDups | None = None  # the merged job's Membership's duplicates, made while the new ranks warm up
    said: dict[int, Word] = field(default_factory=dict)  # rank 0: each new rank's word, once it came

    def poll(self) -> str:
        """Rank 0, not collective: "ready" once every new rank said so (and none failed since), "warming"
        before; why not, when a new rank ended or could not warm up."""
        hosts, ended = ", ".join(self.plan.hosts), None
        try:
            for index, request in enumerate(self.ready):
                if index not in self.said:
                    done, word = request.test()
                    if done:
                        self.said[index] = cast(Word, word)
            for request in self.lost:
                request.test()  # nothing is ever sent on LOST_TAG: it can only fail
        except mpigrow.mpi_exception() as exc:
            ended = f"a new rank on {hosts} ended while warming up ({str(exc).splitlines()[0]})"
        failed = [word[1] for word in self.said.values() if not (isinstance(word, tuple) and word[0] == "ready")]
        if failed:  # its own word why, before MPI's report of its end
            return f"a new rank on {hosts} could not warm up ({failed[0]})"
        if ended is not None:
            return ended
        return "ready" if len(self.said) == len(self.ready) else "warming"

    def warm_up(self) -> float | None:
        """The slowest new rank's own warm-up seconds, as it said when ready."""
        seconds = [float(word[1]) for word in self.said.values() if isinstance(word, tuple) and word[0] == "ready"]
        return max(seconds) if seconds else None

    def on_store(self) -> bool:
        """Rank 0: whether every new rank said it connected to rank 0's store (then the grown job's group is built
        on it, under a prefix; otherwise on a fresh store, as at a recovery)."""
        return all(isinstance(word, tuple) and len(word) > 2 and word[2] for word in self.said.values())

    def stop_watching(self) -> None:
        for request in self.lost:
            try:
                request.Cancel()
            except Exception:  # noqa: BLE001 - completed (in error) already
                pass


# ---- the survivors' side -------------------------------------------------------------------------------------------

class GrowBack:
    """The survivors' side: when to grow, and the grow itself (collective over the survivors). `recovery` is a
    user's elastic policy bound to its engine (mpiddp.elastic.hooks.GrowHooks: the trainer's or a script's): its
    engine, members and dists, and the steps a grow asks of it (grow_split, spawn_command, pause_watch,
    follow_watch, handover, bind, rewrap_grown, grown, fall_back). `grown` gets the monotonic time of the step
    boundary where the survivors stopped: their stand-still (`survivors_stall`) runs from there to their next step's
    end."""

    def __init__(self, spares: list[tuple[str, int]], off: str | None = None) -> None:
        self.spares = spares
        self.used: dict[str, int] = {}  # spare slots taken by earlier grows
        self.off = off  # why the job does not grow (said once), None while it may
        self.warming: Warming | None = None  # a grow under way: its new ranks warm up while the survivors train
        self.grew = False  # new ranks joined this job
        self.lost_after_grow = False  # a rank was lost after new ranks joined (decide.regrow_refusal)
        self.hot = False  # the spares are hot (mpiddp.job.spares): taken in without a spawn
        # hot: the spares of a grow given up ((spares' world rank, host)), until each waits again or has failed
        self.returning: list[tuple[int, str]] = []
        self.said_returning = False  # rank 0 said once that growing back waits for them
        self.pinged: mpigrow.Pings | None = None  # hot, rank 0: the spares asked to answer a step before a grow

    @classmethod
    def from_env(cls) -> GrowBack:
        """Hot spares where the job has them (mpiddp.job.spares), else the spare hosts named for MPI_Comm_spawn."""
        hot = spare_world()
        if hot is not None:
            grower = cls(hot.spare_hosts())
            grower.hot = True
            return grower
        spares = spare_hosts_in(os.environ)
        return cls([], spares) if isinstance(spares, str) else cls(spares)

    def at_boundary(self, recovery: GrowHooks[SplitT]) -> None:
        """Collective, at each training step's boundary: grow when due; Regrown when new ranks joined."""
        dist = recovery.dists[0]
        if self.warming is not None:
            return self._take_in_when_ready(recovery)
        if not grow_due(recovery.stepped_since_change, dist.world_size, recovery.engine.initial_world, self.said_off):
            self._ping_ahead(dist, recovery.engine.initial_world)
            return
        stopped = time.monotonic()  # the survivors' stand-still starts here: the plan (its ping) is part of it
        if self.off is not None:  # the spare hosts could not be read: said once, when it matters
            return self.stop_growing(dist, self.off)
        if self.returning and self.settle_returning(dist):  # a wake now would wait for them in the world's shrink
            return None
        decision = dist.transport.bcast(self.plan(dist, recovery.engine.initial_world) if dist.is_main else None)
        if decision is None:  # not at this boundary
            return None
        if isinstance(decision, str):
            return self.stop_growing(dist, decision)
        split = recovery.grow_split(dist.world_size, dist.world_size + decision.count)
        if isinstance(split, str):
            return self.stop_growing(dist, split)
        self.start(recovery, decision, stopped)  # where the split is None, they warm up while the job reaches one

    def _ping_ahead(self, dist: Dist, full: int) -> None:
        """Rank 0, not collective, at the boundary before a grow is due (a recovery left the job below full size and
        it has not stepped since): ask the hot spares to answer now, so that the plan at the next boundary finds
        their answers there instead of waiting a round trip with every survivor."""
        if self.hot and dist.is_main and self.pinged is None and dist.world_size < full and not self.said_off \
                and self.off is None and self.warming is None:
            self.pinged = mpigrow.ping_spares()

    def settle_returning(self, dist: Dist) -> bool:
        """Collective over the survivors, while hot spares of a grow given up are on their way back: rank 0 says
        which wait again (taken back by every survivor) and which failed (forgotten). Whether any is still on its
        way: every live process of the spares' world takes part in a wake's shrink, so a wake would wait for it."""
        back, gone = dist.transport.bcast(mpigrow.returned_or_gone([rank for rank, _ in self.returning])
                                          if dist.is_main else None)
        for rank, host in self.returning:
            if rank in back:
                mpigrow.take_back(rank, host)
        self.returning = [(rank, host) for rank, host in self.returning if rank not in back and rank not in gone]
        if self.returning and dist.is_main and not self.said_returning:  # a local log line, no collective
            log.warning("growing back waits until the hot spare of the grow given up waits again (once its warm-up "
                        "is over); the job goes on with %d ranks", dist.world_size)
            self.said_returning = True
        if not self.returning:
            self.said_returning = False
        return bool(self.returning)

    def how(self, plan: GrowPlan) -> str:
        """What growing back by `plan` does, for the lines that say it failed."""
        hosts = ", ".join(plan.hosts)
        return f"taking in the hot spare on {hosts}" if self.hot else f"MPI_Comm_spawn onto {hosts}"

    def plan(self, dist: Dist, full: int) -> GrowPlan | str | None:
        """Rank 0's decision (broadcast: every rank follows it, a rank that joined by a grow too): the plan, why
        not, or None for not yet."""
        if self.hot:  # the live spares waiting: one taken, or failed, is gone
            live = mpigrow.live_spare_hosts()
            if not live and dist.world_size < full:
                return "no hot spare is left (each was taken in, or has failed)"
            silent, self.pinged = mpigrow.silent_spares(asked=self.pinged), None
            if silent:  # a wake would wait for it in MPI, up to the grow's bound, which ends the job
                return (f"the hot spare on {', '.join(sorted(set(silent)))} does not answer within "
                        f"{mpigrow.PING_S:g} s (stopped, or its host silent)")
            return plan_growth(dist.world_size, full, live, {})
        refusal = regrow_refusal(mpigrow.library_version(), self.lost_after_grow)
        return refusal if refusal is not None else plan_growth(dist.world_size, full, self.spares, self.used)

    def hello(self, dist: Dist, recovery: GrowHooks[SplitT], plan: GrowPlan) -> Hello:
        """Rank 0's first word to the new ranks, with this job's view of growing once they joined."""
        used = dict(self.used)
        for host in plan.hosts:
            used[host] = used.get(host, 0) + 1
        return hello_of(dist, recovery, {"used": used, "lost_after_grow": self.lost_after_grow})

    def joined(self, state: GrowerView) -> None:
        """A rank that joined by a grow: the survivors' view of growing (hello's "grower"), as if it had been one."""
        self.used, self.lost_after_grow, self.grew = dict(state["used"]), bool(state["lost_after_grow"]), True

    @property
    def said_off(self) -> bool:
        return self.off == "said"

    @property
    def offered(self) -> bool:
        """Whether the job was given spare hosts (or named them wrongly) and has not said why it does not grow."""
        return bool(self.spares) or (self.off is not None and not self.said_off)

    def give_up_spares(self) -> None:
        """The job released its hot spares while it runs on (a loop that never grows back: said once, at start-up):
        nothing more is tried, nor said, about growing back."""
        self.spares, self.off = [], "said"

    def stop_growing(self, dist: Dist, reason: str) -> None:
        if dist.is_main:  # a local log line, no collective
            log.warning("not growing back: %s; the job goes on with %d ranks", reason, dist.world_size)
        self.off = "said"

    def start(self, recovery: GrowHooks[SplitT], plan: GrowPlan, stopped: float | None = None) -> None:
        """Collective over the survivors, step 1: spawn, merge and hello; the new ranks then warm up while the
        survivors train. When the spawn fails, one line on rank 0 and the job goes on at reduced size."""
        members, dist = recovery.members, recovery.dists[0]
        mpi_error = mpi_error_of(members)
        step, stalled_from = recovery.steps_done(), stopped if stopped is not None else time.monotonic()
        recovery.pause_watch()
        # launch's evidence that a launcher failing now failed during the spawn (Open MPI 5.0.11's prterun can
        # crash in MPI_Comm_spawn), which says nothing against the hosts spawned onto
        records = recovery.records_dir() if dist.is_main else None
        if not self.hot:  # a hot spare is taken in without the launcher
            failure.mark_spawning(records, list(plan.hosts))
        try:
            with bounded(SPAWN_TIMEOUT_S, lambda: spawn_stuck(dist, self.how(plan), records, step)):
                merged, phases = (mpigrow.wake_and_merge(members.comm, plan) if self.hot else
                                  mpigrow.spawn_and_merge(members.comm, plan, recovery.spawn_command(),
                                                          members.spanning))
            if merged is None:  # a hot spare planned for failed unnoticed: the next plan leaves it out
                recovery.follow_watch(dist)
                if dist.is_main:
                    log.warning("not growing back now: the hot spare on %s had failed; the job goes on with %d ranks "
                                "and grows onto a live spare at a later step, if one is left", ", ".join(plan.hosts),
                                dist.world_size)
                return
        except mpi_error as exc:  # the mark stays: the launcher may be failing (its daemon lost)
            recovery.follow_watch(dist)
            self.stop_growing(dist, f"{self.how(plan)} failed ({str(exc).splitlines()[0]})")
            return
        try:
            hostnames, template = self._say_hello(dist, recovery, plan, merged)
            dups = prepared_dups(merged, self.hot)  # done by the take-in: the steps' calls between complete them
        except mpi_error as exc:  # a new rank died at once: nothing else changed (a survivor lost: recovered next)
            failure.spawned(records)
            mpigrow.revoke(merged)
            recovery.follow_watch(dist)
            self.stop_growing(dist, f"a new rank on {', '.join(plan.hosts)} ended as it started "
                                    f"({str(exc).splitlines()[0]})")
            return
        new_ranks = range(dist.world_size, dist.world_size + plan.count)
        ready = [merged.irecv(source=rank, tag=READY_TAG) for rank in new_ranks] if dist.is_main else []
        lost = [merged.irecv(source=rank, tag=LOST_TAG) for rank in new_ranks] if dist.is_main else []
        now = time.monotonic()
        # the spawn mark stays until the new ranks joined or were given up: Open MPI 5.0.11's prterun also crashes
        # after MPI_Comm_spawn returned (seen: "free(): invalid pointer" while the new rank warmed up)
        self.warming = Warming(merged, plan, template, hostnames, phases, now - stalled_from, ready, lost, records,
                               dups)
        for host in plan.hosts:  # taken while it warms up: a grow given up frees it again
            self.used[host] = self.used.get(host, 0) + 1
        recovery.follow_watch(dist)
        if dist.is_main:
            started = ("woken", "wake") if self.hot else ("started", "spawn")  # a hot spare runs already
            log.warning("growing back: ranks %s %s on %s (%s %.3f s, merge %.3f s); they warm up while the job "
                        "trains on %d ranks", list(new_ranks), started[0], ", ".join(plan.hosts), started[1],
                        phases["spawn"], phases["merge"], dist.world_size)

    def _say_hello(self, dist: Dist, recovery: GrowHooks[SplitT], plan: GrowPlan, merged: MPI.Intracomm,
                   ) -> tuple[list[str], Topology]:
        """Collective over the merged job, step 1's last part: rank 0's hello to the new ranks; every host of the
        merged job and a topology of the job (the launcher's settings) for the take-in. A hot spare's host is the
        one the job planned for: every survivor knows every host, and rank 0 alone tells the new ranks (a
        broadcast and a gather over the merged job were 0.01-0.03 s of the survivors' stand-still). A spawned
        rank's host is its own word (the launcher's name for a host may not be the host's)."""
        if self.hot:
            hostnames = [dist.topology.host_of(rank) for rank in range(dist.world_size)] + list(plan.hosts)
            if dist.is_main:
                hello = {**self.hello(dist, recovery, plan), "hostnames": hostnames}
                for rank in range(dist.world_size, dist.world_size + plan.count):
                    merged.send(hello, dest=rank, tag=HELLO_TAG)
            return hostnames, dist.topology
        hello = merged.bcast(self.hello(dist, recovery, plan) if dist.is_main else None, root=0)
        return merged.allgather(dist.topology.hostname), hello["topology"]

    def _take_in_when_ready(self, recovery: GrowHooks[SplitT]) -> None:
        """Collective over the survivors, step 2: rank 0 looks whether every new rank is ready (no wait) and says
        so in one small broadcast; Regrown once they joined. A new rank that ended meanwhile is given up."""
        warming, dist = self.warming, recovery.dists[0]
        assert warming is not None
        word, warm_up, store_prefix = cast(
            "tuple[str, float | None, str | None]",
            dist.transport.bcast((warming.poll(), warming.warm_up(), self._store_prefix(recovery, warming))
                                 if dist.is_main else None))
        if word == "warming":
            return
        if word != "ready":
            self.abandon()
            return self.stop_growing(dist, word)
        split = recovery.grow_split(dist.world_size, dist.world_size + warming.plan.count)
        if isinstance(split, str):
            self.abandon()
            return self.stop_growing(dist, split)
        if split is None:  # not at this position (the trainer's: at the next epoch's start it is)
            return
        self.take_in(recovery, split, warm_up, store_prefix)
        raise Regrown()

    @staticmethod
    def _store_prefix(recovery: GrowHooks[SplitT], warming: Warming) -> str | None:
        """Rank 0: where the grown job's process group keeps its keys in rank 0's store (unique to this take-in);
        None where a new rank could not connect to it, or no store was built since the job started (then a new
        one is, as at a recovery)."""
        if recovery.members.endpoint is None or not warming.on_store():
            return None
        return f"grown-{uuid.uuid4().hex[:12]}/"

    def take_in(self, recovery: GrowHooks[SplitT], split: SplitT, warm_up: float | None = None,
                store_prefix: str | None = None) -> None:
        """Collective over the merged job, step 2: tell the new ranks to join (and where the process group's keys
        go in rank 0's store: `store_prefix`), then the process group, the state and the wrapper. A new rank that
        fails while joining ends the job (fall_back: one line, then fail fast; `launch` relaunches)."""
        warming, members, dist = self.warming, recovery.members, recovery.dists[0]
        assert warming is not None
        self.warming = None
        warming.stop_watching()
        mpi_error = mpi_error_of(members)
        before, step, stalled_from = dist.world_size, recovery.steps_done(), time.monotonic()
        phases = dict(warming.phases)
        recovery.pause_watch()
        joining = tuple(range(before, before + warming.plan.count))
        try:
            if dist.is_main:
                for rank in joining:
                    warming.merged.send(store_prefix, dest=rank, tag=JOIN_TAG)
            self._join(recovery, warming, split, phases, store_prefix)
        except (mpi_error, MembersLost, RuntimeError, pickle.UnpicklingError, EOFError) as exc:
            # a new rank died while joining: a reduction over the merged job can even return garbage (ULFM)
            recovery.fall_back(f"a new rank failed while joining on {', '.join(warming.plan.hosts)} "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", joining)
        failure.spawned(warming.records)
        self.grew = True
        recovery.follow_watch(dist)
        record = grow_record(step, list(joining), list(warming.plan.hosts), before, dist.world_size, phases)
        record["warm_up"] = warm_up  # the new ranks' own (rank 0's word): the take-in waits for a boundary after it
        # the survivors' stand-still: step 1's, and step 2's from its boundary to the next step's end (the policy's)
        recovery.grown(record, split, stalled_from - warming.stall)

    def members_lost(self, dist: Dist, lost: tuple[int, ...], records: Path | None) -> None:
        """Every survivor, at a recovery, before the shrink (not collective): a grow under way is given up (its
        merged communicator numbers the old world), said by the survivor that becomes rank 0; once the job has
        grown (or spawned), what it may do later changes (regrow_refusal). That survivor also has the spawn's mark
        in `records` stand SPAWN_MARK_HOLD_S more (rank 0 wrote it, and may be the one lost): the failure may be
        the launcher's own, in the spawn."""
        self.lost_after_grow = self.lost_after_grow or self.grew or self.warming is not None
        if self.warming is None:
            return
        next_main = min(rank for rank in range(dist.world_size) if rank not in lost) == dist.rank
        self.abandon(NextMain(next_main),
                     f"ranks {', '.join(map(str, lost))} of the job failed while they warmed up", keep_mark=True)
        if next_main:  # a local write, no collective
            failure.hold_spawning(records, SPAWN_MARK_HOLD_S)

    def finished_while_warming(self, dist: Speaker) -> None:
        """Every survivor, not collective, once every rank finished a script: a grow whose new ranks still warm up
        never joins. A new rank learns it only when it comes to join (its warm-up, the script's own start, makes
        no MPI call of mpiddp's), and mpirun waits for it until then: rank 0 says so, so that a job that lingers
        after its last line is understood. The merged communicator is left as it is (a revoke would fail a hot
        spare's pending duplicates, and Open MPI prints that as errors on a job that succeeded)."""
        if self.warming is not None and dist.is_main:
            log.warning("the job finished while the new ranks on %s still warm up (the script's start): they leave "
                        "when they come to join, and mpirun ends then", ", ".join(self.warming.plan.hosts))

    def abandon(self, dist: Speaker | None = None, why: str = "", keep_mark: bool = False,
                job_ends: bool = False) -> None:
        """Every survivor, not collective: give up the grow under way (a survivor failed, the job ends, a new rank
        ended); rank 0 of `dist` says `why` where given. Revoking the merged communicator wakes every new rank
        waiting on it, which then leaves; its spare slot is free again. The spawn's mark goes unless `keep_mark`.
        `job_ends`: the job's end gives it up, so a hot spare, too, leaves (the workers' end releases it) rather
        than wait again for a grow that will not come."""
        warming, self.warming = self.warming, None
        if warming is None:
            return
        if dist is not None and dist.is_main and why:
            then = ("the new ranks on %s leave" if not self.hot else
                    "the hot spares on %s leave with the job" if job_ends else "the hot spares on %s wait again")
            log.warning("growing back given up: %s; " + then, why, ", ".join(warming.plan.hosts))
        for host in warming.plan.hosts:
            self.used[host] -= 1
        if self.hot:  # after their warm-up they see the revoke (their `enter`) and wait again (back_to_waiting)
            self.returning += list(zip(mpigrow.spares_of(warming.merged, warming.plan.count), warming.plan.hosts))
        if not keep_mark:
            failure.spawned(warming.records)
        warming.stop_watching()
        mpigrow.revoke(warming.merged)
        if warming.dups is not None:
            warming.dups.free()

    @staticmethod
    def _join(recovery: GrowHooks[SplitT], warming: Warming, split: SplitT, phases: dict[str, float],
              store_prefix: str | None) -> None:
        """Collective over the merged job (the survivors' half of `join`'s step 2): the process group, the state,
        the topology, the wrapper again."""
        members, dist = recovery.members, recovery.dists[0]
        phases["process_group"] = members.adopt(warming.merged, warming.dups, store_prefix)
        started = time.monotonic()
        if dist.is_main:  # to the new ranks alone: the other survivors would unpickle it for nothing, in the tree
            members.send_large(recovery.handover(split), range(dist.world_size, members.comm.Get_size()))
        phases["state_transfer"] = time.monotonic() - started
        recovery.bind(topology_over(warming.template, warming.hostnames, members.comm.Get_rank()), "stays")
        started = time.monotonic()
        recovery.rewrap_grown(split, dist)
        phases["ddp"] = time.monotonic() - started


def prepared_dups(merged: MPI.Intracomm, hot: bool) -> PreparedDups | None:
    """Collective over the merged job, both sides as a grow's new ranks arrive: its Membership's duplicates started
    (PreparedDups) for hot spares alone, else None. A spawned rank's merged communicator spans two MPI jobs, where
    Open MPI 5.0.11 allocates a communicator's id through PMIx; an MPI_Comm_idup there that fails (a survivor lost,
    or the job ended, during the warm-up) corrupts the new rank's heap ("free(): invalid pointer" in its next MPI
    call; reproduced on its own, 4 of 4, and the job then never ended). Its take-in duplicates at once instead."""
    return PreparedDups.start(merged) if hot else None


@contextmanager
def bounded(seconds: float, on_timeout: Callable[[], None]) -> Iterator[None]:
    """Run the block; if it has not ended after `seconds`, `on_timeout` runs on a helper thread (it ends the
    process: nothing can interrupt an MPI call in progress)."""
    done = threading.Event()
    timer = threading.Thread(target=lambda: done.wait(seconds) or on_timeout(), name="mpiddp-spawn-timer",
                             daemon=True)
    timer.start()
    try:
        yield
    finally:
        done.set()


def spawn_stuck(dist: Dist, how: str, records: Path | None, step: int | None) -> None:
    """The grow (`how`: GrowBack.how) never returned: a spare whose host or MPI daemon died during MPI_Comm_spawn
    (PRRTE then waits for it forever), or a process lost between a hot spare's shrink and its group. The survivors
    cannot leave the call: each ends its process; rank 0 says why and records it (a hang that blames no host: the
    spare's relaunch start finds out), which also tells launch, whose mpirun waits for the spawn forever, that the
    job is over while its spawn mark stands."""
    if dist.is_main:
        message = (f"{how} has not returned after {SPAWN_TIMEOUT_S:g} s (a host or an MPI daemon gone?); the "
                   "survivors cannot leave the call")
        sys.stderr.write(f"mpiddp: growing back: {message}: ending the job (launch relaunches it)\n")
        if records is not None:
            failure.write_rank(records, dist.rank, failure.FailureRecord(
                "hang", [], [], message, step=step, rank=dist.rank, status=EXIT_HANG, progressed=True))
    dist.abort_from_thread(EXIT_HANG)


def say_grown(dist: Dist, initial_world: int, record: dict[str, Any], how: str) -> None:
    """Rank 0's line for a grow (`how`: how the job goes on, its split), and, back at full size, one more."""
    if not dist.is_main:
        return
    phases = record["phases"]
    log.warning("grew back: ranks %s joined on %s after warming up %.3f s while the job trained; %d ranks go on %s; "
                "spawn %.3f s, merge %.3f s, process group %.3f s, state transfer %.3f s, DDP %.3f s",
                record["ranks_added"], ", ".join(record["hosts_added"]), record.get("warm_up") or 0.0,
                dist.world_size, how, phases["spawn"], phases["merge"], phases["process_group"],
                phases["state_transfer"], phases["ddp"])
    if dist.world_size >= initial_world:
        log.warning("running at full size again: %d ranks", dist.world_size)


def hello_of(dist: Dist, recovery: GrowHooks[SplitT], grower: GrowerView) -> Hello:
    """Rank 0's first word to the new ranks: what they need before the process group, and `grower`."""
    rendezvous = dist.rendezvous
    return {"topology": dist.topology, "backend": recovery.members.backend, "initial_world": recovery.engine.initial_world,
            "interface_per_host": dict(rendezvous.interface_per_host) if rendezvous else {},
            "min_size": recovery.engine.min_size, "collective_timeout_s": recovery.members.collective_timeout_s,
            "grower": grower, "store": recovery.members.endpoint, "hostnames": []}


# ---- the joining rank's side ---------------------------------------------------------------------------------------

@dataclass
class Joining:
    """A new rank's view of the job it joined (the joining half of GrowBack._join, up to the state)."""

    members: Membership
    hello: Hello  # rank 0's
    topology: Topology  # this rank's in the grown job
    device: torch.device  # this rank's: its GPU where the job runs on NCCL, as the survivors' bootstrap chose
    added: tuple[list[int], list[str], int, int]  # (new ranks, their hosts, world before, world after)
    phases: dict[str, float | None]


def joining() -> bool:
    """Whether this process was spawned by a job growing back (it has an MPI parent). Initialises MPI."""
    return mpigrow.joining()


@dataclass
class Arrival:
    """A new rank after step 1 of a grow (merged in, hello heard): what it needs to warm up on its own."""

    merged: MPI.Intracomm
    hello: Hello  # rank 0's
    topology: Topology  # this rank's in the grown job
    hostnames: list[str]
    device: torch.device  # this rank's (joining_device)
    since: float  # monotonic time step 1 ended: this rank's warm-up runs from here
    dups: PreparedDups | None = None  # its Membership's duplicates of `merged`, made as it arrived

    def leave(self) -> None:
        """Its grow given up before it joined: every communicator it shares with the survivors freed (a spawned
        rank's MPI_Finalize would wait on them)."""
        if self.dups is not None:
            self.dups.free()
        mpigrow.leave(self.merged)


def arrive() -> Arrival:
    """Collective over the merged job, step 1 (the survivors' GrowBack.start): merge, hello, every host's name;
    then this rank's device (local). The survivors go back to training: what follows until `enter` is this rank's
    own warm-up."""
    try:
        merged = mpigrow.merge_with_parent()
    except mpigrow.SpareReleased as exc:  # a hot spare never needed
        mpigrow.end_released_spare()
        raise Abandoned(f"this hot spare was not needed: {exc}") from None
    except mpigrow.mpi_exception() as exc:  # a hot spare's shrink or group failed (a rank lost meanwhile)
        mpigrow.end_released_spare()
        raise Abandoned(f"the job's grow onto this hot spare failed ({str(exc).splitlines()[0]})") from None
    if mpigrow.is_hot_spare():  # of the job that lost a rank: it ends as the survivors do, without MPI_Finalize
        mark_recovered()
    try:
        if mpigrow.is_hot_spare():  # rank 0's word alone (GrowBack._say_hello)
            hello = merged.recv(source=0, tag=HELLO_TAG)
            hostnames = hello["hostnames"]
        else:
            hello = merged.bcast(None, root=0)
            hostnames = merged.allgather(own_host())
        # its Membership's duplicates, started now: they progress in every MPI call on each side (the survivors'
        # steps, this rank's word that it is ready and its wait for rank 0's), and are done, or nearly, by the
        # take-in. Not waited for here: the survivors may be stopped (SIGSTOP) or in a long step meanwhile
        dups = prepared_dups(merged, mpigrow.is_hot_spare())
    except mpigrow.mpi_exception() as exc:  # the survivors gave the start up (revoked), or one of them failed
        mpigrow.leave(merged)
        raise GivenUp(f"the job gave up this rank's grow as it started ({str(exc).splitlines()[0]})") from None
    point_gloo_at(hello["interface_per_host"], hello["topology"].hostname)
    topology = topology_over(hello["topology"], hostnames, merged.Get_rank())
    device = joining_device(hello["backend"], topology)
    return Arrival(merged, hello, topology, hostnames, device, time.monotonic(), dups)


def enter(arrival: Arrival) -> Joining:
    """Step 2, once this rank is warm: say so to rank 0, wait for its word to join (the survivors take it in at a
    step boundary), then, collective over the merged job, the process group on the survivors' backend.
    Abandoned (the merged communicator freed) when the grow was given up meanwhile: the survivors revoked it, or
    rank 0 ended."""
    merged, hello, topology, device = arrival.merged, arrival.hello, arrival.topology, arrival.device
    warm_torch()
    warm = time.monotonic() - arrival.since
    # a warning, as every rank's recovery lines are: a new rank is never rank 0, whose lines alone show at info
    given_up = merged.Is_revoked()  # rank 0 ended, or a recovery gave the grow up: the send below says so at once
    log.warning("grow: warm in %.3f s; %s", warm, "the job gave this grow up meanwhile" if given_up else
                "the job takes this rank in at its next step boundary")
    # after the line above (a test's hold stops the survivors until it)
    store = None if given_up else connect_store(arrival)
    try:
        merged.send(("ready", warm, store is not None), dest=0, tag=READY_TAG)
        store_prefix = merged.recv(source=0, tag=JOIN_TAG)
    except mpigrow.mpi_exception() as exc:
        arrival.leave()
        raise GivenUp(f"the job gave up this rank's grow before it joined ({str(exc).splitlines()[0]}): a rank "
                        "failed, or the job ended, meanwhile") from None
    started = time.monotonic()
    # the survivors adopt the merged job on their own backend (Membership.adopt): NCCL on GPUs, so must this rank
    members = Membership(merged, hello["collective_timeout_s"], backend=hello["backend"],
                         device=device if device.type == "cuda" else None,
                         spanning=mpigrow.spanning_of_joined(merged), prepared=arrival.dups)
    joined = None
    if store_prefix is not None:  # rank 0 chose its store: this rank said it connected (its ready word)
        assert store is not None and hello["store"] is not None
        joined = JoinedStore(store, hello["store"], store_prefix)
    members.start_process_group(joined)
    phases: dict[str, float | None] = {"process_group": time.monotonic() - started}
    before = hello["topology"].world_size
    hostnames = arrival.hostnames
    added = (list(range(before, len(hostnames))), list(hostnames[before:]), before, len(hostnames))
    return Joining(members, hello, topology, device, added, phases)


def connect_store(arrival: Arrival) -> Store | None:
    """A new rank, warm, before it says so: its client of rank 0's store (the hello's), where the grown job's
    process group will keep its keys; connected now, while the survivors train, not at the take-in. None where rank
    0 had no store to offer, the grow was given up meanwhile (MPI says so while it connects), or the store cannot
    be reached within CONNECT_BOUND_S (rank 0 stopped, the network): rank 0 then builds a fresh one at the take-in,
    as before."""
    import torch.distributed as tdist

    hello = arrival.hello
    if hello.get("store") is None:
        return None
    address, port = hello["store"]
    timeout = timedelta(seconds=hello["collective_timeout_s"])
    made: list[Store | BaseException] = []

    def connect() -> None:
        try:
            made.append(tdist.TCPStore(address, port, arrival.topology.world_size, False,
                                       timeout=min(timeout, timedelta(seconds=CONNECT_BOUND_S))))
        except Exception as exc:  # noqa: BLE001 - torch's DistStoreError, an OSError: said below
            made.append(exc)

    # on a thread, with a deadline: a client's handshake with a stopped rank 0 (SIGSTOP: its socket open) waits in
    # recv whatever the store's timeout (measured); a thread left waiting there holds nothing of this rank's. And
    # meanwhile MPI is asked whether the grow still stands: this rank made no MPI call during its warm-up, so a
    # grow given up then (rank 0 dead, its store refusing: torch retries until its timeout) is learnt only now
    connecting = threading.Thread(target=connect, name="mpiddp-grow-store", daemon=True)
    connecting.start()
    deadline = time.monotonic() + CONNECT_BOUND_S
    while connecting.is_alive() and time.monotonic() < deadline:
        try:
            arrival.merged.Iprobe(source=0, tag=JOIN_TAG)  # progresses MPI: a failed rank 0, a revoke, raise here
            if arrival.merged.Is_revoked():
                return None  # given up: the ready word says so at once (GivenUp)
        except mpigrow.mpi_exception():
            return None
        connecting.join(0.05)
    if not made or isinstance(made[0], BaseException):
        why = f"no answer within {CONNECT_BOUND_S:g} s" if not made else str(made[0]).splitlines()[0]
        log.warning("grow: rank 0's store at %s:%d cannot be reached (%s): the take-in builds a new one", address,
                    port, why)
        return None
    made[0].set_timeout(timeout)
    return made[0]


def warm_torch() -> None:
    """What torch loads on first use and a script's first optimizer and DDP wrapper would load after this rank
    joined, while the survivors wait for it: loaded now, while they train. torch builds its first optimizer after
    importing its compiler (torch._dynamo: 0.9 s of a 1.0 s stand-still measured here at a step loop's take-in)."""
    import torch
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def cannot_warm_up(arrival: Arrival, exc: BaseException | str) -> None:
    """A new rank whose warm-up failed (its data missing on the spare host, an import, its GPU; `exc`, or why in
    words): it says why to rank 0 (the survivors go on at reduced size and say it once) and frees what it shares
    with them, so that it can end (status 0: the job is not failed by a spare that could not join)."""
    reason = exc if isinstance(exc, str) else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    log.error("grow: this rank could not warm up (%s); the job goes on without it", reason)
    try:
        arrival.merged.send(("failed", reason), dest=0, tag=READY_TAG)
    except mpigrow.mpi_exception():
        pass  # the job ended or gave the grow up meanwhile
    arrival.leave()


def arrive_waiting() -> Arrival:
    """`arrive`, again for a hot spare whose grow was given up as it started (wait_again). Abandoned otherwise."""
    while True:
        try:
            return arrive()
        except GivenUp as exc:
            if not wait_again(exc):
                raise


class LateJoin:
    """A script's new rank from its arrival to its first step (mpiddp.script): the script's own start (imports,
    data, the model, a compile, its first iteration alone) runs while the survivors train, and only its first
    step (the step loop's clock, or run_recoverable) says ready and joins (`enter`), so the survivors stand still
    for the take-in alone, never for the script. Until then torch's default group and the Dist are stand-ins at
    this rank's place in the grown job (mpiddp.elastic.standin). A script that fails or ends before its first step
    ends this rank alone (`end`): rank 0 hears why and the job goes on without it."""

    def __init__(self, arrival: Arrival) -> None:
        self.arrival = arrival
        self.joining: Joining | None = None  # once it joined
        self._group = StandInGroup()

    @property
    def joined(self) -> bool:
        return self.joining is not None

    def stand_in(self, num_threads: int) -> Dist:
        """The Dist the script holds: this rank's place in the grown job, its collectives stand-ins until the join
        rebinds it (survivors.bind_topology); torch's default group the stand-in, torchrun's variables exported
        (the store's address follows at the join)."""
        from mpiddp.job.bootstrap import export_environment
        from mpiddp.job.collective import Dist, Rendezvous

        hello, topology, device = self.arrival.hello, self.arrival.topology, self.arrival.device
        transport = StandInTransport(topology.rank, topology.world_size, self._end_now)
        dist = Dist(topology, transport, device.type, device.index, hello["backend"],
                    Rendezvous("", 0, hello["interface_per_host"]), num_threads)
        self._group.install(topology.rank, topology.world_size)
        export_environment(topology, "", 0)
        return dist

    def enter(self) -> Joining:
        """This rank's first step: the stand-ins go, then `enter` (ready, rank 0's word, the process group).
        A hot spare whose grow was given up meanwhile (a rank failed while it ran the script's start) is healthy
        and warm: it waits again among the spares, its start done, and joins at the grow that wakes it next, at
        the place that grow gives it (the membership change says it). A script cannot run twice in one process:
        ending here would lose the spare for the rest of the job."""
        if self.joining is None:
            self._group.remove()
        while self.joining is None:
            try:
                self.joining = enter(self.arrival)
            except GivenUp as exc:
                if not wait_again(exc):
                    raise
                self.arrival = arrive_waiting()  # Abandoned when the job ended meanwhile: this rank ends (`end`)
        return self.joining

    def end(self, exc: BaseException | None) -> NoReturn:
        """The script raised (`exc`) or ended before its first step, or its grow was given up (Abandoned): one
        line, rank 0 hears why, and this process ends (status 0: the job is not failed by a spare that could not
        join), as a spawned rank must (MPI_Finalize) or a hot spare taken in (without it)."""
        if isinstance(exc, ScriptError) and exc.__context__ is not None:
            exc = exc.__context__  # the script's own exception, which `mpiddp run` reports as a ScriptError
        if isinstance(exc, Abandoned):
            say_abandoned(exc)
        elif exc is None or isinstance(exc, (SystemExit, ScriptExit)):
            status = exc.code if isinstance(exc, SystemExit) else exc.status if exc is not None else 0
            ended = f"the script ended before its first step{f' (status {status})' if status else ''}"
            cannot_warm_up(self.arrival, ended)
        else:
            cannot_warm_up(self.arrival, exc)
        self._end_now(0)

    def _end_now(self, status: int) -> NoReturn:
        from mpiddp.job.log import flush_logs

        end_if_taken_in(status)
        flush_logs()
        mpigrow.finalize()
        os._exit(status)

    def release(self) -> None:
        """Before MPI_Finalize, once it joined: the communicators it shares with the survivors (Membership.release)."""
        if self.joining is not None:
            self.joining.members.release()


def wait_again(exc: Abandoned) -> bool:
    """A hot spare whose grow the survivors gave up (GivenUp: a rank failed while it warmed up) is healthy: it
    says so, waits again among the spares (the next grow takes it in) and returns True; any other new rank
    returns False (it ends: say_abandoned)."""
    if not (isinstance(exc, GivenUp) and mpigrow.is_hot_spare()):
        return False
    log.warning("grow: %s; this hot spare waits again (the next grow takes it in, the job's end releases it)", exc)
    mpigrow.back_to_waiting()
    return True


def wait_until_released() -> int:
    """A hot spare of a job that never grows back (`check`): wait for the job's end (the workers' word, or every
    worker gone), then leave as a released spare does. 0."""
    try:
        mpigrow.merge_with_parent()
    except mpigrow.SpareReleased as exc:
        mpigrow.end_released_spare()
        log.info("this hot spare was not needed: %s", exc)
        return 0
    raise RuntimeError("a hot spare was taken into a job that does not grow back")


def say_abandoned(exc: Abandoned) -> None:
    """A new rank's one line when its grow was given up: it never joined, and the job goes on without it. A hot
    spare that was taken into the merged job ends here, without MPI_Finalize (its world holds failed processes:
    the fence would wait for good); the caller's ending is for the others (a spawned rank is a job of its own)."""
    if not isinstance(exc, CouldNotWarmUp):  # said already, as an error
        log.warning("grow: %s; this process ends (exit 0)", exc)
    end_if_taken_in(0)


def end_if_taken_in(status: int, why: str = "") -> None:
    """A hot spare taken into the merged job ends here with `status` (`why`: said with the exception being
    handled), without MPI_Finalize (its world holds failed processes: the fence would wait for good); any other
    process returns."""
    if mpigrow.is_hot_spare() and recovered_in_this_process():
        if why:
            log.exception(why)
        end_without_finalize(status)


def joining_device(backend: str, topology: Topology) -> torch.device:
    """The new rank's device, bound as the bootstrap binds a rank's (cuda:<local rank>, or cuda:0 where it sees
    one GPU) when the job runs on NCCL; the CPU otherwise."""
    import torch

    from mpiddp.job.bootstrap import choose_device
    from mpiddp.job.flags import DistSettings

    device_type, _, index = choose_device(DistSettings("cuda" if backend == "nccl" else "cpu", backend), topology)
    if index is not None:
        torch.cuda.set_device(index)
    return torch.device(device_type, index)


def joined_dist(joining: Joining, num_threads: int) -> Dist:
    """The new rank's Dist in the grown job (its process group is up), torchrun's variables exported."""
    from mpiddp.elastic.membership import WatchedTransport
    from mpiddp.job.bootstrap import export_environment
    from mpiddp.job.collective import Dist, Rendezvous

    members, hello, topology, device = joining.members, joining.hello, joining.topology, joining.device
    address, port = members.endpoint or ("", 0)
    rendezvous = Rendezvous(address, port, hello["interface_per_host"], HeldStore(members.store))
    dist = Dist(topology, WatchedTransport(members), device.type, device.index, hello["backend"], rendezvous,
                num_threads)
    export_environment(topology, address, port)
    log.warning("grow: this process (pid %d) joins as rank %d of %d, %d CPU thread%s", os.getpid(), topology.rank,
                topology.world_size, num_threads, "" if num_threads == 1 else "s")
    return dist


def receive(joining: Joining) -> dict[str, Any]:
    """Collective over the merged job: the state rank 0 handed over (GrowBack._join, the policy's `handover`: its
    own keys, which its joining side reads), timed as state_transfer."""
    started = time.monotonic()
    payload = joining.members.recv_large(0)
    joining.phases["state_transfer"] = time.monotonic() - started
    return payload


def own_host() -> str:
    return socket.gethostname()


def point_gloo_at(interface_per_host: dict[str, str], main_host: str) -> None:
    """gloo on this new host uses the interface the job's rendezvous uses (by name, as on rank 0's host), unless
    the user chose one."""
    from mpiddp.job.netif import local_interfaces

    wanted = interface_per_host.get(main_host)
    if wanted and "GLOO_SOCKET_IFNAME" not in os.environ and any(i.name == wanted for i in local_interfaces()):
        os.environ["GLOO_SOCKET_IFNAME"] = wanted
