"""Who is still in the job: failure notice through MPI's fault-tolerance interface (ULFM), agreement on who failed,
a shrunk communicator, and torch's default process group rebuilt over the survivors (in-job recovery, groundwork).

How a failure is noticed while torch waits in a collective: a blocking gloo (or NCCL) collective is not
interrupted when a peer dies or when the backend is aborted, so collectives are issued with `async_op=True` and
`Membership.wait` polls the torch work and, between polls, one MPI request: a receive from MPI_ANY_SOURCE on a
private duplicate of the communicator, with a tag no message carries. Nothing ever matches it; ULFM completes a
pending any-source receive with MPI_ERR_PROC_FAILED(_PENDING) as soon as any member fails, so it is a failure
detector that is posted once, costs one MPI_Test per poll and adds no message to the job's traffic (an
Ibarrier or Iallreduce per collective would add a collective to every step; MPI_Comm_get_failed alone is a
local query that need not drive MPI's progress engine). The rendezvous store is rebuilt too: the new rank 0
of the shrunk communicator opens a fresh TCPStore and broadcasts its address over MPI, so the death of the rank
that held the first store (rank 0) is survived like any other.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from mpiddp.elastic.decide import GrowPlan, old_group_plan, recovery_refusal, store_address, ulfm_refusal
from mpiddp.errors import EXIT_HANG
from mpiddp.job.collective import MpiTransport
from mpiddp.job.spares import WAKE_TAG, is_hot_spare, spare_world

log = logging.getLogger(__name__)

WATCH_TAG = 27_182  # carried by no message: the watch receive completes only when a member fails
GLOO_ERROR_GRACE_S = 30.0  # gloo saw a peer vanish: how long MPI gets to confirm it before the error is the answer
CONFIRM_S = 2.0  # a torch error on a rank: how long MPI gets to report a failed peer before the error stands


class MembersLost(Exception):
    """Members of the communicator failed (MPI said so); `ranks` are their ranks in that communicator."""

    def __init__(self, ranks: tuple[int, ...], detected_at: float) -> None:
        super().__init__(f"ranks {', '.join(map(str, ranks)) or '?'} failed")
        self.ranks = ranks
        self.detected_at = detected_at  # time.time() when this rank learnt it


class RecoveryFailed(RuntimeError):
    """In-job recovery cannot go on (the message says why, in one line): fall back to failing the job. `failed`: the
    ranks of the communicator the shrink left out, where it got that far (else empty)."""

    def __init__(self, message: str, failed: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.failed = failed


@dataclass(frozen=True)
class Recovered:
    """The outcome of one recovery, the same on every survivor."""

    comm: Any  # the shrunk MPI communicator (errors return), which the job uses from now on
    old_ranks_alive: tuple[int, ...]  # survivors' ranks in the old communicator, in new-rank order
    failed_ranks: tuple[int, ...]  # ranks in the old communicator that failed
    phases: dict[str, float] = field(default_factory=dict)  # seconds: agree_and_shrink, process_group
    detected_at: float = 0.0  # time.time() when this rank learnt of the failure

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def world_size(self) -> int:
        return self.comm.Get_size()


# ---- the membership layer over MPI ---------------------------------------------------------------------------

def _error_class(exc: BaseException) -> int | None:
    getter = getattr(exc, "Get_error_class", None)
    return getter() if getter is not None else None


class Membership:
    """The job's members as MPI sees them. Collective: every rank of `comm` constructs it together.

    `comm` is duplicated (the original is left as it is): the duplicate, with errors returned instead of fatal,
    is what `recover` revokes and shrinks, and a second duplicate carries the failure watch.
    """

    def __init__(self, comm: Any, collective_timeout_s: float = 1800.0, poll_s: float = 0.0005,
                 address: Callable[[], str] | None = None, backend: str = "gloo", device: Any = None) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.backend = backend  # of the process groups it builds: gloo, or nccl on `device` (a torch.device)
        self.device = device
        self.comm = self._dup(comm)
        self.collective_timeout_s = collective_timeout_s
        self.poll_s = poll_s  # the longest sleep between polls (a collective that ends sooner is seen sooner)
        self._address = address or _default_address
        self._watch_comm: Any = None
        self._watch: Any = None
        self._lost: float | None = None  # time.time() when the watch reported a failure (until recovered)
        self._store: Any = None  # this rank's rendezvous store after a recovery (the server on the new rank 0)
        self._graveyard: list[Any] = []  # old process groups: never destroyed (see _retire_default_group)
        self.endpoint: tuple[str, int] | None = None  # the store's (address, port) after a recovery
        self.waiting_since: float | None = None  # time.time() when this rank last began waiting on a collective
        self._arm()

    def _dup(self, comm: Any) -> Any:
        dup = comm.Dup()
        dup.Set_errhandler(self._mpi.ERRORS_RETURN)
        return dup

    def _arm(self) -> None:
        self._watch_comm = self._dup(self.comm)
        self._watch = self._watch_comm.Irecv(bytearray(1), source=self._mpi.ANY_SOURCE, tag=WATCH_TAG)
        self._lost = None

    def check_ulfm(self) -> str | None:
        """None when in-job recovery can work here, else one line why not."""
        return check_ulfm()

    @property
    def store(self) -> Any:
        """This rank's rendezvous store since the last recovery or grow (the server on rank 0), None before."""
        return self._store

    @property
    def lost_at(self) -> float | None:
        """time.time() when the failure watch reported a failure (None until then, and again once recovered)."""
        return self._lost

    @property
    def mpi_error(self) -> type[Exception]:
        """MPI's exception class (mpi4py's MPI.Exception): what a collective raises when MPI fails it."""
        return self._mpi.Exception

    # -- noticing a failure --

    def failed(self) -> tuple[int, ...] | None:
        """Non-blocking: None while MPI reports no failure, else the ranks of `comm` known failed so far (empty
        when this rank learnt it only from a peer's revoke)."""
        if self._lost is None:
            try:
                if not self._watch.Test():
                    return None
                raise AssertionError("a message matched the failure watch: another user of its tag?")
            except self._mpi.Exception as exc:
                if _error_class(exc) not in (self._mpi.ERR_PROC_FAILED, self._mpi.ERR_PROC_FAILED_PENDING,
                                             self._mpi.ERR_REVOKED):
                    raise
            self._lost = time.time()
        return self._failed_ranks()

    def _failed_ranks(self) -> tuple[int, ...]:
        try:
            group = self._watch_comm.Get_failed()
        except NotImplementedError:  # an MPI without MPI_Comm_get_failed: recover() learns the set from Shrink
            return ()
        try:
            ranks = self._mpi.Group.Translate_ranks(group, list(range(group.Get_size())), self.comm.Get_group())
        finally:
            group.Free()
        return tuple(sorted(r for r in ranks if r != self._mpi.UNDEFINED))

    def wait(self, work: Any) -> None:
        """Wait for a torch work (from `async_op=True`) to complete; raise MembersLost when MPI reports a failed
        member first. The torch error of a collective whose peer died becomes MembersLost once MPI confirms it."""
        pause = 0.00002
        self.waiting_since = time.time()
        while not work.is_completed():
            lost = self.failed()
            if lost is not None:
                raise MembersLost(lost, self._lost or time.time())
            time.sleep(pause)
            pause = min(pause * 2, self.poll_s)
        try:
            work.wait()
        except RuntimeError:
            lost = self._confirm(GLOO_ERROR_GRACE_S)
            if lost is not None:
                raise MembersLost(lost, self._lost or time.time()) from None
            raise

    def confirm(self, grace_s: float) -> tuple[int, ...] | None:
        """After an error that may be a peer's death: the failed ranks once MPI reports them, else None."""
        return self._confirm(grace_s)

    def _confirm(self, grace_s: float) -> tuple[int, ...] | None:
        """After a torch error: the failed ranks once MPI reports them, or None when it does not within grace_s."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            lost = self.failed()
            if lost is not None:
                return lost
            time.sleep(self.poll_s)
        return None

    def run_collective(self, issue: Callable[[], Any]) -> Any:
        """Run `issue()`, which starts a torch collective with async_op=True and returns its work, and wait for it
        (see wait). Returns the work."""
        work = issue()
        self.wait(work)
        return work

    def all_completed(self, completed: bool) -> bool:
        """Collective over the members, fault tolerant and uniform (MPI_Comm_agree): True on every member when
        each says it `completed` its part and none failed; False on every survivor alike otherwise (then they
        recover together)."""
        try:
            return bool(self.comm.Agree(1 if completed else 0))
        except self._mpi.Exception as exc:
            if _error_class(exc) not in (self._mpi.ERR_PROC_FAILED, self._mpi.ERR_PROC_FAILED_PENDING,
                                         self._mpi.ERR_REVOKED):
                raise
            if self._lost is None:
                self._lost = time.time()
            return False

    # -- recovering --

    def recover(self, min_size: int = 1) -> Recovered:
        """Collective over the survivors, after MembersLost: revoke, shrink, agree, and rebuild torch's default
        process group (gloo, or NCCL after aborting the old one) over the survivors. RecoveryFailed (one line)
        when the job cannot go on."""
        detected = self._lost or time.time()
        started = time.monotonic()
        old = self.comm
        old_size = old.Get_size()
        try:
            new, alive = self._shrink(old)
        except self._mpi.Exception as exc:
            raise RecoveryFailed(f"a second failure during recovery (MPI: {exc}): the job ends") from None
        failed = tuple(r for r in range(old_size) if r not in set(alive))
        refusal = recovery_refusal(old_size, failed, min_size)
        if refusal is not None:
            raise RecoveryFailed(refusal, failed)
        shrunk = time.monotonic()
        self._disarm()
        self.comm = new
        try:
            self._rebuild_process_group()
        except self._mpi.Exception as exc:
            raise RecoveryFailed(f"a second failure during recovery (MPI: {exc}): the job ends", failed) from None
        self._arm()
        phases = {"agree_and_shrink": shrunk - started, "process_group": time.monotonic() - shrunk}
        log.warning("in-job recovery: ranks %s of %d failed; %d ranks go on (agree and shrink %.3f s, process "
                    "group %.3f s)", list(failed), old_size, len(alive), phases["agree_and_shrink"],
                    phases["process_group"])
        return Recovered(new, alive, failed, phases, detected)

    def _shrink(self, old: Any) -> tuple[Any, tuple[int, ...]]:
        """Revoke (so every survivor leaves whatever it waits on), shrink, and agree that every survivor has the
        same new communicator: Agree fails if a member of it failed meanwhile."""
        old.Revoke()
        self._watch_comm.Revoke()
        new = old.Shrink()
        new.Set_errhandler(self._mpi.ERRORS_RETURN)
        new.Agree(1)
        alive = self._mpi.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())), old.Get_group())
        return new, tuple(alive)

    def _disarm(self) -> None:
        # The watch receive completed with an error; the revoked duplicates are freed (never used again).
        for comm in (self._watch_comm, self.comm):
            try:
                comm.Free()
            except self._mpi.Exception:
                pass  # a revoked communicator may refuse: it is dropped either way

    def adopt(self, comm: Any) -> float:
        """Collective over `comm` (the survivors and the ranks that joined them, mpiddp.elastic.grow): watch and
        recover over it from now on, with torch's default group rebuilt over it. Returns the process group's
        seconds. A joining rank constructs a Membership on `comm` instead (the same collectives)."""
        try:
            self._watch.Cancel()
            self._watch.Free()
        except self._mpi.Exception:
            pass  # already completed with an error: nothing to cancel
        self._disarm()
        self.comm = self._dup(comm)
        self._arm()
        started = time.monotonic()
        self._rebuild_process_group()
        return time.monotonic() - started

    def start_process_group(self) -> None:
        """Collective: torch's default group (self.backend) over `comm`, on a store opened by rank 0 (the same path a
        recovery takes, so start-up and recovery share one rendezvous)."""
        self._rebuild_process_group()

    def _rebuild_process_group(self) -> None:
        """A fresh store on the new rank 0 (its address broadcast over MPI), then a new default group (gloo, or
        NCCL on the same device: eagerly connected, so its cost lands in the process_group phase)."""
        import torch.distributed as tdist

        timeout = timedelta(seconds=self.collective_timeout_s)
        if tdist.is_initialized():
            if old_group_plan(self.backend, nccl_abort_available()) == "abort":
                self._abort_default_group()
            else:
                self._retire_default_group()
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        endpoint = None
        if rank == 0:
            address = self._address()
            self._store = tdist.TCPStore(address, 0, size, True, timeout=timeout, wait_for_workers=False)
            endpoint = (address, self._store.port)
        address, port = self.endpoint = self.comm.bcast(endpoint, root=0)
        if rank != 0:
            self._store = tdist.TCPStore(address, port, size, False, timeout=timeout)
        tdist.init_process_group(self.backend, store=self._store, rank=rank, world_size=size, timeout=timeout,
                                 **({"device_id": self.device} if self.backend == "nccl" else {}))

    def _abort_default_group(self) -> None:
        """NCCL: abort every communicator of the old groups (ncclCommAbort), which ends their kernels still
        waiting on the dead peer, so the GPU stream and nothing after it blocks on them; torch forgets the
        groups (the same tables destroy_process_group clears). Needs TORCH_NCCL_ASYNC_ERROR_HANDLING 0 or 2,
        or torch's own watchdog may end this survivor first (decide.job_refusal)."""
        from torch.distributed import distributed_c10d as c10d

        c10d._abort_process_group()

    def _retire_default_group(self) -> None:
        """Make room for a new default group without destroying the old one: its gloo worker may still wait on
        the dead peer (until the collective timeout), and destroying it would join that thread. The old group
        is kept alive (never destructed) and torch forgets it."""
        from torch.distributed import distributed_c10d as c10d

        self._graveyard.append(c10d._get_default_group())
        c10d._update_default_pg(None)
        world = c10d._world
        for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
                      "pg_coalesce_state", "pg_flight_recorder_hooks"):
            if hasattr(world, table):
                getattr(world, table).clear()
        world.group_count = 0
        if hasattr(c10d, "_unregister_all_process_groups"):  # the by-name registry of functional collectives
            c10d._unregister_all_process_groups()

    def release(self) -> None:
        """A spawned rank at its very end (after the teardown's barrier), before MPI_Finalize: cancel the failure
        watch and free every communicator that spans both jobs except the parent's. Measured with Open MPI 5.0.11
        under ULFM after a shrink: MPI_Comm_disconnect hangs in PMIx_Fence on every side, and MPI_Finalize with
        these still held waits forever in ompi_dpm_dyn_finalize for survivors that ended with os._exit. The
        survivors do nothing (they end without MPI_Finalize, as after any recovery)."""
        if not _spanning:
            return
        try:
            self._watch.Cancel()
            self._watch.Wait()
        except self._mpi.Exception:
            pass  # completed already (with an error): nothing pending on it
        for comm in (self._watch_comm, self.comm, *reversed(_spanning[1:])):
            try:
                comm.Free()
            except self._mpi.Exception:
                pass  # revoked or freed already
        _spanning.clear()

    def bcast_large(self, value: Any, root: int = 0) -> Any:
        """Collective over `comm`: `value` from `root` to every rank, pickles of any size (pkl5)."""
        from mpi4py.util import pkl5

        return pkl5.Intracomm(self.comm).bcast(value, root=root)

    def close(self) -> None:
        """Cancel the watch and free the duplicates (every rank; not collective)."""
        try:
            self._watch.Cancel()
            self._watch.Free()
        except self._mpi.Exception:
            pass
        self._disarm()


def nccl_abort_available() -> bool:
    """Whether this torch can abort a NCCL process group (distributed_c10d._abort_process_group)."""
    from torch.distributed import distributed_c10d

    return hasattr(distributed_c10d, "_abort_process_group")


def check_ulfm() -> str | None:
    """None when in-job recovery can work in this process's MPI, else one line why not."""
    from mpi4py import MPI

    return ulfm_refusal(MPI.Get_library_version(), os.environ, hasattr(MPI.Comm, "Shrink"))


def _default_address() -> str:
    from mpiddp.job.netif import local_interfaces

    return store_address(os.environ, [(i.name, i.address) for i in local_interfaces()])


def mpi_facts() -> tuple[str, bool, str]:
    """(MPI_Get_library_version's text, whether mpi4py has Comm.Shrink, mpi4py's version): what `check` says of
    in-job recovery in this process."""
    import mpi4py
    from mpi4py import MPI

    return MPI.Get_library_version(), hasattr(MPI.Comm, "Shrink"), mpi4py.__version__


def members_lost(members: Membership, exc: BaseException, confirm_s: float = CONFIRM_S) -> MembersLost | None:
    """The failure behind `exc` when MPI reports failed members, else None (the error stands). MPI's own failure
    classes, and a torch RuntimeError (a gloo peer that vanished, DDP's wrapping of the hook's MembersLost) once
    MPI confirms a failed peer within `confirm_s`."""
    if isinstance(exc, MembersLost):
        return exc
    mpi = members._mpi
    if isinstance(exc, mpi.Exception):
        if exc.Get_error_class() not in (mpi.ERR_PROC_FAILED, mpi.ERR_PROC_FAILED_PENDING, mpi.ERR_REVOKED):
            return None
    elif not isinstance(exc, RuntimeError):
        return None
    ranks = members.confirm(confirm_s)
    return None if ranks is None else MembersLost(ranks, time.time())


def mpi_error_of(members: Any) -> type[Exception]:
    """MPI's exception class as `members` (a Membership) raises it."""
    return members._mpi.Exception


class WatchedTransport(MpiTransport):
    """MPI over the Membership's communicator, trusting no collective that returns after MPI reported a failed
    member: under ULFM a collective interrupted by a failure can return on some ranks without an error and with
    its buffer never filled (seen: an Allreduce of the stop agreement after Open MPI aborted its schedule, whose
    garbage asked for a save). It raises MembersLost instead; the survivors recover, and the one that got further
    gives the others its state. One MPI_Test and one MPI_Comm_get_failed (local) per collective."""

    def __init__(self, members: Membership) -> None:
        super().__init__(members.comm)
        self.members = members

    def _trusted(self, value: Any) -> Any:
        lost = self.members.failed()
        if lost is not None:
            raise MembersLost(lost, self.members._lost or time.time())
        # the aborted schedule knew before the failure watch (another communicator) heard: MPI_Comm_get_failed
        failed = self.failed_ranks()
        if failed:
            raise MembersLost(failed, time.time())
        return value

    def allgather(self, value: Any) -> Any:
        return self._trusted(super().allgather(value))

    def gather(self, value: Any) -> Any:
        return self._trusted(super().gather(value))

    def bcast(self, value: Any) -> Any:
        return self._trusted(super().bcast(value))

    def scatter(self, values: Any) -> Any:
        return self._trusted(super().scatter(values))

    def allreduce(self, values: Any, op: str) -> Any:
        return self._trusted(super().allreduce(values, op))

    def barrier(self) -> None:
        self._trusted(super().barrier())

    def idle_barrier(self, poll_s: float) -> None:
        self._trusted(super().idle_barrier(poll_s))


# ---- growing back: MPI's dynamic processes (mpiddp.elastic.grow) ------------------------------------------------

# Communicators that span the first job and the spawned one, in the order both sides made them: a spawned rank's
# MPI_Finalize disconnects from every process it is still connected to, and waits forever for survivors that
# end with os._exit (measured: stuck in ompi_dpm_dyn_finalize), so every side disconnects them at the end.
_spanning: list[Any] = []


def spawn_and_merge(comm: Any, plan: GrowPlan, command: list[str]) -> tuple[Any, dict[str, float]]:
    """Collective over the survivors' `comm`: start plan.count new ranks of `command` (the program and its
    arguments) on plan.hosts and merge them in after the survivors. Returns (the merged intracommunicator,
    {spawn, merge} seconds); MPI.Exception when the spawn fails (every survivor gets it: MPI_Comm_spawn is
    collective)."""
    from mpi4py import MPI

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
    _spanning.extend([inter, merged])
    return merged, {"spawn": spawned - started, "merge": time.monotonic() - spawned}


def library_version() -> str:
    """MPI_Get_library_version's text."""
    from mpi4py import MPI

    return str(MPI.Get_library_version())


def mpi_exception() -> type[Exception]:
    """MPI's exception class (mpi4py's), for code that holds a communicator but no Membership."""
    from mpi4py import MPI

    return MPI.Exception


def revoke(comm: Any) -> None:
    """MPI_Comm_revoke (ULFM): every rank waiting on `comm` gets an error; never raises (revoked already)."""
    try:
        comm.Revoke()
    except Exception:  # noqa: BLE001 - revoked already by another survivor
        pass


def leave(merged: Any) -> None:
    """A spawned rank whose grow was given up before it joined: free the merged communicator (revoked, or with a
    failed rank 0), so that MPI_Finalize does not wait on it; the parent's stays (as Membership.release).
    Measured: MPI_Finalize then returns at once, and mpirun's status stays 0."""
    try:
        merged.Free()
    except Exception:  # noqa: BLE001 - freed already
        pass
    if merged in _spanning:
        _spanning.remove(merged)


def joining() -> bool:
    """Whether this process joins a job growing back: spawned by it (it has an MPI parent), or a hot spare
    (mpiddp.job.spares). Initialises MPI."""
    from mpiddp.job.mpistart import init_mpi

    init_mpi()
    from mpi4py import MPI

    return is_hot_spare() or MPI.Comm.Get_parent() != MPI.COMM_NULL


class SpareReleased(Exception):
    """A hot spare's wait ended without a grow: the job ended (its word, or every worker gone)."""


def merge_with_parent() -> Any:
    """A joining rank's side of spawn_and_merge (or of wake_and_merge, for a hot spare): the merged
    intracommunicator (this rank after the survivors). SpareReleased when a hot spare's job ended instead."""
    from mpi4py import MPI

    if is_hot_spare():
        return wait_to_join()
    parent = MPI.Comm.Get_parent()
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    _spanning.extend([parent, merged])
    return merged


# ---- growing back onto hot spares (mpiddp.job.spares): no process started, no PMIx_Connect -------------------------



def wake_and_merge(comm: Any, plan: GrowPlan) -> tuple[Any, dict[str, float]]:
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
                spares.world.send(("join", survivors, chosen), dest=spare, tag=WAKE_TAG)
            except mpi_exception():  # that spare failed while it waited: the shrink leaves it out
                pass
    merged, woken = _shrink_and_create(spares, old, survivors, chosen)
    if merged is None:
        return None, {}
    return merged, {"spawn": woken - started, "merge": time.monotonic() - woken}


def _choose(spares: Any, hosts: tuple[str, ...]) -> list[int] | None:
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


def _failed_in(world: Any) -> set[int]:
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


def new_ranks_of(merged: Any, count: int) -> Any:
    """The group of a grow's new ranks: the last `count` of `merged` (local)."""
    group = merged.Get_group()
    size = group.Get_size()
    return group.Range_incl([(size - count, size - 1, 1)])


def any_alive(group: Any) -> bool:
    """Rank 0: whether a process of `group` (hot spares of a grow given up) is still alive in the spares' world:
    the world's next shrink, which every live process of it takes part in, would wait until it ended."""
    from mpi4py import MPI

    spares = spare_world()
    if spares is None:
        return False
    ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), spares.world.Get_group())
    dead = _failed_in(spares.world)
    return any(rank != MPI.UNDEFINED and rank not in dead for rank in ranks)


def _world_ranks(group: Any, into: Any) -> list[int]:
    """The ranks of `into` that `group`'s processes have, in `group`'s order."""
    from mpi4py import MPI

    return list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), into))


def _shrink_and_create(spares: Any, old: Any, survivors: list[int], chosen: list[int]) -> tuple[Any, float]:
    """Every process of the spares' world (survivors and waiting spares): shrink it, then the survivors and the
    chosen spares create their group; the spares not chosen wait on in the shrunk world."""
    from mpi4py import MPI

    world = spares.world.Shrink()
    world.Set_errhandler(MPI.ERRORS_RETURN)
    woken = time.monotonic()
    new = world.Get_group()
    moved = dict(zip(survivors + spares.waiting, MPI.Group.Translate_ranks(old, survivors + spares.waiting, new)))
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


def wait_to_join() -> Any:
    """A hot spare: wait for rank 0's word (every failure in the job wakes the receive from any source with
    MPI_ERR_PROC_FAILED_PENDING: acknowledged, the same receive goes on; posting another left the word to the
    first one, measured), then take part in the shrink; the merged intracommunicator once chosen.
    SpareReleased when told to leave."""
    from mpi4py import MPI

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
                time.sleep(0.01)  # a spare has nothing else to do: one wake-up every 10 ms
        if word[0] != "join":
            raise SpareReleased("the job ended")
        # a process lost between the shrink and the group leaves MPI_Comm_create_group waiting (measured): the
        # survivors' bound ends the job then (grow.SPAWN_TIMEOUT_S), and this spare must not outlive it
        bound = threading.Timer(SPARE_JOIN_TIMEOUT_S, _spare_stuck)
        bound.daemon = True
        bound.start()
        try:
            merged, _ = _shrink_and_create(spares, spares.world.Get_group(), word[1], word[2])
        finally:
            bound.cancel()
        if merged is not None:
            return merged  # else not chosen: wait on


SPARE_JOIN_TIMEOUT_S = 90.0  # past the survivors' own bound on a grow (grow.SPAWN_TIMEOUT_S, 60 s)


def _spare_stuck() -> None:
    """A hot spare whose shrink or group never returned: one line, then it ends (EXIT_HANG)."""
    import sys

    print(f"mpiddp: this hot spare's join has not returned in {SPARE_JOIN_TIMEOUT_S:.0f} s (a rank lost during "
          "it); it ends", file=sys.stderr, flush=True)
    os._exit(EXIT_HANG)


def _every_worker_failed(spares: Any) -> bool:
    """Whether every process of the spares' world that is not a waiting spare failed (survivors that end with
    os._exit release nobody)."""
    dead = _failed_in(spares.world) - set(spares.waiting)  # a spare that died while waiting is no worker
    return len(dead) >= spares.world.Get_size() - len(spares.waiting)


def end_released_spare() -> None:
    """A hot spare released without a grow ends: with MPI_Finalize in a job that lost no process, else at once
    (MPI_Finalize's fence would wait for the processes that ended without it, measured)."""
    spares = spare_world()
    if spares is None:
        return
    failed = spares.world.Get_failed()  # this spare may have been told before it heard of a failure
    if spares.failures_seen or failed.Get_size():
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
