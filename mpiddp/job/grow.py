"""Growing back after an in-job recovery: new ranks join the survivors without stopping the job.

The mechanism is MPI's own: the survivors' shrunk communicator spawns the missing ranks (`MPI_Comm_spawn`, onto
the spare hosts mpirun was given beyond `-np`: its DVM has a daemon there), and the parent/child
intercommunicator is merged into one intracommunicator, survivors first, so every survivor keeps its rank and
the new ranks come last. Measured on four fake hosts under `mpirun --with-ft ulfm` (Open MPI 5.0.11), after a
Shrink: Spawn 1.1 s (the child's interpreter and MPI_Init), Merge 0.04 s. A spawned process that ends without
MPI_Finalize makes mpirun exit 1, so a grown rank finalises (the survivors still end with os._exit).

Where the spare hosts come from: MPIDDP_SPARE_HOSTS (`host[:slots],...`), which `launch` sets from its host
list and which a user of plain mpirun sets beside `-H`. The failed host counts once it is named there again.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mpiddp.contract import SPARE_HOSTS_ENV

log = logging.getLogger(__name__)


# ---- pure decisions (tested in-process) ----------------------------------------------------------------------

def parse_spare_hosts(text: str) -> list[tuple[str, int]]:
    """`nodea:2,nodeb` -> [("nodea", 2), ("nodeb", 1)]; ValueError (one line) for a malformed entry."""
    hosts = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        name, _, slots = entry.partition(":")
        if not name or (slots and (not slots.isdigit() or int(slots) < 1)):
            raise ValueError(f"{SPARE_HOSTS_ENV}: '{entry}' is not HOST or HOST:SLOTS (SLOTS a positive number)")
        hosts.append((name, int(slots) if slots else 1))
    return hosts


def format_spare_hosts(hosts: Sequence[tuple[str, int]]) -> str:
    """The inverse of parse_spare_hosts."""
    return ",".join(name if slots == 1 else f"{name}:{slots}" for name, slots in hosts)


@dataclass(frozen=True)
class GrowPlan:
    """Where the new ranks start: one host name per new rank, in rank order."""

    hosts: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.hosts)


def plan_growth(world: int, full: int, spares: Sequence[tuple[str, int]], used: Mapping[str, int]) -> GrowPlan | str:
    """Which spare slots the job grows onto, to get from `world` ranks back to `full`, or one line why it cannot.
    `used`: slots of each spare host that an earlier grow took (a grown rank that died gives its slot back only
    when the host is named again)."""
    missing = full - world
    if missing <= 0:
        return "the job runs at full size"
    hosts: list[str] = []
    for name, slots in spares:
        free = slots - used.get(name, 0)
        hosts.extend([name] * max(0, min(free, missing - len(hosts))))
    if not hosts:
        named = format_spare_hosts(spares) if spares else "none"
        return (f"no spare slot to grow onto ({SPARE_HOSTS_ENV}: {named}; `launch` sets it from its spare hosts, "
                f"with plain mpirun name spare hosts in -H and in {SPARE_HOSTS_ENV})")
    return GrowPlan(tuple(hosts))


def grow_due(stepped_since: bool, world: int, full: int, off: bool) -> bool:
    """Whether the job grows at this step boundary: while a recovery has left it below full size, once it has
    trained a step since the last change of size (that change's first step is recorded), and while growing is
    not off."""
    return stepped_since and world < full and not off


# ---- the MPI side --------------------------------------------------------------------------------------------

# Communicators that span the first job and the spawned one, in the order both sides made them: a spawned rank's
# MPI_Finalize disconnects from every process it is still connected to, and waits forever for survivors that
# end with os._exit (measured: stuck in ompi_dpm_dyn_finalize), so every side disconnects them at the end.
_spanning: list[Any] = []

def spawn_command() -> tuple[str, list[str]]:
    """The command a new rank runs: this rank's own `python -m mpiddp ...` (the same training flags)."""
    return sys.executable, ["-m", "mpiddp", *sys.argv[1:]]


def spawn_and_merge(comm: Any, plan: GrowPlan) -> tuple[Any, dict[str, float]]:
    """Collective over the survivors' `comm`: start plan.count new ranks on plan.hosts and merge them in after
    the survivors. Returns (the merged intracommunicator, {spawn, merge} seconds); MPI.Exception when the
    spawn fails (every survivor gets it: MPI_Comm_spawn is collective)."""
    from mpi4py import MPI

    command, args = spawn_command()
    info = MPI.Info.Create()
    try:
        info.Set("host", ",".join(plan.hosts))
        info.Set("wdir", os.getcwd())  # `-m mpiddp` must find the same package (a checkout, a venv)
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


def joining() -> bool:
    """Whether this process was spawned by a job growing back (it has an MPI parent). Initialises MPI."""
    from mpiddp.job.mpistart import init_mpi

    init_mpi()
    from mpi4py import MPI

    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def merge_with_parent() -> Any:
    """A spawned rank's side of spawn_and_merge: the merged intracommunicator (this rank after the survivors)."""
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    _spanning.extend([parent, merged])
    return merged


def release(members: Any) -> None:
    """A spawned rank at its very end (after the teardown's barrier), before MPI_Finalize: cancel the failure
    watch and free every communicator that spans both jobs except the parent's. Measured with Open MPI 5.0.11
    under ULFM after a shrink: MPI_Comm_disconnect hangs in PMIx_Fence on every side, and MPI_Finalize with
    these still held waits forever in ompi_dpm_dyn_finalize for survivors that ended with os._exit. The
    survivors do nothing (they end without MPI_Finalize, as after any recovery)."""
    if not _spanning:
        return
    from mpi4py import MPI

    try:
        members._watch.Cancel()
        members._watch.Wait()
    except MPI.Exception:
        pass  # completed already (with an error): nothing pending on it
    for comm in (members._watch_comm, members.comm, *reversed(_spanning[1:])):
        try:
            comm.Free()
        except MPI.Exception:
            pass  # revoked or freed already
    _spanning.clear()


def own_host() -> str:
    return socket.gethostname()


def regrown_topology(template: Any, hostnames: Sequence[str], rank: int) -> Any:
    """The Topology of rank `rank` in the grown job, whose ranks run on `hostnames` (in rank order), the
    launcher's settings taken from `template` (rank 0's topology)."""
    from mpiddp.job.membership import topology_over

    return topology_over(template, hostnames, rank)


def spare_hosts_here(env: Mapping[str, str] | None = None) -> list[tuple[str, int]] | str:
    """The spare hosts this job was given, or one line why they cannot be read."""
    try:
        return parse_spare_hosts((os.environ if env is None else env).get(SPARE_HOSTS_ENV, ""))
    except ValueError as exc:
        return str(exc)
