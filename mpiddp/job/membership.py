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
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

WATCH_TAG = 27_182  # carried by no message: the watch receive completes only when a member fails
GLOO_ERROR_GRACE_S = 30.0  # gloo saw a peer vanish: how long MPI gets to confirm it before the error is the answer


class MembersLost(Exception):
    """Members of the communicator failed (MPI said so); `ranks` are their ranks in that communicator."""

    def __init__(self, ranks: tuple[int, ...], detected_at: float) -> None:
        super().__init__(f"ranks {', '.join(map(str, ranks)) or '?'} failed")
        self.ranks = ranks
        self.detected_at = detected_at  # time.time() when this rank learnt it


class RecoveryFailed(RuntimeError):
    """In-job recovery cannot go on (the message says why, in one line): fall back to failing the job."""


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


# ---- pure decisions (tested in-process) ----------------------------------------------------------------------

def ulfm_refusal(library_version: str, env: Mapping[str, str], has_api: bool) -> str | None:
    """None when in-job recovery can work with this MPI, else one line why not. `library_version` is
    MPI_Get_library_version's text, `env` the rank's environment, `has_api` whether mpi4py has Comm.Shrink."""
    first = library_version.strip().splitlines()[0] if library_version.strip() else "an unknown MPI"
    if not has_api:
        return "in-job recovery needs mpi4py 4 or newer (Comm.Revoke/Shrink/Agree): this one lacks them"
    if not library_version.startswith("Open MPI"):
        return (f"in-job recovery needs an MPI with ULFM fault tolerance (Open MPI 5 with --with-ft ulfm); "
                f"this job runs {first.split(',')[0]}: a failure ends the job and `launch` relaunches it")
    if env.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes", "t", "y"):
        return ("in-job recovery needs mpirun --with-ft ulfm (Open MPI's fault tolerance is off in this job): "
                "a failure ends the job and `launch` relaunches it")
    return None


def survivors(old_size: int, failed: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Old ranks that are left, in the order of their new ranks (Shrink keeps the old order)."""
    gone = set(failed)
    return tuple(rank for rank in range(old_size) if rank not in gone)


def new_rank_of(old_size: int, failed: tuple[int, ...] | list[int]) -> dict[int, int]:
    """Old rank -> new rank of each survivor."""
    return {old: new for new, old in enumerate(survivors(old_size, failed))}


def recovery_refusal(old_size: int, failed: tuple[int, ...] | list[int], min_size: int) -> str | None:
    """None when the job can go on without `failed`, else one line why not."""
    if not failed:
        return "no rank failed"
    if any(rank < 0 or rank >= old_size for rank in failed):
        return f"failed ranks {sorted(failed)} are not ranks of a {old_size}-rank job"
    left = old_size - len(set(failed))
    if left < max(1, min_size):
        return (f"{left} of {old_size} ranks are left, fewer than the {max(1, min_size)} the job needs "
                f"(--min-np): the job ends and `launch` relaunches it")
    return None


def shrunk_topology(old: Any, alive: tuple[int, ...], new_rank: int) -> Any:
    """The Topology of survivor `new_rank` in a job shrunk to the old ranks `alive` (in new-rank order): hosts and
    local ranks renumbered among the survivors, the launcher's settings kept."""
    return topology_over(old, [old.host_of(rank) for rank in alive], new_rank)


def topology_over(template: Any, hostnames: Sequence[str], rank: int) -> Any:
    """The Topology of rank `rank` in a job whose ranks run on `hostnames` (in rank order): hosts and local ranks
    numbered as at start-up, the launcher's settings taken from `template` (a topology of the same job)."""
    import dataclasses

    from mpiddp.job.topology import RankRecord, build_topology

    records = []
    for index, host in enumerate(hostnames):
        peers = [r for r, h in enumerate(hostnames) if h == host]
        records.append(RankRecord(index, host, peers[0], peers.index(index), len(peers)))
    topology = build_topology(rank, records, template.mpi_library)
    return dataclasses.replace(topology, mpi_settings=template.mpi_settings, restarts=template.restarts,
                               failure_file=template.failure_file, launch_id=template.launch_id,
                               launch_run_dir=template.launch_run_dir, job_record=template.job_record)


def store_address(env: Mapping[str, str], interfaces: list[tuple[str, str]]) -> str:
    """The address this host's new rendezvous store listens on: the interface gloo uses (GLOO_SOCKET_IFNAME,
    set by mpiddp's rendezvous), else the first non-loopback one, else loopback. `interfaces`: (name, address)."""
    chosen = env.get("GLOO_SOCKET_IFNAME")
    for name, address in interfaces:
        if chosen and name == chosen:
            return address
    outside = [address for _, address in interfaces if not address.startswith("127.")]
    return outside[0] if outside else "127.0.0.1"


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
            raise RecoveryFailed(refusal)
        shrunk = time.monotonic()
        self._disarm()
        self.comm = new
        try:
            self._rebuild_process_group()
        except self._mpi.Exception as exc:
            raise RecoveryFailed(f"a second failure during recovery (MPI: {exc}): the job ends") from None
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
        """Collective over `comm` (the survivors and the ranks that joined them, mpiddp.job.grow): watch and
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
        or torch's own watchdog may end this survivor first (recoverability.job_refusal)."""
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

    def close(self) -> None:
        """Cancel the watch and free the duplicates (every rank; not collective)."""
        try:
            self._watch.Cancel()
            self._watch.Free()
        except self._mpi.Exception:
            pass
        self._disarm()


def old_group_plan(backend: str, can_abort: bool) -> str:
    """How the survivors let go of the old default group: "abort" its NCCL communicators (torch's
    _abort_process_group; a NCCL group cannot be left waiting: its kernel holds the GPU stream), else "forget"
    it (gloo: kept alive, never destroyed, see _retire_default_group). A NCCL job on a torch that cannot abort
    is refused up front (recoverability.job_refusal), so "forget" on NCCL is never reached in a recovery."""
    return "abort" if backend == "nccl" and can_abort else "forget"


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
