"""In-job recovery for the built-in trainer: when a rank dies, the survivors agree on it through MPI's fault
tolerance (ULFM), shrink the job, rebuild the torch process group on a new store, wrap the same model in DDP
again (optimizer state untouched), re-split the global batch and the epoch's data over the survivors, and redo
the interrupted step. Nothing is read from disk.

The loop runs its epochs through `InJobRecovery.attempt`; where recovery cannot work (decide.failure_refusal, too
few survivors, a second failure while recovering, a batch that does not split) one line says why and the job
takes today's fail-fast path: it ends, and `launch` relaunches it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from mpiddp import recoveries
from mpiddp.contract import MIN_NP_ENV
from mpiddp.elastic.decide import Resplit, failure_refusal, furthest, job_refusal, nccl_errors_env, resplit
from mpiddp.elastic.grow import GrowBack, Regrown
from mpiddp.elastic.membership import (CONFIRM_S, MembersLost, Membership, RecoveryFailed, WatchedTransport,
                                       check_ulfm, members_lost, mpi_error_of, nccl_abort_available)
from mpiddp.elastic.survivors import bind_topology, mark_recovered, rebind_survivors, unless_end_decided
from mpiddp.failure import records_dir
from mpiddp.job.collective import Dist

log = logging.getLogger("mpiddp")

T = TypeVar("T")


def settings_refusal(device_type: str, backend: str, compression: str) -> str | None:
    """decide.job_refusal for this process: its torch, its environment."""
    import torch

    return job_refusal(device_type, backend, compression, nccl_abort_available(), torch.__version__, os.environ)


def prepare_nccl(compression: str) -> None:
    """Before the process group starts, in a job that may recover in the job (MPI fault tolerance on): torch's
    NCCL watchdog must not end a survivor when a peer dies (decide.nccl_errors_env). Only NCCL reads it.
    Left as it is where recovery on NCCL is refused anyway (PowerSGD, a torch that cannot abort NCCL): there a
    failure ends the job, as torchrun's setting has it."""
    if compression != "powersgd" and nccl_abort_available() and check_ulfm() is None:
        os.environ.update(nccl_errors_env(os.environ))


class NotRecovered(RuntimeError):
    """A failure in-job recovery does not cover: FailFast ends the job (the message names the lost peers in MPI's
    words, so `launch` reads this rank's record as a witness, not as the failed rank)."""


class InJobRecovery:
    """One per rank; every method named collective is called by every survivor at the same point."""

    def __init__(self, members: Membership, dists: list[Dist], min_size: int) -> None:
        self.members = members
        self.dists = dists  # the placed Dist first, then every other holder of the job's world (the guard's)
        self.min_size = min_size
        self.initial_world = dists[0].world_size
        self.cfg: Any = None  # the config on the survivors (per-rank batch, accumulation), once recovered
        self.stepped = False  # a training step completed in this job
        self.saving = False  # inside a save: a failure there is not recovered
        self.in_step = False  # inside a training step (its forward, backward or gradient all-reduce)
        self.records: list[dict[str, Any]] = []  # this rank's view of each recovery (phases in its own seconds)
        self._recovered_at: float | None = None  # monotonic end of the last recovery, until the next step
        self._stepped_at = 0.0  # time.time() when this rank's last training step ended
        self._hooks: Any = None  # the loop's hooks: a new rank 0 takes over the run's metrics file
        self.parts: Any = None  # SimpleNamespace(cfg, state, loaders, datasets, watchdog, guard, run_dir): set by run
        self.where = ""  # what `attempt` runs now: train or eval
        self.grower: Any = None  # mpiddp.elastic.grow.GrowBack: back to full size after a recovery (None: never)

    @classmethod
    def enable(cls, dist: Dist, others: list[Dist], collective_timeout_s: float, compression: str = "none",
               ) -> InJobRecovery | None:
        """Collective: in-job recovery when this MPI can do it (mpirun --with-ft ulfm) and this job could go on
        after a failure (decide.job_refusal: not with PowerSGD; on GPUs, a torch that can abort NCCL), else
        None and one line on rank 0 saying why (a failure then ends the job, as without it)."""
        reason = check_ulfm()
        never = settings_refusal(dist.device_type, dist.backend, compression)
        if reason is None and never is not None:  # known now: nothing is paid for it (the hook's per-bucket wait)
            reason = f"in-job recovery is off: {never}; a failure ends the job"
        if reason is not None:
            if dist.is_main:  # a local log line, no collective
                log.info("%s", reason)
            return None
        members = Membership(dist.transport.comm, collective_timeout_s,  # type: ignore[attr-defined]
                             backend=dist.backend, device=dist.device if dist.backend == "nccl" else None)
        transport = WatchedTransport(members)  # a revoke reaches a rank blocked in a metric reduction too
        for each in [dist, *others]:
            each.rebind(each.topology, transport, None)
        min_size = max(1, int(os.environ.get(MIN_NP_ENV) or 1))
        if dist.is_main:
            log.info("in-job recovery is on (MPI fault tolerance): a failed rank is left behind and the job goes on "
                     "with at least %d ranks", min_size)
        recovery = cls(members, [dist, *others], min_size)
        recovery.grower = GrowBack.from_env()
        return recovery

    def hooks(self, hooks: Any) -> Any:
        """The loop's hooks with recovery in them: epochs run through `attempt`, saves are marked, steps noted."""
        beat, enter = hooks.heartbeat, hooks.phase

        def heartbeat(phase: str, step: int) -> None:
            beat(phase, step)
            self.beat(phase, step)

        def entered(phase: str) -> None:
            enter(phase)
            self.in_step = phase in ("compute", "communication")
            if phase == "data" and self.where == "train" and self.grower is not None:
                self.grower.at_boundary(self)  # collective; Regrown when new ranks joined

        self._hooks = dataclasses.replace(hooks, save=self.around_save(hooks.save), heartbeat=heartbeat,
                                          phase=entered, in_job=self.attempt)
        return self._hooks

    # -- what the loop and run() call ---------------------------------------------------------------------------

    def beat(self, phase: str, step: int) -> None:
        """After each training step: the first one after a recovery ends its `first_step` phase."""
        if phase != "train":
            return
        self.stepped, self._stepped_at, self.in_step = True, time.time(), False
        if self._recovered_at is not None and self.records:
            self.records[-1]["phases"]["first_step"] = time.monotonic() - self._recovered_at
            self._recovered_at = None

    def around_save(self, save: Callable[[Any], None]) -> Callable[[Any], None]:
        def guarded(state: Any) -> None:
            self.saving = True
            save(state)
            self.saving = False  # left set when the save raised: the failure struck during the save

        return guarded

    def attempt(self, body: Callable[[Any], T], cfg: Any, where: str) -> T:
        """Collective: `body(config)`, run again on the survivors (with their config) after each recovery."""
        while True:
            self.where = where
            try:
                return body(self.cfg or cfg)
            except Regrown:  # new ranks joined at a step boundary: the same body goes on with the new split
                continue
            except Exception as exc:
                lost = self.lost(exc)
                if lost is None:
                    raise
            self.recover(lost, where)

    def lost(self, exc: BaseException) -> MembersLost | None:
        """The failure behind `exc` when MPI reports failed members, else None (the error stands)."""
        return members_lost(self.members, exc, CONFIRM_S)

    # -- the recovery itself --------------------------------------------------------------------------------------

    def recover(self, lost: MembersLost, where: str) -> None:
        """Collective over the survivors: shrink, rebuild, re-split; NotRecovered (the job ends) where it cannot."""
        parts, dist = self.parts, self.dists[0]
        cfg = self.cfg or parts.cfg
        # detect: from this rank's last sign of life of the job (its last step, or the start of the gradient
        # all-reduce that failed) to MPI's report: an upper bound on the detection latency
        waited_from = max(self.members.waiting_since or 0.0, self._stepped_at) or lost.detected_at
        directory = records_dir(dist.topology.failure_file, parts.run_dir)
        unless_end_decided(directory, lost.ranks)
        reason = failure_refusal("save" if self.saving else where, self.stepped, dist.device_type, cfg.training.grad_compression)
        if reason is not None:
            self.fall_back(reason, lost.ranks)
        in_step = self.in_step
        hung = set(getattr(parts.watchdog, "excluded", ()))  # ranks the hang watchdog ended (before it follows)
        parts.watchdog.suspend()
        topology_before, world_before, step = dist.topology, dist.world_size, parts.state.step
        try:
            recovered = self.members.recover(self.min_size)
        except RecoveryFailed as exc:
            self.fall_back(str(exc), lost.ranks)
        mark_recovered()
        failed = recovered.failed_ranks
        self._rebind(topology_before, recovered)
        started = time.monotonic()
        try:
            caught_up = self._same_position(parts.state, dist)
            split = resplit(cfg.training.batch_size, cfg.training.grad_accum, world_before, dist.world_size,
                            parts.state.batches_done, epoch_samples=parts.loaders.epoch_samples)
            if isinstance(split, str):
                self.fall_back(split, failed)
            self.rewrap(cfg, split, dist)
        except (RuntimeError, mpi_error_of(self.members)) as exc:
            if isinstance(exc, NotRecovered):
                raise
            self.fall_back(f"a second failure during recovery ({exc})".splitlines()[0], failed)
        parts.watchdog.follow(dist)
        self._take_over_logging(dist)
        phases = {"detect": max(0.0, lost.detected_at - waited_from), **recovered.phases,
                  "ddp": time.monotonic() - started, "first_step": None}
        # a rank that was joining (a grow cut short) is not in the topology before: named by its rank only
        hosts = list(dict.fromkeys(topology_before.host_of(rank) if rank < world_before else f"joining rank {rank}"
                                   for rank in failed))
        unless_end_decided(directory, failed)  # decided during the shrink: nothing goes on record
        self.records.append({
            "time": time.time(),  # launch weighs it against the failure records' times (the end decided before it?)
            "cause": "hang" if hung & set(failed) else "process_failed",
            "ranks_lost": list(failed), "hosts_lost": hosts, "step": step,
            "steps_lost": 1 if in_step and not caught_up else 0,
            "world_before": world_before, "world_after": dist.world_size, "phases": phases,
        })
        self._recovered_at = time.monotonic()
        self._put_on_record(dist)
        self._say(split, failed, hosts, phases)

    def _rebind(self, before: Any, recovered: Any) -> None:
        """Every holder of the job's Dist now sees the survivors: new rank, communicator, store."""
        rebind_survivors(self.dists, self.members, before, recovered, self.parts.guard,
                         self.parts.cfg.outputs.log_level)

    def bind(self, topology: Any, verb: str = "goes on") -> None:
        """Every holder of the job's Dist now sees `topology` (after a grow: mpiddp.elastic.grow)."""
        bind_topology(self.dists, self.members, topology, self.parts.guard, self.parts.cfg.outputs.log_level, verb)

    def _put_on_record(self, dist: Dist) -> None:
        """The new rank 0: the recovery into the failures directory as it happens (this rank's phases so far), so
        `launch` learns of it, and of the host lost, when a later failure ends the job before summary.json."""
        directory = records_dir(dist.topology.failure_file, self.parts.run_dir)
        if dist.is_main and directory is not None:
            recoveries.record(directory, self.records[-1])

    def _take_over_logging(self, dist: Dist) -> None:
        """Rank 0 died: the new rank 0 appends the run's records to metrics.jsonl (wandb stays with the dead)."""
        from mpiddp.trainer.metrics import JsonlLogger, NullLogger

        if dist.is_main and self._hooks is not None and isinstance(self._hooks.log, NullLogger):
            self._hooks.log = JsonlLogger(self.parts.run_dir / "metrics.jsonl")

    def _same_position(self, state: Any, dist: Dist) -> bool:
        """Collective: a survivor that finished the interrupted step while another did not (a collective can
        complete on some ranks only) gives its state to the others, so every survivor continues from the same
        step. True when some survivor had finished it."""
        positions = dist.allgather((state.step, state.epoch, state.batches_done))
        leader = furthest(positions)
        if leader is None:
            return False
        payload = None
        if dist.rank == leader:
            payload = {"model": state.unwrapped.state_dict(), "optimizer": state.optimizer.state_dict(),
                       "scheduler": state.scheduler.state_dict(), "scaler": state.scaler.state_dict(),
                       "position": positions[leader]}
        payload = dist.transport.large.bcast(payload, root=leader)  # type: ignore[attr-defined]
        if dist.rank != leader:
            state.unwrapped.load_state_dict(payload["model"])
            state.optimizer.load_state_dict(payload["optimizer"])
            state.scheduler.load_state_dict(payload["scheduler"])
            state.scaler.load_state_dict(payload["scaler"])
            state.step, state.epoch, state.batches_done = payload["position"]
        return True

    def rewrap(self, cfg: Any, split: Resplit, dist: Dist) -> None:
        """Collective: the same module in DDP on the new group, and the loaders re-split at the same sample."""
        from mpiddp.trainer.data import build_loaders, stop_workers
        from mpiddp.trainer.state import wrap

        parts = self.parts
        state, loaders = parts.state, parts.loaders
        new_cfg = cfg.replace(batch_size=split.batch_size, grad_accum=split.grad_accum)
        state.optimizer.zero_grad(set_to_none=True)  # the interrupted step's partial gradients
        old_hook = state.gradient_hook
        state.ddp, state.gradient_hook, state.model = wrap(
            new_cfg, dist, state.unwrapped, self.members, old_hook.transport if old_hook is not None else None,
            replicas_agree=True)  # _same_position made every survivor's weights the same
        stop_workers(loaders)  # persistent helpers of the old split
        rebuilt = build_loaders(new_cfg, parts.datasets, dist)
        for name in ("train", "eval", "train_sampler", "batch_size"):
            setattr(loaders, name, getattr(rebuilt, name))
        state.batches_done = split.batches_done
        self.cfg = new_cfg
        if getattr(parts, "saver", None) is not None:  # a snapshot records the split it was trained with
            parts.saver.cfg = new_cfg
        # A test drill names a rank number, which now belongs to another process: it has fired (stragglers stay).
        self._hooks.callbacks.on_recovered(dist.rank)

    # -- what a grow shares with a recovery (mpiddp.elastic.grow) ------------------------------------------------

    @property
    def stepped_since_change(self) -> bool:
        """A training step completed since the last change of size (its first step recorded)."""
        return self.stepped and self._recovered_at is None

    def changed_size(self) -> None:
        """The job just changed size: the next training step ends that change's `first_step` phase."""
        self._recovered_at = time.monotonic()

    def handover(self, split: Resplit) -> dict[str, Any]:
        """Rank 0's state for the new ranks of a grow: what a snapshot holds, from memory (mpiddp.trainer.join
        takes it)."""
        import torch

        parts = self.parts
        state, saver = parts.state, getattr(parts, "saver", None)
        hook = state.gradient_hook
        return {
            "model": state.unwrapped.state_dict(), "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(), "scaler": state.scaler.state_dict(),
            "rng": torch.get_rng_state(), "split": split,
            "position": (state.step, state.epoch, state.batches_per_epoch, state.pending_epoch),
            "records": [dict(record) for record in self.records], "run_dir": str(parts.run_dir),
            "transport": hook.transport if hook is not None else None,
            "saver": (str(saver.parent) if saver and saver.parent else None, saver.wandb_run_id if saver else None),
        }

    def fall_back(self, reason: str, ranks: tuple[int, ...]) -> None:
        """One line why, then today's fail-fast path (FailFast aborts the job; `launch` relaunches it)."""
        log.error("in-job recovery not possible: %s; ending the job", reason)
        names = ", ".join(map(str, ranks)) or "?"
        raise NotRecovered(f"in-job recovery not possible: {reason} (MPI_ERR_PROC_FAILED: ranks {names} failed)")

    def _say(self, split: Resplit, failed: tuple[int, ...], hosts: list[str], phases: dict[str, Any]) -> None:
        dist = self.dists[0]
        if not dist.is_main:
            return
        log.warning("in-job recovery: ranks %s on %s failed; %d ranks go on at the same global batch (%d per rank x "
                    "%d accumulation); agree and shrink %.3f s, process group %.3f s, DDP %.3f s",
                    list(failed), ", ".join(hosts), dist.world_size, split.batch_size, split.grad_accum,
                    phases["agree_and_shrink"], phases["process_group"], phases["ddp"])
        if len(self.records) == 1:
            log.warning("running at reduced size %d of %d ranks", dist.world_size, self.initial_world)

    def gathered(self, dist: Dist) -> list[dict[str, Any]]:
        """Collective: the recoveries, each phase the slowest survivor's (detect: the earliest notice); on rank 0,
        an empty list elsewhere."""
        views = dist.gather([(record["phases"], record["cause"]) for record in self.records])
        if views is None:
            return []
        out = []
        for index, record in enumerate(self.records):
            phases = {}
            for name in record["phases"]:
                values = [view[index][0][name] for view in views if view[index][0][name] is not None]
                phases[name] = (min if name == "detect" else max)(values) if values else None
            # a hang's end: any survivor whose watchdog learned of it in time says so
            cause = "hang" if any(view[index][1] == "hang" for view in views) else record["cause"]
            out.append({**record, "cause": cause, "phases": phases})
        return out
