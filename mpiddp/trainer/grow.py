"""Growing back to full size after an in-job recovery, for the built-in trainer.

At a step boundary after a recovery (and after one step at reduced size), the survivors spawn the missing ranks
on spare hosts (mpiddp.job.grow), merge them in after themselves, rebuild the process group on a new store, send
them the model, optimizer, schedule, scaler, an RNG stream and the data position from rank 0 (nothing from
disk), wrap DDP again and re-split the global batch at the same sample, as a recovery does, the other way.

Both sides run the same collectives in the same order over the merged communicator:
  hello (rank 0's topology and settings; every host name)  ->  Membership + process group  ->  the state
  ->  DDP  ->  the loop (the survivors go on in their epoch, the new ranks enter it at the same batch).
Where growing cannot work (no spare slot, the spawn fails, the global batch does not split) rank 0 says why
once, and the job goes on at reduced size.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import time
from typing import Any

from mpiddp import failure
from mpiddp.job import grow as mpigrow
from mpiddp.job.membership import MembersLost
from mpiddp.trainer.recoverable import Regrown, Resplit, resplit

log = logging.getLogger("mpiddp")

GROW_PHASES = ("spawn", "merge", "process_group", "state_transfer", "ddp", "first_step")


def grow_record(step: int, ranks: list[int], hosts: list[str], before: int, after: int,
                phases: dict[str, float | None]) -> dict[str, Any]:
    """A grow as summary.json's `recoveries` list holds it, next to the recoveries (cause "grew")."""
    return {"cause": "grew", "ranks_lost": [], "hosts_lost": [], "ranks_added": ranks, "hosts_added": hosts,
            "step": step, "steps_lost": 0, "world_before": before, "world_after": after,
            "phases": {name: phases.get(name) for name in GROW_PHASES}}


def split_for_growth(cfg: Any, first: Any, world: int, grown: int, batches_done: int) -> tuple[Resplit | None, str | None]:
    """(the split on `grown` ranks at this position, None) when the job can grow now; (None, None) when not at
    this position but at an epoch's start; (None, why) when never (the global batch does not split). `cfg`: the
    config the job trains with now; `first`: the one it started with (its per-rank batch is the most a rank takes)."""
    batch, accumulation, most = cfg.training.batch_size, cfg.training.grad_accum, first.training.batch_size
    at_start = resplit(batch, accumulation, world, grown, 0, most)
    if isinstance(at_start, str):
        return None, at_start
    here = resplit(batch, accumulation, world, grown, batches_done, most)
    return (None, None) if isinstance(here, str) else (here, None)


class GrowBack:
    """The survivors' side: when to grow, and the grow itself (collective over the survivors)."""

    def __init__(self, spares: list[tuple[str, int]], off: str | None = None) -> None:
        self.spares = spares
        self.used: dict[str, int] = {}  # spare slots taken by earlier grows
        self.off = off  # why the job does not grow (said once), None while it may

    @classmethod
    def from_env(cls) -> GrowBack:
        spares = mpigrow.spare_hosts_here()
        return cls([], spares) if isinstance(spares, str) else cls(spares)

    def at_boundary(self, recovery: Any) -> None:
        """Collective, at each training step's boundary: grow when due; Regrown when new ranks joined."""
        dist, parts = recovery.dists[0], recovery.parts
        stepped_since = recovery.stepped and recovery._recovered_at is None
        if not mpigrow.grow_due(stepped_since, dist.world_size, recovery.initial_world, self.said_off):
            return
        if self.off is not None:  # the spare hosts could not be read: said once, when it matters
            return self.stop_growing(dist, self.off)
        decision = mpigrow.plan_growth(dist.world_size, recovery.initial_world, self.spares, self.used)
        decision = dist.transport.bcast(decision if dist.is_main else None)  # rank 0 decides
        if isinstance(decision, str):
            return self.stop_growing(dist, decision)
        cfg = recovery.cfg or parts.cfg
        split, never = split_for_growth(cfg, parts.cfg, dist.world_size, dist.world_size + decision.count, parts.state.batches_done)
        if never is not None:
            return self.stop_growing(dist, f"{never}: the job cannot keep its global batch on {dist.world_size + decision.count} ranks")
        if split is None:  # the position does not fall on the new batch: at the next epoch's start it does
            return
        if self.grow(recovery, decision, split, cfg):
            raise Regrown()

    @property
    def said_off(self) -> bool:
        return self.off == "said"

    def stop_growing(self, dist: Any, reason: str) -> None:
        if dist.is_main:  # a local log line, no collective
            log.warning("not growing back: %s; the job goes on with %d ranks", reason, dist.world_size)
        self.off = "said"

    def grow(self, recovery: Any, plan: mpigrow.GrowPlan, split: Resplit, cfg: Any) -> bool:
        """Collective over the survivors: spawn, merge, rebuild, send the state, wrap DDP, re-split. False (one
        line on rank 0) when the spawn fails: the job goes on at reduced size. A new rank that fails while joining
        ends the job (fall_back: one line, then fail fast; `launch` relaunches)."""
        members, dist, parts = recovery.members, recovery.dists[0], recovery.parts
        before, step = dist.world_size, parts.state.step
        parts.watchdog.suspend()
        # launch's evidence that a launcher failing now failed during the spawn (Open MPI 5.0.11's prterun can
        # crash in MPI_Comm_spawn), which says nothing against the hosts spawned onto
        records = failure.records_dir(dist.topology.failure_file, parts.run_dir) if dist.is_main else None
        failure.mark_spawning(records, list(plan.hosts))
        try:
            merged, phases = mpigrow.spawn_and_merge(members.comm, plan)
        except members._mpi.Exception as exc:  # the mark stays: the launcher may be failing (its daemon lost)
            parts.watchdog.follow(dist)
            self.stop_growing(dist, f"MPI_Comm_spawn on {', '.join(plan.hosts)} failed ({str(exc).splitlines()[0]})")
            return False
        failure.spawned(records)
        try:
            self._join(recovery, merged, split, cfg, phases)
        except (members._mpi.Exception, MembersLost, RuntimeError, pickle.UnpicklingError, EOFError) as exc:
            # a new rank died while joining: a reduction over the merged job can even return garbage (ULFM)
            joining = tuple(range(before, before + plan.count))
            recovery.fall_back(f"a new rank failed while joining on {', '.join(plan.hosts)} "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", joining)
        parts.watchdog.follow(dist)
        for host in plan.hosts:
            self.used[host] = self.used.get(host, 0) + 1
        added = list(range(before, dist.world_size))
        recovery.records.append(grow_record(step, added, list(plan.hosts), before, dist.world_size, phases))
        recovery._recovered_at = time.monotonic()
        say_grown(dist, recovery, added, plan, split, phases)
        return True

    @staticmethod
    def _join(recovery: Any, merged: Any, split: Resplit, cfg: Any, phases: dict[str, float]) -> None:
        """Collective over the merged job (the survivors' half of trainer.join.Joined.enter): hello, the process
        group, the state, the topology, DDP."""
        members, dist = recovery.members, recovery.dists[0]
        hello = merged.bcast(hello_of(dist, recovery, cfg) if dist.is_main else None, root=0)
        hostnames = merged.allgather(dist.topology.hostname)
        phases["process_group"] = members.adopt(merged)
        started = time.monotonic()
        send_state(members, state_of(recovery, split, hello))
        phases["state_transfer"] = time.monotonic() - started
        recovery._bind(mpigrow.regrown_topology(hello["topology"], hostnames, members.comm.Get_rank()), "stays")
        started = time.monotonic()
        recovery._rewrap(cfg, split, dist)
        phases["ddp"] = time.monotonic() - started


def say_grown(dist: Any, recovery: Any, added: list[int], plan: mpigrow.GrowPlan, split: Resplit,
              phases: dict[str, float]) -> None:
    if not dist.is_main:
        return
    log.warning("grew back: ranks %s joined on %s; %d ranks go on at the same global batch (%d per rank x %d "
                "accumulation); spawn %.3f s, merge %.3f s, process group %.3f s, state transfer %.3f s, DDP %.3f s",
                added, ", ".join(plan.hosts), dist.world_size, split.batch_size, split.grad_accum, phases["spawn"],
                phases["merge"], phases["process_group"], phases["state_transfer"], phases["ddp"])
    if dist.world_size >= recovery.initial_world:
        log.warning("running at full size again: %d ranks", dist.world_size)


def hello_of(dist: Any, recovery: Any, cfg: Any) -> dict[str, Any]:
    """Rank 0's first word to the new ranks: what they need before the process group."""
    rendezvous = dist.rendezvous
    return {"topology": dist.topology, "backend": dist.backend, "initial_world": recovery.initial_world,
            "interface_per_host": dict(rendezvous.interface_per_host) if rendezvous else {},
            "min_size": recovery.min_size, "collective_timeout_s": recovery.members.collective_timeout_s}


def state_of(recovery: Any, split: Resplit, hello: dict[str, Any]) -> dict[str, Any] | None:
    """Rank 0's state for the new ranks (None on the other ranks): what a snapshot holds, from memory."""
    import torch

    dist, parts = recovery.dists[0], recovery.parts
    if not dist.is_main:
        return None
    state, saver = parts.state, getattr(parts, "saver", None)
    hook = state.gradient_hook
    return {
        "model": state.unwrapped.state_dict(), "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(), "scaler": state.scaler.state_dict(),
        "rng": torch.get_rng_state(), "split": split,
        "position": (state.step, state.epoch, state.batches_per_epoch, state.pending_epoch),
        "records": [dict(record) for record in recovery.records], "run_dir": str(parts.run_dir),
        "transport": hook.transport if hook is not None else None,
        "saver": (str(saver.parent) if saver and saver.parent else None, saver.wandb_run_id if saver else None),
    }


def send_state(members: Any, payload: dict[str, Any] | None) -> dict[str, Any]:
    """Collective over the merged job: rank 0's state to every rank (pickles of any size: pkl5)."""
    from mpi4py.util import pkl5

    return pkl5.Intracomm(members.comm).bcast(payload, root=0)


def own_rng(survivor_state: Any, rank: int) -> None:
    """This new rank's RNG stream for augmentation and dropout: derived from the survivor's, its own per rank."""
    import torch

    digest = hashlib.sha256(bytes(survivor_state.numpy()) + rank.to_bytes(4, "little")).digest()
    torch.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
