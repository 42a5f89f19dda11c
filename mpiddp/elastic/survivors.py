"""What every survivor of an in-job recovery does, whoever drives the recovery (the built-in trainer, or a script's
`mpiddp.run_recoverable`): follow the shrunk (or grown) job (rank, communicator, store, topology, logging,
environment, failure reporting), stop where a rank already recorded the end of the job, and end without
MPI_Finalize.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from mpiddp.errors import EXIT_CRASH, EndDecided
from mpiddp.failure import end_decided, replace_placement
from mpiddp.job import mpistart, storekeys
from mpiddp.elastic.membership import Membership, WatchedTransport
from mpiddp.job.collective import Dist, Rendezvous
from mpiddp.job.log import setup_logging
from mpiddp.job.storeload import add_within
from mpiddp.job.topology import Topology

if TYPE_CHECKING:
    from mpiddp.job.failfast import FailFast

log = logging.getLogger("mpiddp")

REPORT_CLAIM_S = 2.0


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
    """This process went through an in-job recovery (its MPI world holds failed processes): it ends without
    MPI_Finalize (end_without_finalize). Kept with the process's MPI life (mpiddp.job.mpistart), which every front
    door's ending reads."""
    mpistart.mark_world_failed()


def recovered_in_this_process() -> bool:
    return mpistart.world_failed()


@dataclass(frozen=True)
class OpenedStore:
    """The survivors' store where a Rendezvous keeps the bootstrap's holder of it (Rendezvous.client reads it)."""

    store: object


def end_without_finalize(status: int) -> NoReturn:
    """End a survivor after a recovery, once everything is written and every survivor has finished: without
    MPI_Finalize, which Open MPI's ULFM can hang in after a shrink (open-mpi/ompi#11404). mpirun takes the exit
    of a process of a failed-and-shrunk job as it is (status 0 included)."""
    from mpiddp.job.log import flush_logs
    from mpiddp.job.spares import end_silent_spares

    flush_logs()
    sys.stdout.flush()
    sys.stderr.flush()
    end_silent_spares(status)  # a spare that never answered would keep the launcher waiting
    os._exit(status)


def bind_topology(dists: Sequence[Dist], members: Membership, topology: Topology, guard: FailFast | None,
                  log_level: str | None, verb: str = "goes on") -> None:
    """Every holder of the job's Dist now sees `topology` over the Membership's communicator and store (after a
    shrink: shrunk_topology; after a grow: topology_over): new rank, communicator, store; the log lines name the new
    rank (`log_level`: the level the job chose, None to leave logging alone), the new rank 0 rewrites the placement
    `launch` reads, the guard reports through the new store, torchrun's variables follow."""
    transport = WatchedTransport(members)
    old = dists[0].rendezvous
    address, port = members.endpoint or ("", 0)
    rendezvous = Rendezvous(address, port, old.interface_per_host if old else {},
                            OpenedStore(members.store))
    for each in dists:
        each.rebind(topology, transport, rendezvous if each.rendezvous is not None else None)
    if log_level is not None:
        setup_logging(topology, log_level)
    if topology.failure_file and topology.rank == 0:  # a later failure's records name ranks of this world
        replace_placement(Path(topology.failure_file), [(name, list(ranks)) for name, ranks in topology.hosts])
    log.warning("in-job recovery: this process (pid %d) %s as rank %d of %d", os.getpid(), verb, topology.rank,
                topology.world_size)
    if guard is not None:  # the one full failure report, and the count of failed ranks, on the new store
        store = members.store
        guard.claim_report = lambda: add_within(store, storekeys.FAILURE_REPORTS, 1, REPORT_CLAIM_S) == 1
        guard.tally = lambda amount: add_within(store, storekeys.FAILED_RANKS, amount, REPORT_CLAIM_S)
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(topology.rank),
                      WORLD_SIZE=str(topology.world_size), LOCAL_RANK=str(topology.local_rank),
                      LOCAL_WORLD_SIZE=str(topology.local_world_size))


def hosts_of(topology: Topology, ranks: Sequence[int]) -> list[str]:
    """The hosts of `ranks` (ranks of `topology`'s world), each once, in rank order; a rank that was joining (a grow
    cut short) is not in the topology: named by its rank only."""
    return list(dict.fromkeys(topology.host_of(rank) if rank < topology.world_size else f"joining rank {rank}"
                              for rank in ranks))


def shrunk_topology(old: Topology, alive: tuple[int, ...], new_rank: int) -> Topology:
    """The Topology of survivor `new_rank` in a job shrunk to the old ranks `alive` (in new-rank order): hosts and
    local ranks renumbered among the survivors, the launcher's settings kept."""
    return topology_over(old, [old.host_of(rank) for rank in alive], new_rank)


def topology_over(template: Topology, hostnames: Sequence[str], rank: int) -> Topology:
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
                               restarted_by=template.restarted_by, failure_file=template.failure_file,
                               launch_id=template.launch_id, launch_run_dir=template.launch_run_dir,
                               job_record=template.job_record)
