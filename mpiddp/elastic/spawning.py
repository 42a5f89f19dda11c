"""MPI's side of growing back (mpiddp.elastic.grow): new ranks started by MPI_Comm_spawn and merged in after the
survivors, or hot spares (mpiddp.job.spares) woken and taken in without a process started; the joining rank's side
of both (merge with the parent, wait to be woken); and the communicators that span the first job and a spawned
one, which a spawned rank frees before MPI_Finalize (SpanningComms).

MPI comes through the job layer's MPI home (mpiddp.job.mpistart.mpi): this module imports no mpi4py, and never
starts MPI on import.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

from mpiddp.elastic.decide import GrowPlan
from mpiddp.errors import EXIT_HANG
from mpiddp.job.mpistart import init_mpi, mpi
from mpiddp.job.spares import BACK_TAG, PONG_TAG, WAKE_TAG, SpareWorld, is_hot_spare, spare_world

if TYPE_CHECKING:
    from mpi4py import MPI

# A waiting spare answers a ping within its poll (SPARE_POLL_S); one that has not in this long is stopped, or its host is
# silent: a wake would wait for it in the spares' world's shrink (up to the grow's bound, which ends the job).
PING_S = 5.0
# A waiting spare's wake-ups: a wake or a ping waits half of it on average (the survivors stand still for both);
# 500 tests a second of a request are nothing beside a rank's work
SPARE_POLL_S = 0.002
SPARE_JOIN_TIMEOUT_S = 90.0  # past the survivors' own bound on a grow (grow.SPAWN_TIMEOUT_S, 60 s)


class SpareReleased(Exception):
    """A hot spare's wait ended without a grow: the job ended (its word, or every worker gone)."""


class SpanningComms:
    """The communicators this process holds that span the first job and a spawned one, in the order both sides made
    them (the parent's first, in a spawned rank). A spawned rank's MPI_Finalize disconnects from every process it is
    still connected to, and waits forever for survivors that end with os._exit (measured: stuck in
    ompi_dpm_dyn_finalize), so a spawned rank frees them at its very end (Membership.release)."""

    def __init__(self) -> None:
        self._comms: list[MPI.Comm] = []

    def __bool__(self) -> bool:
        return bool(self._comms)

    def add(self, *comms: MPI.Comm) -> None:
        self._comms.extend(comms)

    def forget(self, comm: MPI.Comm) -> None:
        """`comm` was freed by its user: nothing to free at the end."""
        if comm in self._comms:
            self._comms.remove(comm)

    def take_all_but_the_parent(self) -> list[MPI.Comm]:
        """Every one but the first (the parent's, which MPI_Finalize handles), newest first, to be freed; forgotten
        here."""
        taken = list(reversed(self._comms[1:]))
        self._comms.clear()
        return taken


# ---- growing back: MPI's dynamic processes ------------------------------------------------------------------------

def spawn_and_merge(comm: MPI.Intracomm, plan: GrowPlan, command: list[str],
                    spanning: SpanningComms) -> tuple[MPI.Intracomm, dict[str, float]]:
    """Collective over the survivors' `comm`: start plan.count new ranks of `command` (the program and its
    arguments) on plan.hosts and merge them in after the survivors (both communicators held in `spanning`, the
    survivor's Membership's). Returns (the merged intracommunicator,
    {spawn, merge} seconds); MPI.Exception when the spawn fails (every survivor gets it: MPI_Comm_spawn is
    collective)."""
    MPI = mpi()
    command, args = command[0], command[1:]
    info = MPI.Info.Create()
    try:
        info.Set("host", ",".join(plan.hosts))
        info.Set("wdir", os.getcwd())  # `-m mpiddp` must find the same package (a checkout, a venv)
        # Open MPI binds a spawned process to one core whatever the job's --bind-to (measured: [0] of [0, 1]), so
        # the new rank got one CPU thread where its peers had their fair share, and its data and compute crawled.
        # Unbound, it takes its share of the host (mpiddp.job.bootstrap.fair_thread_count), as the ranks of
        # `launch` (--bind-to none) do; a user's own binding of the first ranks is not carried over.
        info.Set("bind_to", "none")
        started = time.monotonic()
        inter = comm.Spawn(command, args=args, maxprocs=plan.count, info=info, root=0)
    finally:
        info.Free()
    spawned = time.monotonic()
    inter.Set_errhandler(MPI.ERRORS_RETURN)
    merged = inter.Merge(high=False)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    spanning.add(inter, merged)
    return merged, {"spawn": spawned - started, "merge": time.monotonic() - spawned}


def library_version() -> str:
    """MPI_Get_library_version's text."""
    return str(mpi().Get_library_version())


def mpi_exception() -> type[Exception]:
    """MPI's exception class (mpi4py's), for code that holds a communicator but no Membership."""
    return mpi().Exception


def revoke(comm: MPI.Comm) -> None:
    """MPI_Comm_revoke (ULFM): every rank waiting on `comm` gets an error; never raises (revoked already)."""
    try:
        comm.Revoke()
    except Exception:  # noqa: BLE001 - revoked already by another survivor
        pass


def leave(merged: MPI.Intracomm) -> None:
    """A spawned rank whose grow was given up before it joined: free the merged communicator (revoked, or with a
    failed rank 0), so that MPI_Finalize does not wait on it; the parent's stays (as Membership.release).
    Measured: MPI_Finalize then returns at once, and mpirun's status stays 0."""
    try:
        merged.Free()
    except Exception:  # noqa: BLE001 - freed already
        pass


def finalize() -> None:
    """A spawned rank that leaves before it joined (its merged communicator freed: `leave`): MPI_Finalize now, as
    it ends with os._exit (mpirun counts a spawned process that ends without it as failed)."""
    MPI = mpi()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def joining() -> bool:
    """Whether this process joins a job growing back: spawned by it (it has an MPI parent), or a hot spare
    (mpiddp.job.spares). Initialises MPI."""
    init_mpi()
    MPI = mpi()
    return is_hot_spare() or MPI.Comm.Get_parent() != MPI.COMM_NULL


def merge_with_parent() -> MPI.Intracomm:
    """A joining rank's side of spawn_and_merge (or of wake_and_merge, for a hot spare): the merged
    intracommunicator (this rank after the survivors). SpareReleased when a hot spare's job ended instead."""
    if is_hot_spare():
        return wait_to_join()
    MPI = mpi()
    parent = MPI.Comm.Get_parent()
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return merged


def spanning_of_joined(merged: MPI.Intracomm) -> SpanningComms:
    """A joining rank's communicators that span its job and the survivors' (for its Membership, which frees them at
    the very end): the parent's and `merged`, for a spawned rank; none for a hot spare (one job from the start)."""
    spanning = SpanningComms()
    parent = mpi().Comm.Get_parent()
    if parent != mpi().COMM_NULL:
        spanning.add(parent, merged)
    return spanning


# ---- growing back onto hot spares (mpiddp.job.spares): no process started, no PMIx_Connect -------------------------

def wake_and_merge(comm: MPI.Intracomm, plan: GrowPlan) -> tuple[MPI.Intracomm | None, dict[str, float]]:
    """Collective over the survivors' `comm` and every waiting spare: rank 0 chooses live spares on plan.hosts
    (broadcast: every survivor follows it) and wakes every waiting spare (one word each), everyone shrinks the
    spares' world (a world with a failed process cannot create a group), and the survivors and the chosen spares
    create the merged intracommunicator, survivors first in `comm`'s order. Returns (merged, {spawn: the wake and
    the shrink, merge: the group}) as spawn_and_merge does; (None, {}) when too few spares are alive (a chosen
    spare that failed unnoticed until the shrink included)."""
    spares = spare_world()
    assert spares is not None
    started = time.monotonic()
    old = spares.world.Get_group()
    survivors = _world_ranks(comm.Get_group(), old)  # the survivors' world ranks, in comm's order
    chosen = comm.bcast(_choose(spares, plan.hosts) if comm.Get_rank() == 0 else None, root=0)
    if chosen is None:
        return None, {}
    if comm.Get_rank() == 0:
        for spare in spares.waiting:
            try:
                # with rank 0's list of who waits: a spare that waited again after a grow given up told the
                # workers only, and every process of the shrink must number the same spares
                spares.world.send(("join", survivors, chosen, list(spares.waiting), list(spares.hosts)), dest=spare,
                                  tag=WAKE_TAG)
            except mpi_exception():  # that spare failed while it waited: the shrink leaves it out
                pass
    merged, woken = _shrink_and_create(spares, old, survivors, chosen)
    if merged is None:
        return None, {}
    return merged, {"spawn": woken - started, "merge": time.monotonic() - woken}


def _choose(spares: SpareWorld, hosts: tuple[str, ...]) -> list[int] | None:
    """Rank 0: the first live waiting spare on each of `hosts` (world ranks), or None when too few are alive."""
    dead = _failed_in(spares.world)
    free = [(rank, host) for rank, host in zip(spares.waiting, spares.hosts) if rank not in dead]
    chosen = []
    for host in hosts:
        taken = next((item for item in free if item[1] == host), None)
        if taken is None:
            return None
        free.remove(taken)
        chosen.append(taken[0])
    return chosen


def _failed_in(world: MPI.Intracomm) -> set[int]:
    """The ranks of `world` that MPI reports failed (local: what this process has heard of)."""
    failed = world.Get_failed()
    try:
        return set(_world_ranks(failed, world.Get_group()))
    finally:
        failed.Free()


def live_spare_hosts() -> list[tuple[str, int]]:
    """Rank 0: (host, live spares waiting there), leaving out the spares MPI reports failed: what a hot grow may
    plan for (a dead spare planned for would make the grow fail)."""
    spares = spare_world()
    if spares is None:
        return []
    dead = _failed_in(spares.world)
    counts: dict[str, int] = {}
    for rank, host in zip(spares.waiting, spares.hosts):
        if rank not in dead:
            counts[host] = counts.get(host, 0) + 1
    return list(counts.items())


Pings = dict[int, tuple[str, "MPI.Request"]]  # a waiting spare's world rank: its host and rank 0's receive of its pong


def ping_spares(asked: Pings | None = None) -> Pings:
    """Rank 0: ask every live waiting spare not asked yet (in `asked`) to answer (a ping on the spares' world), no
    wait; its receives of their answers, by world rank (a spare no longer waiting dropped)."""
    MPI = mpi()
    spares = spare_world()
    assert spares is not None
    dead, me = _failed_in(spares.world), spares.world.Get_rank()
    pings: Pings = {}
    for rank, host in zip(spares.waiting, spares.hosts):
        if rank in dead:
            continue
        if asked and rank in asked:
            pings[rank] = asked[rank]
            continue
        try:
            spares.world.send(("ping", me), dest=rank, tag=WAKE_TAG)
        except MPI.Exception:  # failed meanwhile: the next plan leaves it out
            continue
        pings[rank] = (host, spares.world.irecv(source=rank, tag=PONG_TAG))
    for rank, (_, request) in (asked or {}).items():
        if rank not in pings:  # taken in or failed since: its answer, should it come, is never received
            _cancel(request)
    return pings


def _cancel(request: MPI.Request) -> None:
    try:
        request.Cancel()
    except mpi().Exception:
        pass


def silent_spares(timeout_s: float = PING_S, asked: Pings | None = None) -> list[str]:
    """Rank 0, before a grow onto hot spares: every live waiting spare is asked to answer (ping_spares; those in
    `asked`, pinged a step earlier, are not asked again); the hosts of those that have not within `timeout_s`
    (stopped, or their host silent). Every live process of the spares' world takes part in a wake's shrink, so a
    wake would wait for a silent one."""
    MPI = mpi()
    spares = spare_world()
    assert spares is not None
    asked = list(ping_spares(asked).values())
    deadline = time.monotonic() + timeout_s
    while asked and time.monotonic() < deadline:
        still = []
        for host, request in asked:
            try:
                done, _ = request.test()
            except MPI.Exception:  # it failed: not silent, dead (the shrink leaves it out)
                done = True
            if not done:
                still.append((host, request))
        asked = still
        if asked:
            time.sleep(0.001)
    for _, request in asked:  # its answer, should it come late, is never received
        _cancel(request)
    spares.silent = [host for host, _ in asked]  # the job's end must end them (spares.end_silent_spares)
    return spares.silent


def spares_of(merged: MPI.Intracomm, count: int) -> list[int]:
    """The spares' world ranks of a grow's new ranks (the last `count` of `merged`), in their order (local)."""
    spares = spare_world()
    assert spares is not None
    group = merged.Get_group()
    size = group.Get_size()
    return _world_ranks(group.Range_incl([(size - count, size - 1, 1)]), spares.world.Get_group())


def returned_or_gone(returning: list[int]) -> tuple[list[int], list[int]]:
    """Rank 0, local: of the hot spares of a grow given up (`returning`: spares' world ranks), those waiting again
    (their word came: back_to_waiting) and those MPI reports failed (one that could not warm up ends)."""
    spares = spare_world()
    assert spares is not None
    dead = _failed_in(spares.world)
    gone = [rank for rank in returning if rank in dead]
    back = [rank for rank in returning if rank not in dead and spares.world.iprobe(source=rank, tag=BACK_TAG)]
    return back, gone


def take_back(rank: int, host: str) -> None:
    """Every survivor: the hot spare `rank` of the spares' world waits again on `host`: the next grow may wake it.
    Its word to this survivor is taken (it sent one to each; a survivor that cannot receive it, the spare having
    failed since, leaves it out: the next wake's shrink does too)."""
    spares = spare_world()
    assert spares is not None
    request, deadline = spares.world.irecv(source=rank, tag=BACK_TAG), time.monotonic() + PING_S
    try:  # with a deadline: a spare stopped between its words holds its sockets open, and a receive would wait
        while not request.test()[0]:
            if time.monotonic() > deadline:
                request.Cancel()
                return
            time.sleep(0.001)
    except mpi().Exception:
        return
    spares.waiting.append(rank)
    spares.hosts.append(host)


def back_to_waiting() -> None:
    """A hot spare whose grow the survivors gave up before it joined (a rank failed meanwhile): it is again one of
    the waiting spares, and says so to every worker of the spares' world (rank 0 takes it back at a step boundary:
    GrowBack.settle_returning). Its warm-up is done again at the next wake."""
    spares = spare_world()
    assert spares is not None
    me = spares.world.Get_rank()
    spares.waiting.append(me)
    spares.hosts.append(socket.gethostname())
    spares.waits = True
    dead = _failed_in(spares.world)
    for rank in range(spares.world.Get_size()):
        if rank not in spares.waiting and rank not in dead:
            try:
                spares.world.send(("back",), dest=rank, tag=BACK_TAG)
            except mpi().Exception:  # that worker failed meanwhile
                pass


def _world_ranks(group: MPI.Group, into: MPI.Group) -> list[int]:
    """The ranks of `into` that `group`'s processes have, in `group`'s order."""
    return list(mpi().Group.Translate_ranks(group, list(range(group.Get_size())), into))


def _shrink_and_create(spares: SpareWorld, old: MPI.Group, survivors: list[int], chosen: list[int],
                       ) -> tuple[MPI.Intracomm | None, float]:
    """Every process of the spares' world (survivors and waiting spares): shrink it, then the survivors and the
    chosen spares create their group; the spares not chosen wait on in the shrunk world."""
    MPI = mpi()
    world = spares.world.Shrink()
    world.Set_errhandler(MPI.ERRORS_RETURN)
    woken = time.monotonic()
    new = world.Get_group()
    # every rank of the word numbered alike, the chosen ones included: a survivor that missed a returning spare's
    # word (it failed as it came back: take_back) does not count it as waiting, and must still agree on it
    known = list(dict.fromkeys(survivors + spares.waiting + chosen))
    moved = dict(zip(known, MPI.Group.Translate_ranks(old, known, new)))
    spares.world = world
    if any(moved[rank] == MPI.UNDEFINED for rank in chosen):  # a chosen spare failed before the shrink: every
        chosen = []  # process sees the same shrunk world, so none joins, and the live ones wait on
    kept = [(moved[rank], host) for rank, host in zip(spares.waiting, spares.hosts)
            if rank not in chosen and moved[rank] != MPI.UNDEFINED]  # a spare that failed while it waited is gone
    spares.waiting, spares.hosts = [rank for rank, _ in kept], [host for _, host in kept]
    members = [moved[rank] for rank in survivors + chosen]
    if not chosen or world.Get_rank() not in members:
        return None, woken
    spares.waits = False  # a chosen spare is taken in (a survivor never waited)
    merged = world.Create_group(new.Incl(members), tag=WAKE_TAG)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return merged, woken


def wait_to_join() -> MPI.Intracomm:
    """A hot spare: wait for rank 0's word (every failure in the job wakes the receive from any source with
    MPI_ERR_PROC_FAILED_PENDING: acknowledged, the same receive goes on; posting another left the word to the
    first one, measured), then take part in the shrink; the merged intracommunicator once chosen.
    SpareReleased when told to leave."""
    MPI = mpi()
    spares = spare_world()
    assert spares is not None
    while True:
        request = spares.world.irecv(source=MPI.ANY_SOURCE, tag=WAKE_TAG)
        word = None
        while word is None:
            try:
                done, word = request.test()
            except MPI.Exception:
                spares.world.Ack_failed()
                spares.failures_seen = True
                if _every_worker_failed(spares):
                    raise SpareReleased("every rank of the job ended") from None
                continue
            if not done:
                time.sleep(SPARE_POLL_S)  # a spare has nothing else to do
        if word[0] == "ping":  # rank 0 asks whether this spare answers before it plans a grow onto the spares
            try:
                spares.world.send(("pong",), dest=word[1], tag=PONG_TAG)
            except MPI.Exception:  # the asking rank failed meanwhile
                pass
            continue
        if word[0] != "join":
            if len(word) > 1:  # released while the job runs on: it ends at once (end_released_spare)
                spares.released = str(word[1])
                raise SpareReleased(spares.released)
            raise SpareReleased("the job ended")
        # a process lost between the shrink and the group leaves MPI_Comm_create_group waiting (measured): the
        # survivors' bound ends the job then (grow.SPAWN_TIMEOUT_S), and this spare must not outlive it
        bound = threading.Timer(SPARE_JOIN_TIMEOUT_S, _spare_stuck)
        bound.daemon = True
        bound.start()
        try:
            spares.waiting, spares.hosts = list(word[3]), list(word[4])
            merged, _ = _shrink_and_create(spares, spares.world.Get_group(), word[1], word[2])
        finally:
            bound.cancel()
        if merged is not None:
            return merged  # else not chosen: wait on


def _spare_stuck() -> None:
    """A hot spare whose shrink or group never returned: one line, then it ends (EXIT_HANG)."""
    print(f"mpiddp: this hot spare's join has not returned in {SPARE_JOIN_TIMEOUT_S:.0f} s (a rank lost during "
          "it); it ends", file=sys.stderr, flush=True)
    os._exit(EXIT_HANG)


def _every_worker_failed(spares: SpareWorld) -> bool:
    """Whether every process of the spares' world that is not a waiting spare failed (survivors that end with
    os._exit release nobody)."""
    dead = _failed_in(spares.world) - set(spares.waiting)  # a spare that died while waiting is no worker
    return len(dead) >= spares.world.Get_size() - len(spares.waiting)


def end_released_spare() -> None:
    """A hot spare released without a grow ends: with MPI_Finalize in a job that lost no process, else at once
    (MPI_Finalize's fence would wait for the processes that ended without it, measured). One released while the
    job runs on (spares.released) ends at once too, saying so: MPI_Finalize's fence would hold it until the
    workers' end (measured: its MPI_Finalize returned after theirs), and under --with-ft ulfm its exit without
    MPI_Finalize leaves mpirun's status and the workers' own MPI_Finalize as they were (measured, status 0)."""
    spares = spare_world()
    if spares is None:
        return
    if spares.released:
        print(f"mpiddp: this hot spare (pid {os.getpid()} on {socket.gethostname()}) ends: {spares.released}",
              file=sys.stderr, flush=True)
    failed = spares.world.Get_failed()  # this spare may have been told before it heard of a failure
    if spares.released or spares.failures_seen or failed.Get_size():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
