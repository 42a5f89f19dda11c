"""What every survivor of an in-job recovery does, whoever drives the recovery (the built-in trainer, or a script's
`mpiddp.run_recoverable`): tell a failed peer from any other error, follow the shrunk job (rank, communicator,
store, logging, environment, failure reporting) and end without MPI_Finalize.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NoReturn

from mpiddp.errors import EXIT_CRASH, EndDecided
from mpiddp.failure import end_decided, replace_placement
from mpiddp.job import storekeys
from mpiddp.job.collective import Dist, MpiTransport, Rendezvous
from mpiddp.job.log import setup_logging
from mpiddp.job.membership import MembersLost, Membership, Recovered, shrunk_topology
from mpiddp.job.storeload import add_within
from mpiddp.job.topology import Topology

if TYPE_CHECKING:
    from mpiddp.job.failfast import FailFast

log = logging.getLogger("mpiddp")

CONFIRM_S = 2.0  # a torch error on a rank: how long MPI gets to report a failed peer before the error stands
REPORT_CLAIM_S = 2.0

_recovered = False  # this process went through an in-job recovery (its MPI world has failed members)


def unless_end_decided(directory: Path | None, lost: Sequence[int]) -> None:
    """Before a recovery starts, and before it is put on record: EndDecided when a rank already recorded the end
    of the job (a fatal failure, the hang fallback, a stop). The peers that left then left on purpose, or will be
    torn down with the rest (mpirun resumes a stopped rank with SIGCONT before its SIGTERM, and that rank must not
    "recover" from the rank that ended the job): nobody is lost, and nothing is recovered or recorded."""
    decided = end_decided(directory)
    if decided is None:
        return
    said = decided.message.splitlines()[0] if decided.message else decided.kind
    raise EndDecided(f"rank {decided.rank if decided.rank is not None else '?'} recorded the end of the job "
                     f"({decided.kind}: {said}); not recovering from the exit of rank(s) "
                     f"{', '.join(map(str, lost)) or '?'}: leaving with the job", decided.status or EXIT_CRASH)


def mark_recovered() -> None:
    global _recovered
    _recovered = True


def recovered_in_this_process() -> bool:
    return _recovered


def end_without_finalize(status: int) -> NoReturn:
    """End a survivor after a recovery, once everything is written and every survivor has finished: without
    MPI_Finalize, which Open MPI's ULFM can hang in after a shrink (open-mpi/ompi#11404). mpirun takes the exit
    of a process of a failed-and-shrunk job as it is (status 0 included)."""
    from mpiddp.job.log import flush_logs

    flush_logs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


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


class WatchedTransport(MpiTransport):
    """MPI over the Membership's communicator, trusting no collective that returns after MPI reported a failed
    member: under ULFM a collective interrupted by a failure can return on some ranks without an error and with
    its buffer never filled (seen: an Allreduce of the stop agreement after Open MPI aborted its schedule, whose
    garbage asked for a save). It raises MembersLost instead; the survivors recover, and `_same_position` puts
    any survivor that got further back in step. One MPI_Test and one MPI_Comm_get_failed (local) per collective."""

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


def rebind_survivors(dists: Sequence[Dist], members: Membership, before: Topology, recovered: Recovered,
                     guard: FailFast | None, log_level: str | None) -> Topology:
    """Every holder of the job's Dist now sees the survivors (see bind_topology)."""
    topology = shrunk_topology(before, recovered.old_ranks_alive, recovered.rank)
    bind_topology(dists, members, topology, guard, log_level)
    return topology


def bind_topology(dists: Sequence[Dist], members: Membership, topology: Topology, guard: FailFast | None,
                  log_level: str | None, verb: str = "goes on") -> None:
    """Every holder of the job's Dist now sees `topology` over the Membership's communicator and store (after a
    shrink, or a grow): new rank, communicator, store; the log lines name the new rank (`log_level`: the level
    the job chose, None to leave logging alone), the new rank 0 rewrites the placement `launch` reads, the guard
    reports through the new store, torchrun's variables follow."""
    transport = WatchedTransport(members)
    old = dists[0].rendezvous
    address, port = members.endpoint or ("", 0)
    rendezvous = Rendezvous(address, port, old.interface_per_host if old else {},
                            SimpleNamespace(store=members._store))
    for each in dists:
        each.rebind(topology, transport, rendezvous if each.rendezvous is not None else None)
    if log_level is not None:
        setup_logging(topology, log_level)
    if topology.failure_file and topology.rank == 0:  # a later failure's records name ranks of this world
        replace_placement(Path(topology.failure_file), [(name, list(ranks)) for name, ranks in topology.hosts])
    log.warning("in-job recovery: this process (pid %d) %s as rank %d of %d", os.getpid(), verb, topology.rank,
                topology.world_size)
    if guard is not None:  # the one full failure report, and the count of failed ranks, on the new store
        store = members._store
        guard.claim_report = lambda: add_within(store, storekeys.FAILURE_REPORTS, 1, REPORT_CLAIM_S) == 1
        guard.tally = lambda amount: add_within(store, storekeys.FAILED_RANKS, amount, REPORT_CLAIM_S)
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(topology.rank),
                      WORLD_SIZE=str(topology.world_size), LOCAL_RANK=str(topology.local_rank),
                      LOCAL_WORLD_SIZE=str(topology.local_world_size))


def hosts_of(topology: Topology, ranks: Sequence[int]) -> list[str]:
    """The hosts of `ranks` (ranks of `topology`'s world), each once, in rank order."""
    return list(dict.fromkeys(topology.host_of(rank) for rank in ranks))
