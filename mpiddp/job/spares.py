"""Hot spares: the last MPIDDP_SPARE_RANKS ranks of COMM_WORLD are started with the job and wait; the job's own
communicator is COMM_WORLD less them (split off as MPI starts, a collective every rank takes part in). Growing back
takes a waiting spare in without starting a process (mpiddp.elastic.spawning.wake_and_merge): nothing goes
through the launcher's PMIx_Connect, which Open MPI 5.0.11's prterun can crash in (docs/recovery.md).

This module keeps the world the spares live in: COMM_WORLD at the start, shrunk at every grow onto a spare (a
world with a failed process cannot create a group: MPI_ERR_PROC_FAILED, measured), and which of its ranks still
wait. It imports no mpi4py: the job layer's MPI home (mpiddp.job.mpistart) hands it MPI as the spares split off.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

from mpiddp.contract import SPARE_RANKS_ENV
from mpiddp.errors import UserError
from mpiddp.job.abort import abort_within

if TYPE_CHECKING:
    from mpi4py import MPI


@dataclass
class SpareWorld:
    world: MPI.Intracomm  # COMM_WORLD, then each shrunk world after a grow onto a spare
    everyone: MPI.Intracomm  # COMM_WORLD: MPI_Abort over it ends every process, the spares included
    waiting: list[int] = field(default_factory=list)  # the world's ranks of the spares still waiting
    hosts: list[str] = field(default_factory=list)  # the host of each waiting spare (as `waiting`)
    this_is_a_spare: bool = False
    waits: bool = False  # this process is a spare still waiting (not taken in yet): known without asking MPI
    failures_seen: bool = False  # a spare acknowledged a failed process: it ends with os._exit, not MPI_Finalize
    silent: list[str] = field(default_factory=list)  # rank 0: hosts of spares that did not answer its ping
    released: str = ""  # a spare the job released before its end: why (it ends at once: end_released_spare)

    def spare_hosts(self) -> list[tuple[str, int]]:
        """(host, spares waiting there), in the order they wait: what growing back may take."""
        counts: dict[str, int] = {}
        for host in self.hosts:
            counts[host] = counts.get(host, 0) + 1
        return list(counts.items())


_spares: SpareWorld | None = None
# a worker's word to every waiting spare: ("join", survivors, chosen, waiting, hosts), ("ping", rank), ("leave",) at
# the job's end, or ("leave", why) where the job releases its spares while it runs on
WAKE_TAG = 7704
BACK_TAG = 7705  # a hot spare's word to every worker that it waits again (its grow was given up)
PONG_TAG = 7706  # a waiting spare's answer to rank 0's ("ping", rank) on WAKE_TAG


def spare_count(env: dict[str, str] | None = None) -> int:
    """MPIDDP_SPARE_RANKS, 0 when unset. UserError (one line) for anything but a whole number >= 0."""
    text = (os.environ if env is None else env).get(SPARE_RANKS_ENV, "").strip()
    if not text:
        return 0
    if not text.isdigit():
        raise UserError(f"{SPARE_RANKS_ENV}={text!r}: give the number of hot spare ranks (the last ranks of "
                         "mpirun's -np), e.g. 1")
    return int(text)


def split_off_spares(world: MPI.Intracomm, count: int, mpi: ModuleType) -> MPI.Intracomm:
    """Collective over COMM_WORLD (`world`), as MPI starts: the workers' communicator (the first size - count
    ranks), or COMM_WORLD itself for a spare (which then waits: mpiddp.elastic.spawning.merge_with_parent).
    UserError when no worker would be left. `mpi`: mpi4py's MPI, from mpiddp.job.mpistart."""
    global _spares
    size, rank = world.Get_size(), world.Get_rank()
    if count >= size:  # every rank alike, before any collective
        raise UserError(f"{SPARE_RANKS_ENV}={count} leaves no rank to train with -np {size}: run more ranks than "
                         "spares")
    spare = rank >= size - count
    workers = world.Split(mpi.UNDEFINED if spare else 0, rank)
    world.Set_errhandler(mpi.ERRORS_RETURN)
    hosts = world.allgather(socket.gethostname())
    _spares = SpareWorld(world, world, list(range(size - count, size)), hosts[size - count:], spare, waits=spare)
    if not spare:  # before mpi4py's MPI_Finalize (exit handlers run last registered first)
        atexit.register(release_spares)
    return world if spare else workers


def spare_world() -> SpareWorld | None:
    """The hot spares' world, where the job has any (else None)."""
    return _spares


def is_hot_spare() -> bool:
    return _spares is not None and _spares.this_is_a_spare


def release_spares(why: str = "") -> None:
    """A worker that ends: tell every spare still waiting to leave (MPI_Finalize would otherwise wait for them;
    every worker says it, a spare leaves at the first word); never raises. Survivors that end with os._exit say
    nothing: a spare leaves once every worker failed (mpiddp.elastic.spawning.wait_to_join). `why`: the job
    releases its spares while it runs on (it will never take one in): each says it and ends at once. Not
    collective: every worker calls it at the same point of its script, with the same spares waiting."""
    spares = _spares
    if spares is None or spares.this_is_a_spare:
        return
    word = ("leave", why) if why else ("leave",)
    for spare in spares.waiting:
        try:
            spares.world.send(word, dest=spare, tag=WAKE_TAG)
        except Exception:  # noqa: BLE001 - that spare is gone
            pass
    spares.waiting, spares.hosts = [], []


def end_silent_spares(status: int) -> None:
    """A survivor at its very end: where rank 0 found a spare that does not answer (stopped, or its host silent),
    nothing else ends it (it cannot read the job's word to leave, nor see the workers end), and Open MPI's
    launcher under --with-ft ulfm would wait for it for good: one line, then MPI_Abort over COMM_WORLD with the
    job's own `status` (mpirun then exits with it: 0 for a job that finished, measured). Otherwise nothing."""
    spares = _spares
    if spares is None or not spares.silent:
        return
    print(f"mpiddp: the hot spare on {', '.join(sorted(set(spares.silent)))} never answered; the job ends it "
          f"(MPI_Abort, status {status})", file=sys.stderr, flush=True)
    abort_within(spares.everyone, status)


def abort_with_spares(code: int) -> None:
    """A worker ending the job from a helper thread (Dist.abort_from_thread), while hot spares wait: MPI_Abort over
    COMM_WORLD ends every process, the spares and a stopped rank included; it does not return. Otherwise nothing:
    the caller's own exit ends the job. Open MPI's launcher under --with-ft ulfm does not end the job for one
    rank's exit while other processes run (measured: a spare waiting kept mpirun and a stopped rank alive for
    good), and a spare cannot tell that exit from a failure the survivors recover from. MPI is FUNNELED here, but
    MPI_Abort from a helper thread while the main thread waits inside MPI ended every process (measured)."""
    spares = _spares
    if spares is None or not spares.waiting or spares.waits:  # a spare taken in aborts as the workers do
        return
    abort_within(spares.everyone, code)
