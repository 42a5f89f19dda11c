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

This is the package's only home of MPI's fault-tolerance calls beside the spares' world (mpiddp.elastic.spawning,
growing back); the job layer learns which peers failed through the query installed here (failed_ranks_of).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from mpiddp.elastic.decide import old_group_plan, recovery_refusal, store_address, ulfm_refusal
from mpiddp.elastic.spawning import SpanningComms
from mpiddp.job.collective import MpiTransport, set_failed_ranks_query

if TYPE_CHECKING:
    import numpy as np
    import torch
    from mpi4py import MPI
    from torch.distributed import ProcessGroup, Store, Work

log = logging.getLogger(__name__)
T = TypeVar("T")

LARGE_TAG = 27_183  # send_large's messages (a grow's state, to the new ranks)
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

    comm: MPI.Intracomm  # the shrunk MPI communicator (errors return), which the job uses from now on
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

    def __init__(self, comm: MPI.Intracomm, collective_timeout_s: float = 1800.0, poll_s: float = 0.0005,
                 address: Callable[[], str] | None = None, backend: str = "gloo",
                 device: torch.device | None = None, spanning: SpanningComms | None = None,
                 prepared: PreparedDups | None = None) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.backend = backend  # of the process groups it builds: gloo, or nccl on `device` (a torch.device)
        self.device = device
        self.comm = self._dup(comm, prepared.own if prepared else None)
        self.collective_timeout_s = collective_timeout_s
        self.poll_s = poll_s  # the longest sleep between polls (a collective that ends sooner is seen sooner)
        self._address = address or _default_address
        self._watch_comm: MPI.Intracomm | None = None
        self._watch: MPI.Request | None = None
        self._lost: float | None = None  # time.time() when the watch reported a failure (until recovered)
        self._store: Store | None = None  # this rank's rendezvous store after a recovery (the server on the new rank 0)
        self._graveyard: list[ProcessGroup] = []  # old process groups: never destroyed (see _retire_default_group)
        self.endpoint: tuple[str, int] | None = None  # the store's (address, port) after a recovery
        self.waiting_since: float | None = None  # time.time() when this rank last began waiting on a collective
        self._waiting_from: float | None = None  # time.monotonic() while it waits in `wait` or `all_completed`
        # the communicators this process holds that span the first job and a spawned one (mpiddp.elastic.spawning):
        # a joined rank's parent and merged ones, a survivor's spawn's; release frees them
        self.spanning = spanning if spanning is not None else SpanningComms()
        self._arm(prepared.watch if prepared else None)

    def _dup(self, comm: MPI.Intracomm, prepared: tuple[MPI.Intracomm, MPI.Request] | None = None) -> MPI.Intracomm:
        if prepared is None:
            dup = comm.Dup()
        else:  # an MPI_Comm_idup started earlier (prepare_dups): done by now, or finished here
            dup, request = prepared
            request.Wait()
        dup.Set_errhandler(self._mpi.ERRORS_RETURN)
        return dup

    def _arm(self, prepared: tuple[MPI.Intracomm, MPI.Request] | None = None) -> None:
        self._watch_comm = self._dup(self.comm if prepared is None else prepared[0], prepared)
        self._watch = self._watch_comm.Irecv(bytearray(1), source=self._mpi.ANY_SOURCE, tag=WATCH_TAG)
        self._lost = None

    def check_ulfm(self) -> str | None:
        """None when in-job recovery can work here, else one line why not."""
        return check_ulfm()

    @property
    def store(self) -> Store | None:
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

    def waited_s(self) -> float | None:
        """How long this rank has been waiting on the others in a watched collective (`wait`: a step's all-reduce;
        `all_completed`: a commit's agreement; the WatchedTransport's MPI collectives), None while it is not: a
        script's hang clock (mpiddp.job.watchdog, `waited`)."""
        began = self._waiting_from
        return None if began is None else time.monotonic() - began

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """This rank waits on the others meanwhile (waited_s); an inner wait leaves the outer one's start."""
        began = self._waiting_from
        if began is None:
            self._waiting_from = time.monotonic()
        try:
            yield
        finally:
            self._waiting_from = began

    def wait(self, work: Work) -> None:
        """Wait for a torch work (from `async_op=True`) to complete; raise MembersLost when MPI reports a failed
        member first. The torch error of a collective whose peer died becomes MembersLost once MPI confirms it."""
        self.waiting_since = time.time()
        with self.waiting():
            self._wait(work)

    def _wait(self, work: Work) -> None:
        pause = 0.00002
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

    def run_collective(self, issue: Callable[[], Work]) -> Work:
        """Run `issue()`, which starts a torch collective with async_op=True and returns its work, and wait for it
        (see wait). Returns the work."""
        work = issue()
        self.wait(work)
        return work

    def all_completed(self, completed: bool) -> bool:
        """Collective over the members, fault tolerant and uniform (MPI_Comm_agree): True on every member when
        each says it `completed` its part and none failed; False on every survivor alike otherwise (then they
        recover together)."""
        with self.waiting():
            return self._agree(completed)

    def _agree(self, completed: bool) -> bool:
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

    def _shrink(self, old: MPI.Intracomm) -> tuple[MPI.Intracomm, tuple[int, ...]]:
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

    def adopt(self, comm: MPI.Intracomm, prepared: PreparedDups | None = None, store_prefix: str | None = None,
              ) -> float:
        """Collective over `comm` (the survivors and the ranks that joined them, mpiddp.elastic.grow): watch and
        recover over it from now on, with torch's default group rebuilt over it. Returns the process group's
        seconds. A joining rank constructs a Membership on `comm` instead (the same collectives). `store_prefix`:
        the new group's keys go under it in the store this rank holds (rank 0's lives on: no store is built)."""
        try:
            self._watch.Cancel()
            self._watch.Free()
        except self._mpi.Exception:
            pass  # already completed with an error: nothing to cancel
        self._disarm()
        self.comm = self._dup(comm, prepared.own if prepared else None)
        self._arm(prepared.watch if prepared else None)
        started = time.monotonic()
        if store_prefix is not None and self._store is None:  # every member holds rank 0's store after a rebuild
            raise RuntimeError("a grow chose rank 0's store, and this survivor holds none")
        self._rebuild_process_group(store_prefix)
        return time.monotonic() - started

    def start_process_group(self, joined: JoinedStore | None = None) -> None:
        """Collective: torch's default group (self.backend) over `comm`, on a store opened by rank 0 (the same path a
        recovery takes, so start-up and recovery share one rendezvous); a rank that joins a grown job: on the
        survivors' store, which it connected to before (`joined`)."""
        if joined is not None:
            self._store, self.endpoint = joined.store, joined.endpoint
        self._rebuild_process_group(joined.prefix if joined is not None else None)

    def _rebuild_process_group(self, store_prefix: str | None = None) -> None:
        """A fresh store on the new rank 0 (its address broadcast over MPI), then a new default group (gloo, or
        NCCL on the same device: eagerly connected, so its cost lands in the process_group phase). A grow keeps
        rank 0's store (`store_prefix`: the new group's keys under it; the new ranks connected to it while the
        survivors trained): a fresh store and its connections were 0.01-0.03 s of the take-in's stand-still."""
        import torch.distributed as tdist

        timeout = timedelta(seconds=self.collective_timeout_s)
        if tdist.is_initialized():
            if old_group_plan(self.backend, nccl_abort_available()) == "abort":
                self._abort_default_group()
            else:
                self._retire_default_group()
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        if store_prefix is not None and self._store is not None:
            store: Store = tdist.PrefixStore(store_prefix, self._store)
        else:
            endpoint = None
            if rank == 0:
                address = self._address()
                self._store = tdist.TCPStore(address, 0, size, True, timeout=timeout, wait_for_workers=False)
                endpoint = (address, self._store.port)
            address, port = self.endpoint = self.comm.bcast(endpoint, root=0)
            if rank != 0:
                self._store = tdist.TCPStore(address, port, size, False, timeout=timeout)
            store = self._store
        tdist.init_process_group(self.backend, store=store, rank=rank, world_size=size, timeout=timeout,
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
        if not self.spanning:
            return
        try:
            self._watch.Cancel()
            self._watch.Wait()
        except self._mpi.Exception:
            pass  # completed already (with an error): nothing pending on it
        for comm in (self._watch_comm, self.comm, *self.spanning.take_all_but_the_parent()):
            try:
                comm.Free()
            except self._mpi.Exception:
                pass  # revoked or freed already

    def send_large(self, value: object, dests: Iterable[int]) -> None:
        """`value` to each of `dests` (ranks of `comm`, all at once), a pickle of any size (pkl5)."""
        from mpi4py.util import pkl5

        comm = pkl5.Intracomm(self.comm)
        requests = [comm.isend(value, dest=dest, tag=LARGE_TAG) for dest in dests]
        pkl5.Request.waitall(requests)

    def recv_large(self, source: int) -> Any:
        """What `source` sent with send_large."""
        from mpi4py.util import pkl5

        return pkl5.Intracomm(self.comm).recv(source=source, tag=LARGE_TAG)

    def close(self) -> None:
        """Cancel the watch and free the duplicates (every rank; not collective)."""
        try:
            self._watch.Cancel()
            self._watch.Free()
        except self._mpi.Exception:
            pass
        self._disarm()


@dataclass
class JoinedStore:
    """A rank joining a grown job: its client of the survivors' store (rank 0's), connected while they trained, and
    the prefix rank 0 chose for the new group's keys in it (Membership.start_process_group)."""

    store: Store
    endpoint: tuple[str, int]
    prefix: str


@dataclass
class PreparedDups:
    """The two duplicates a Membership over a communicator needs (its own, the failure watch's), started with
    MPI_Comm_idup as a grow merges the new ranks in, so that the take-in does not pay for them in full: both sides
    then go on (the survivors train), and the MPI calls each makes meanwhile progress them; the Membership built
    over them waits for what is left (Membership._dup)."""

    own: tuple[MPI.Intracomm, MPI.Request]
    watch: tuple[MPI.Intracomm, MPI.Request]

    @classmethod
    def start(cls, comm: MPI.Intracomm) -> PreparedDups:
        """Collective over `comm`, nonblocking: every member starts both, in the same order."""
        return cls(comm.Idup(), comm.Idup())

    def free(self) -> None:
        """A grow given up: the duplicates that were made are freed (nothing else holds them)."""
        for dup, request in (self.own, self.watch):
            try:
                if request.Test():
                    dup.Free()
            except Exception:  # noqa: BLE001 - failed with the grow (revoked): nothing was made
                pass


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


def mpi_error_of(members: Membership) -> type[Exception]:
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

    def _trusted(self, value: T) -> T:
        lost = self.members.failed()
        if lost is not None:
            raise MembersLost(lost, self.members._lost or time.time())
        # the aborted schedule knew before the failure watch (another communicator) heard: MPI_Comm_get_failed
        failed = self.failed_ranks()
        if failed:
            raise MembersLost(failed, time.time())
        return value

    def failed_ranks(self) -> tuple[int, ...]:
        return failed_ranks_of(self.comm)

    # each one a wait on the others (Membership.waiting): MPI's collectives have no timeout of their own
    def allgather(self, value: T) -> list[T]:
        with self.members.waiting():
            return self._trusted(super().allgather(value))

    def gather(self, value: T) -> list[T] | None:
        with self.members.waiting():
            return self._trusted(super().gather(value))

    def bcast(self, value: T) -> T:
        with self.members.waiting():
            return self._trusted(super().bcast(value))

    def scatter(self, values: list[T] | None) -> T:
        with self.members.waiting():
            return self._trusted(super().scatter(values))

    def allreduce(self, values: np.ndarray, op: str) -> np.ndarray:
        with self.members.waiting():
            return self._trusted(super().allreduce(values, op))

    def barrier(self) -> None:
        with self.members.waiting():
            self._trusted(super().barrier())

    def idle_barrier(self, poll_s: float) -> None:
        with self.members.waiting():
            self._trusted(super().idle_barrier(poll_s))



def failed_ranks_of(comm: object) -> tuple[int, ...]:
    """The ranks of `comm` that MPI's fault tolerance (ULFM: MPI_Comm_get_failed) knows have failed; local, never a
    message. Empty without ULFM, or when it knows of none."""
    from mpi4py import MPI

    try:
        group = comm.Get_failed()  # type: ignore[attr-defined]
    except (NotImplementedError, AttributeError, MPI.Exception):
        return ()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                          comm.Get_group())  # type: ignore[attr-defined]
    finally:
        group.Free()
    return tuple(sorted(r for r in ranks if r != MPI.UNDEFINED))


# Loaded, the elastic layer answers the job layer's question which peers failed (a failing rank's record names them,
# mpiddp.job.failfast), with or without in-job recovery: every front door loads it before MPI starts (grow.joining).
set_failed_ranks_query(failed_ranks_of)
