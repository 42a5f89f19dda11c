"""Growing back after an in-job recovery: new ranks join the survivors without stopping the job. Both sides side
by side: the survivors' (GrowBack: when to grow, spawn, merge, hand over the state) and the joining rank's
(join: merge, hello, process group, the state).

The mechanism is MPI's own (mpiddp.elastic.membership): the survivors' shrunk communicator spawns the missing
ranks (`MPI_Comm_spawn`, onto the spare hosts mpirun was given beyond `-np`: its DVM has a daemon there), and the
parent/child intercommunicator is merged into one intracommunicator, survivors first, so every survivor keeps its
rank and the new ranks come last. Measured on four fake hosts under `mpirun --with-ft ulfm` (Open MPI 5.0.11),
after a Shrink: Spawn 1.1 s (the child's interpreter and MPI_Init), Merge 0.04 s. A spawned process that ends
without MPI_Finalize makes mpirun exit 1, so a grown rank finalises (the survivors still end with os._exit).

Where the spare hosts come from: MPIDDP_SPARE_HOSTS (`host[:slots],...`), which `launch` sets from its host
list and which a user of plain mpirun sets beside `-H`. The failed host counts once it is named there again.

At a step boundary after a recovery (and after one step at reduced size), the survivors spawn the missing ranks,
merge them in after themselves, rebuild the process group on a new store, send them the state from rank 0's
memory (what the user's policy hands over; nothing from disk), wrap DDP again and re-split the global batch at
the same sample, as a recovery does, the other way. Both sides run the same collectives in the same order over
the merged communicator:
  hello (rank 0's topology and settings; every host name)  ->  Membership + process group  ->  the state
  ->  DDP  ->  the loop (the survivors go on in their epoch, the new ranks enter it at the same batch).
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mpiddp import failure
from mpiddp.elastic import membership as mpigrow  # MPI's side of growing back: spawn, merge, the parent
from mpiddp.elastic.decide import GrowPlan, grow_due, grow_record, plan_growth, spare_hosts_in
from mpiddp.elastic.membership import MembersLost, Membership, mpi_error_of
from mpiddp.elastic.survivors import topology_over
from mpiddp.errors import EXIT_HANG

log = logging.getLogger("mpiddp")
# A spawn that has not returned by then never will (a spare lost during it: seen under the relay layout, where its
# daemon's loss no longer ends the job). A healthy one takes 0.2-3 s here; a cold start on a busy shared file
# system can take tens of seconds.
SPAWN_TIMEOUT_S = 60.0


class Regrown(Exception):
    """New ranks joined the job at a step boundary: the epoch goes on with the new split."""


# ---- the survivors' side -------------------------------------------------------------------------------------------

class GrowBack:
    """The survivors' side: when to grow, and the grow itself (collective over the survivors). `recovery` is a
    user's elastic policy bound to its engine (mpiddp.elastic.engine.Policy: the trainer's or a script's): its
    engine, members and dists, and the steps a grow asks of it (grow_split, spawn_command, pause_watch,
    follow_watch, handover, bind, rewrap_grown, grown, fall_back). `grown` gets the monotonic time of the step
    boundary where the survivors stopped: their stand-still (`survivors_stall`) runs from there to their next step's
    end."""

    def __init__(self, spares: list[tuple[str, int]], off: str | None = None) -> None:
        self.spares = spares
        self.used: dict[str, int] = {}  # spare slots taken by earlier grows
        self.off = off  # why the job does not grow (said once), None while it may

    @classmethod
    def from_env(cls) -> GrowBack:
        spares = spare_hosts_in(os.environ)
        return cls([], spares) if isinstance(spares, str) else cls(spares)

    def at_boundary(self, recovery: Any) -> None:
        """Collective, at each training step's boundary: grow when due; Regrown when new ranks joined."""
        dist = recovery.dists[0]
        if not grow_due(recovery.stepped_since_change, dist.world_size, recovery.engine.initial_world, self.said_off):
            return
        if self.off is not None:  # the spare hosts could not be read: said once, when it matters
            return self.stop_growing(dist, self.off)
        decision = plan_growth(dist.world_size, recovery.engine.initial_world, self.spares, self.used)
        decision = dist.transport.bcast(decision if dist.is_main else None)  # rank 0 decides
        if isinstance(decision, str):
            return self.stop_growing(dist, decision)
        split = recovery.grow_split(dist.world_size, dist.world_size + decision.count)
        if isinstance(split, str):
            return self.stop_growing(dist, split)
        if split is None:  # not at this position (the trainer's: at the next epoch's start it is)
            return
        if self.grow(recovery, decision, split):
            raise Regrown()

    @property
    def said_off(self) -> bool:
        return self.off == "said"

    @property
    def offered(self) -> bool:
        """Whether the job was given spare hosts (or named them wrongly) and has not said why it does not grow."""
        return bool(self.spares) or (self.off is not None and not self.said_off)

    def stop_growing(self, dist: Any, reason: str) -> None:
        if dist.is_main:  # a local log line, no collective
            log.warning("not growing back: %s; the job goes on with %d ranks", reason, dist.world_size)
        self.off = "said"

    def grow(self, recovery: Any, plan: GrowPlan, split: Any) -> bool:
        """Collective over the survivors: spawn, merge, rebuild, send the state, wrap again. False (one line on
        rank 0) when the spawn fails: the job goes on at reduced size. A new rank that fails while joining ends
        the job (fall_back: one line, then fail fast; `launch` relaunches)."""
        members, dist = recovery.members, recovery.dists[0]
        mpi_error = mpi_error_of(members)
        before, step, stalled_from = dist.world_size, recovery.steps_done(), time.monotonic()
        recovery.pause_watch()
        # launch's evidence that a launcher failing now failed during the spawn (Open MPI 5.0.11's prterun can
        # crash in MPI_Comm_spawn), which says nothing against the hosts spawned onto
        records = recovery.records_dir() if dist.is_main else None
        failure.mark_spawning(records, list(plan.hosts))
        try:
            with bounded(SPAWN_TIMEOUT_S, lambda: spawn_stuck(dist, plan.hosts, records, step)):
                merged, phases = mpigrow.spawn_and_merge(members.comm, plan, recovery.spawn_command())
        except mpi_error as exc:  # the mark stays: the launcher may be failing (its daemon lost)
            recovery.follow_watch(dist)
            self.stop_growing(dist, f"MPI_Comm_spawn on {', '.join(plan.hosts)} failed ({str(exc).splitlines()[0]})")
            return False
        failure.spawned(records)
        try:
            self._join(recovery, merged, split, phases)
        except (mpi_error, MembersLost, RuntimeError, pickle.UnpicklingError, EOFError) as exc:
            # a new rank died while joining: a reduction over the merged job can even return garbage (ULFM)
            joining = tuple(range(before, before + plan.count))
            recovery.fall_back(f"a new rank failed while joining on {', '.join(plan.hosts)} "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", joining)
        recovery.follow_watch(dist)
        for host in plan.hosts:
            self.used[host] = self.used.get(host, 0) + 1
        added = list(range(before, dist.world_size))
        recovery.grown(grow_record(step, added, list(plan.hosts), before, dist.world_size, phases), split, stalled_from)
        return True

    @staticmethod
    def _join(recovery: Any, merged: Any, split: Any, phases: dict[str, float]) -> None:
        """Collective over the merged job (the survivors' half of `join`): hello, the process group, the state,
        the topology, the wrapper again."""
        members, dist = recovery.members, recovery.dists[0]
        hello = merged.bcast(hello_of(dist, recovery) if dist.is_main else None, root=0)
        hostnames = merged.allgather(dist.topology.hostname)
        phases["process_group"] = members.adopt(merged)
        started = time.monotonic()
        members.bcast_large(recovery.handover(split) if dist.is_main else None)
        phases["state_transfer"] = time.monotonic() - started
        recovery.bind(topology_over(hello["topology"], hostnames, members.comm.Get_rank()), "stays")
        started = time.monotonic()
        recovery.rewrap_grown(split, dist)
        phases["ddp"] = time.monotonic() - started


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


def spawn_stuck(dist: Any, hosts: tuple[str, ...] | list[str], records: Any, step: int | None) -> None:
    """MPI_Comm_spawn never returned: a spare whose host or MPI daemon died during the spawn (PRRTE then waits for
    it forever). The survivors cannot leave the call: each ends its process; rank 0 says why and records it (a
    hang that blames no host: the spare's relaunch start finds out), which also tells launch, whose mpirun waits
    for the spawn forever, that the job is over while its spawn mark stands."""
    if dist.is_main:
        message = (f"MPI_Comm_spawn onto {', '.join(hosts)} has not returned after {SPAWN_TIMEOUT_S:g} s (its host "
                   "or its MPI daemon is gone?); the survivors cannot leave the call")
        sys.stderr.write(f"mpiddp: growing back: {message}: ending the job (launch relaunches it)\n")
        if records is not None:
            failure.write_rank(records, dist.rank, failure.FailureRecord(
                "hang", [], [], message, step=step, rank=dist.rank, status=EXIT_HANG, progressed=True))
    dist.abort_from_thread(EXIT_HANG)


def say_grown(dist: Any, initial_world: int, record: dict[str, Any], how: str) -> None:
    """Rank 0's line for a grow (`how`: how the job goes on, its split), and, back at full size, one more."""
    if not dist.is_main:
        return
    phases = record["phases"]
    log.warning("grew back: ranks %s joined on %s; %d ranks go on %s; spawn %.3f s, merge %.3f s, process group "
                "%.3f s, state transfer %.3f s, DDP %.3f s", record["ranks_added"], ", ".join(record["hosts_added"]),
                dist.world_size, how, phases["spawn"], phases["merge"], phases["process_group"],
                phases["state_transfer"], phases["ddp"])
    if dist.world_size >= initial_world:
        log.warning("running at full size again: %d ranks", dist.world_size)


def hello_of(dist: Any, recovery: Any) -> dict[str, Any]:
    """Rank 0's first word to the new ranks: what they need before the process group."""
    rendezvous = dist.rendezvous
    return {"topology": dist.topology, "backend": recovery.members.backend, "initial_world": recovery.engine.initial_world,
            "interface_per_host": dict(rendezvous.interface_per_host) if rendezvous else {},
            "min_size": recovery.engine.min_size, "collective_timeout_s": recovery.members.collective_timeout_s}


# ---- the joining rank's side ---------------------------------------------------------------------------------------

@dataclass
class Joining:
    """A new rank's view of the job it joined (the joining half of GrowBack._join, up to the state)."""

    members: Membership
    hello: dict[str, Any]  # rank 0's: topology, backend, initial_world, interface_per_host, min_size, timeout
    topology: Any  # this rank's in the grown job
    device: Any  # this rank's torch.device: its GPU where the job runs on NCCL, as the survivors' bootstrap chose
    added: tuple[list[int], list[str], int, int]  # (new ranks, their hosts, world before, world after)
    phases: dict[str, float | None]


def joining() -> bool:
    """Whether this process was spawned by a job growing back (it has an MPI parent). Initialises MPI."""
    return mpigrow.joining()


def join() -> Joining:
    """Collective over the merged job: the new rank's half of GrowBack._join up to the state (hello, the
    process group on the survivors' backend, the topology)."""
    merged = mpigrow.merge_with_parent()
    hello = merged.bcast(None, root=0)
    hostnames = merged.allgather(own_host())
    point_gloo_at(hello["interface_per_host"], hello["topology"].hostname)
    topology = topology_over(hello["topology"], hostnames, merged.Get_rank())
    device = joining_device(hello["backend"], topology)
    started = time.monotonic()
    # the survivors adopt the merged job on their own backend (Membership.adopt): NCCL on GPUs, so must this rank
    members = Membership(merged, hello["collective_timeout_s"], backend=hello["backend"],
                         device=device if device.type == "cuda" else None)
    members.start_process_group()
    phases: dict[str, float | None] = {"process_group": time.monotonic() - started}
    before = hello["topology"].world_size
    added = (list(range(before, len(hostnames))), list(hostnames[before:]), before, len(hostnames))
    return Joining(members, hello, topology, device, added, phases)


def joining_device(backend: str, topology: Any) -> Any:
    """The new rank's device, bound as the bootstrap binds a rank's (cuda:<local rank>, or cuda:0 where it sees
    one GPU) when the job runs on NCCL; the CPU otherwise."""
    import torch

    from mpiddp.job.bootstrap import choose_device
    from mpiddp.job.flags import DistSettings

    device_type, _, index = choose_device(DistSettings("cuda" if backend == "nccl" else "cpu", backend), topology)
    if index is not None:
        torch.cuda.set_device(index)
    return torch.device(device_type, index)


def joined_dist(joining: Joining, num_threads: int) -> Any:
    """The new rank's Dist in the grown job (its process group is up), torchrun's variables exported."""
    from types import SimpleNamespace

    from mpiddp.elastic.membership import WatchedTransport
    from mpiddp.job.bootstrap import export_environment
    from mpiddp.job.collective import Dist, Rendezvous

    members, hello, topology, device = joining.members, joining.hello, joining.topology, joining.device
    address, port = members.endpoint or ("", 0)
    rendezvous = Rendezvous(address, port, hello["interface_per_host"], SimpleNamespace(store=members.store))
    dist = Dist(topology, WatchedTransport(members), device.type, device.index, hello["backend"], rendezvous,
                num_threads)
    export_environment(topology, address, port)
    log.warning("grow: this process (pid %d) joins as rank %d of %d", os.getpid(), topology.rank, topology.world_size)
    return dist


def receive(joining: Joining) -> dict[str, Any]:
    """Collective over the merged job: the state rank 0 handed over (GrowBack._join), timed as state_transfer."""
    started = time.monotonic()
    payload = joining.members.bcast_large(None)
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
