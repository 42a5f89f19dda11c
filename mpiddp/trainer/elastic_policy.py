"""In-job recovery for the built-in trainer, its policy for the elastic engine (mpiddp.elastic.engine): when a rank
dies, the survivors agree on it through MPI's fault tolerance (ULFM), shrink the job, rebuild the torch process
group on a new store, wrap the same model in DDP again (optimizer state untouched), re-split the global batch and
the epoch's data over the survivors, and redo the interrupted step. Nothing is read from disk.

The loop runs its epochs through `TrainerPolicy.attempt`; where recovery cannot work (decide.failure_refusal, too
few survivors, a second failure while recovering, a batch that does not split) one line says why and the job
takes today's fail-fast path: it ends, and `launch` relaunches it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from mpiddp import recoveries
from mpiddp.elastic.decide import Resplit, StepTimes, failure_refusal, job_refusal, nccl_errors_env, resplit
from mpiddp.elastic.decide import recovery_cause, split_for_growth, stand_still
from mpiddp.elastic.engine import DistComm, Engine, Policy, from_furthest, refused
from mpiddp.elastic.grow import GrowBack, say_grown
from mpiddp.elastic.membership import CONFIRM_S, MembersLost, check_ulfm, members_lost, nccl_abort_available
from mpiddp.elastic.survivors import hosts_of, unless_end_decided
from mpiddp.failure import records_dir
from mpiddp.job.collective import Dist

if TYPE_CHECKING:
    from mpiddp.job.failfast import FailFast
    from mpiddp.job.topology import Topology
    from mpiddp.job.watchdog import Watchdog
    from mpiddp.trainer.config import Config
    from mpiddp.trainer.data import Datasets, Loaders
    from mpiddp.trainer.state import TrainState
    from mpiddp.trainer.train import Hooks

log = logging.getLogger("mpiddp")

T = TypeVar("T")

# what a recovery's resume hands its settle: (a survivor had finished the interrupted step, the re-split)
Resumed = tuple[bool, Resplit]


class SnapshotSaver(Protocol):
    """What the policy reads and changes of the run's saver (mpiddp.trainer.run.Saver): the split a snapshot
    records, and where the snapshots' lineage stands (a joining rank continues it)."""

    cfg: Config
    parent: Path | None
    wandb_run_id: str | None


@dataclass
class TrainingParts:
    """What the trainer's policy recovers and re-wraps, as the run built it (mpiddp.trainer.run.run, or a rank
    that joined a grown job: mpiddp.trainer.join). A recovery changes them in place (the state's wrapper, the
    loaders' split, the saver's config); `cfg` stays the job's first config (its per-rank batch is the most a rank
    takes)."""

    cfg: Config
    state: TrainState
    loaders: Loaders
    datasets: Datasets
    watchdog: Watchdog
    guard: FailFast | None  # follows the survivors with every Dist (the joining rank has none)
    run_dir: Path
    saver: SnapshotSaver  # its config follows the survivors' split (a snapshot records the split it was trained with)


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


class TrainerPolicy(Policy[Resumed]):
    """The trainer's side of the elastic engine (mpiddp.elastic.engine): what survives (the TrainState, the
    loaders at the same sample), how it is wrapped again, what is recorded (summary.json's recoveries)."""

    def __init__(self) -> None:
        self.cfg: Config | None = None  # the config on the survivors (per-rank batch, accumulation), once recovered
        self.stepped = False  # a training step completed in this job
        self.in_step = False  # inside a training step (its forward, backward or gradient all-reduce)
        self.records: list[dict[str, Any]] = []  # this rank's view of each recovery (phases in its own seconds)
        self._recovered_at: float | None = None  # monotonic end of the last recovery, until the next step
        self._stalled_from: float | None = None  # monotonic step boundary where a grow stopped this survivor
        self._stepped_at = 0.0  # time.time() when this rank's last training step ended
        self.step_times = StepTimes()  # what a grow's stand-still is weighed against
        self._hooks: Hooks | None = None  # the loop's hooks: a new rank 0 takes over the run's metrics file
        self.parts: TrainingParts  # set by run (or join) before training starts
        self.where = ""  # what `attempt` runs now: train, eval or save
        self._full_epoch_end: int | None = None  # full_epoch_end()
        self.grower: GrowBack = GrowBack.from_env()  # back to full size after a recovery
        # in a step, hung ranks, ranks cut off with a silent host, step: at the shrink
        self._failure: tuple[bool, set[int], set[int], int] = (False, set(), set(), 0)
        self._undone = 0  # steps the late commit rolled back at the shrink (0 or 1)
        self.last_change_grew = False  # the body runs again after a grow (Regrown), not after a failure

    @classmethod
    def enable(cls, dist: Dist, others: list[Dist], collective_timeout_s: float, compression: str = "none",
               ) -> TrainerPolicy | None:
        """Collective: in-job recovery when this MPI can do it (mpirun --with-ft ulfm) and this job could go on
        after a failure (decide.job_refusal: not with PowerSGD; on GPUs, a torch that can abort NCCL), else
        None and one line on rank 0 saying why (a failure then ends the job, as without it)."""
        reason = check_ulfm()
        never = settings_refusal(dist.device_type, dist.backend, compression)
        if reason is None and never is not None:  # known now: nothing is paid for it (the hook's per-bucket wait)
            reason = f"in-job recovery is off: {never}; a failure ends the job"
        if refused(dist, reason, logging.INFO):
            return None
        policy = cls()
        Engine.enable([dist, *others], collective_timeout_s, None, policy, dist.backend,
                      dist.device if dist.backend == "nccl" else None)
        return policy

    def hooks(self, hooks: Hooks) -> Hooks:
        """The loop's hooks with recovery in them: epochs run through `attempt`, saves are marked, steps noted."""
        beat, enter = hooks.heartbeat, hooks.phase

        def heartbeat(phase: str, step: int) -> None:
            beat(phase, step)
            self.beat(phase, step)

        def entered(phase: str) -> None:
            enter(phase)
            self.in_step = phase in ("compute", "communication")
            if phase == "data" and self.where == "train":
                self.grower.at_boundary(self)  # collective; Regrown when new ranks joined
                self.step_times.started(time.monotonic())

        self._hooks = dataclasses.replace(hooks, save=self.around_save(hooks.save), heartbeat=heartbeat,
                                          phase=entered, in_job=self.attempt,
                                          again_after_failure=lambda: not self.last_change_grew)
        return self._hooks

    # -- what the loop and run() call ---------------------------------------------------------------------------

    def beat(self, phase: str, step: int) -> None:
        """After each training step: the first one after a recovery ends its `first_step` phase."""
        if phase != "train":
            return
        self.stepped, self._stepped_at, self.in_step = True, time.time(), False
        now, size, first = time.monotonic(), self.dists[0].world_size, self._recovered_at is not None
        if first and self.records:
            self.records[-1]["phases"]["first_step"] = now - self._recovered_at
            if self._stalled_from is not None:  # a grow: this survivor's stand-still
                self.records[-1].update(stand_still(now - self._stalled_from, self.step_times.at(size)))
        self._recovered_at = self._stalled_from = None
        self.step_times.ended(size, now, ordinary=not first)

    def around_save(self, save: Callable[[Any], None]) -> Callable[[Any], None]:
        """The save, its outcome agreed (MPI_Comm_agree, uniform): a rank lost during it makes every survivor give
        it up together, so none goes on past a save that the others redo (a save's collectives can complete on
        some ranks only). Rank 0 writes the file atomically and moves `latest` last: a given-up save leaves the
        last complete snapshot as the one a resume takes."""
        def guarded(state: Any) -> None:
            lost = None
            try:
                save(state)
            except Exception as exc:
                lost = members_lost(self.members, exc)
                if lost is None:
                    raise
            if not self.members.all_completed(lost is None):
                raise lost or MembersLost(self.members.confirm(CONFIRM_S) or (), time.time())

        return guarded

    def attempt(self, body: Callable[[Config], T], cfg: Config, where: str) -> T:
        """Collective: `body(config)`, run again on the survivors (with their config) after each recovery. A save
        runs through it inside a train or eval body: that body's `where` holds again once the save is done."""
        outer = self.where

        def again() -> T:
            self.where = where
            return body(self.cfg or cfg)

        try:
            return self.engine.run(again)
        finally:
            self.where = outer

    # -- the recovery itself: the engine's policy -----------------------------------------------------------------

    @property
    def guard(self) -> FailFast | None:  # type: ignore[override]
        return self.parts.guard

    @property
    def log_level(self) -> str:  # type: ignore[override]
        return self.parts.cfg.outputs.log_level

    def alive_at(self) -> float:
        return self._stepped_at  # the end of this rank's last step (the gradient all-reduce's start: the engine)

    def records_dir(self) -> Path | None:
        return records_dir(self.dists[0].topology.failure_file, self.parts.run_dir)

    def refusal(self) -> str | None:
        cfg = self.cfg or self.parts.cfg
        return failure_refusal(self.where, self.stepped, self.dists[0].device_type,
                               cfg.training.grad_compression)

    def arm_commit(self, state: TrainState, dist: Dist) -> None:
        """The run's commit of each step, strict or one step late (mpiddp.trainer.commit), on `state`."""
        from mpiddp.trainer.commit import StepCommit

        cfg = self.cfg or self.parts.cfg
        state.commit = StepCommit.arm(cfg.training.commit, state, self.members, dist.is_main)

    def regrown(self) -> None:
        """New ranks joined: the first step over the grown process group is settled strictly (DDP's first)."""
        self.last_change_grew = True
        if self.parts.state.commit is not None:
            self.parts.state.commit.strict_next = True

    def before_shrink(self) -> None:
        self.last_change_grew = False
        parts = self.parts
        commit = parts.state.commit
        # the step the late commit holds is undone on every survivor alike, before the furthest one is looked for
        self._undone = int(commit is not None and commit.roll_back(parts.state))
        # ranks the hang watchdog ended, or cut off with their silent host (before it follows the survivors)
        hung, silent = set(parts.watchdog.excluded), set(parts.watchdog.silenced)
        self._failure = (self.in_step, hung, silent, parts.state.step)
        parts.watchdog.suspend()

    def resume(self, dist: Dist, before: Topology, failed: tuple[int, ...]) -> tuple[str, Resumed]:
        """Collective: every survivor at the furthest one's step, DDP again, the global batch re-split."""
        parts = self.parts
        cfg = self.cfg or parts.cfg
        caught_up = self._same_position(parts.state, dist)
        loaders = parts.loaders
        split = resplit(cfg.training.batch_size, cfg.training.grad_accum, before.world_size, dist.world_size,
                        parts.state.batches_done, parts.cfg.training.batch_size, loaders.epoch_end,
                        global_batch=loaders.samples_per_step, position=loaders.position(parts.state.batches_done))
        if isinstance(split, str):
            self.fall_back(split, failed)
        self.rewrap(cfg, split, dist)
        parts.watchdog.follow(dist)
        self._take_over_logging(dist)
        return "ddp", (caught_up, split)

    def settle(self, before: Topology, failed: tuple[int, ...], phases: dict[str, float | None], outcome: Resumed,
               ) -> None:
        """The recovery into this rank's records (summary.json's, the failures directory's) and rank 0's lines."""
        (caught_up, split), (in_step, hung, silent, step), dist = outcome, self._failure, self.dists[0]
        phases["first_step"] = None
        hosts, directory = hosts_of(before, failed), self.records_dir()
        unless_end_decided(directory, failed)  # decided during the shrink: nothing goes on record
        self.records.append({
            "time": time.time(),  # launch weighs it against the failure records' times (the end decided before it?)
            "cause": recovery_cause(failed, hung, silent),
            "ranks_lost": list(failed), "hosts_lost": hosts, "step": step,
            "steps_lost": (1 if in_step and not caught_up else 0) + self._undone,
            "world_before": before.world_size, "world_after": dist.world_size, "phases": phases,
        })
        # a grow whose first step never came (this failure struck first) has no stand-still: never this recovery's
        self._recovered_at, self._stalled_from = time.monotonic(), None
        self.in_step = False  # the step in flight is settled: a failure before the next step's compute loses none
        # the new rank 0 puts it in the failures directory as it happens (this rank's phases so far): `launch` learns
        # of it, and of the host lost, when a later failure ends the job before summary.json
        if dist.is_main and directory is not None:
            recoveries.record(directory, self.records[-1])
        if dist.is_main:
            log.warning("in-job recovery: ranks %s on %s failed; %d ranks go on at the same global batch (%s); "
                        "agree and shrink %.3f s, process group %.3f s, DDP %.3f s",
                        list(failed), ", ".join(hosts), dist.world_size, split.describe(dist.world_size),
                        phases["agree_and_shrink"], phases["process_group"], phases["ddp"])
        self.engine.say_reduced(len(self.records) == 1)

    def _take_over_logging(self, dist: Dist) -> None:
        """Rank 0 died: the new rank 0 appends the run's records to metrics.jsonl (wandb stays with the dead)."""
        from mpiddp.trainer.metrics import JsonlLogger, NullLogger

        if dist.is_main and self._hooks is not None and isinstance(self._hooks.log, NullLogger):
            self._hooks.log = JsonlLogger(self.parts.run_dir / "metrics.jsonl")

    @staticmethod
    def _same_position(state: TrainState, dist: Dist) -> bool:
        """Collective: every survivor continues from the furthest one's step (engine.from_furthest: model,
        optimizer, scheduler, scaler and position). True when some survivor had finished the interrupted step."""
        owners: dict[str, Any] = {"model": state.unwrapped, "optimizer": state.optimizer, "scheduler": state.scheduler,
                  "scaler": state.scaler}
        position = (state.step, state.epoch, state.batches_done)

        def payload() -> dict[str, Any]:
            return {**{name: owner.state_dict() for name, owner in owners.items()}, "position": position}

        def load(payload: dict[str, Any]) -> None:
            for name, owner in owners.items():
                owner.load_state_dict(payload[name])
            state.step, state.epoch, state.batches_done = payload["position"]

        return from_furthest(DistComm(dist), position, payload, load) is not None

    def full_epoch_end(self) -> int:
        """The positions an epoch trains on the job's first split (its full size): an uneven split keeps them, so an
        epoch has the same steps on any number of ranks. Taken before the first re-split changes the loaders."""
        if self._full_epoch_end is None:
            self._full_epoch_end = self.parts.loaders.epoch_end
        return self._full_epoch_end

    def keep_full_epoch_end(self, positions: int) -> None:
        """A rank that joined a grown job: the survivors' full_epoch_end (its own loaders may be of a partial grow's
        even split, whose epoch ends elsewhere: after the next loss it would train a step nobody else does)."""
        self._full_epoch_end = positions

    def rewrap(self, cfg: Config, split: Resplit, dist: Dist) -> None:
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
        rebuilt = build_loaders(new_cfg, parts.datasets, dist, global_batch=split.global_batch,
                                epoch_end=self.full_epoch_end())
        for name in ("train", "eval", "train_sampler", "batch_size", "world_size", "epoch_end", "global_batch",
                     "grad_accum"):
            setattr(loaders, name, getattr(rebuilt, name))
        state.batches_done = split.batches_done
        self.cfg = new_cfg
        parts.saver.cfg = new_cfg  # a snapshot records the split it was trained with
        # A test drill names a rank number, which now belongs to another process: it has fired (stragglers stay).
        assert self._hooks is not None, "the loop runs with the policy's hooks (TrainerPolicy.hooks)"
        self._hooks.callbacks.on_recovered(dist.rank)

    # -- what a grow shares with a recovery (mpiddp.elastic.grow) ------------------------------------------------

    @property
    def stepped_since_change(self) -> bool:
        """A training step completed since the last change of size (its first step recorded)."""
        return self.stepped and self._recovered_at is None

    def changed_size(self) -> None:
        """The job just changed size: the next training step ends that change's `first_step` phase."""
        self._recovered_at = time.monotonic()

    def steps_done(self) -> int:
        return self.parts.state.step

    def grow_split(self, world: int, grown: int) -> Resplit | str | None:
        """The split on `grown` ranks at this position; None when not here (at an epoch's start it is); why not,
        when never (the global batch does not split)."""
        cfg, loaders, done = self.cfg or self.parts.cfg, self.parts.loaders, self.parts.state.batches_done
        split, never = split_for_growth(cfg, self.parts.cfg, world, grown, done, global_batch=loaders.samples_per_step,
                                        position=loaders.position(done), epoch_samples=loaders.epoch_end)
        if never is None and split is not None and self.parts.state.commit is not None:
            self.parts.state.commit.settle()  # the new ranks take the state: the held step agreed on first
        return f"{never}: the job cannot keep its global batch on {grown} ranks" if never is not None else split

    @staticmethod
    def spawn_command() -> list[str]:
        """What a new rank runs: this rank's own `python -m mpiddp ...` (the same training flags)."""
        return [sys.executable, "-m", "mpiddp", *sys.argv[1:]]

    def pause_watch(self) -> None:
        self.parts.watchdog.suspend()

    def follow_watch(self, dist: Dist) -> None:
        self.parts.watchdog.follow(dist)

    def rewrap_grown(self, split: Resplit, dist: Dist) -> None:
        self.rewrap(self.cfg or self.parts.cfg, split, dist)

    def grown(self, record: dict[str, Any], split: Resplit, stalled_from: float) -> None:
        """The grow into this rank's records (summary.json's; its `survivors_stall` once the next step ended), and
        rank 0's line."""
        self.records.append(record)
        self.changed_size()
        self._stalled_from = stalled_from
        say_grown(self.dists[0], self.engine.initial_world, record,
                  f"at the same global batch ({split.describe(self.dists[0].world_size)})")

    def handover(self, split: Resplit) -> dict[str, Any]:
        """Rank 0's state for the new ranks of a grow: what a snapshot holds, from memory (mpiddp.trainer.join
        takes it)."""
        import torch

        parts = self.parts
        state, saver = parts.state, parts.saver
        hook = state.gradient_hook
        return {
            "model": state.unwrapped.state_dict(), "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(), "scaler": state.scaler.state_dict(),
            "rng": torch.get_rng_state(), "split": split, "epoch_end": self.full_epoch_end(),
            "position": (state.step, state.epoch, state.batches_per_epoch, state.pending_epoch),
            "records": [dict(record) for record in self.records], "run_dir": str(parts.run_dir),
            "transport": hook.transport if hook is not None else None,
            "saver": (str(saver.parent) if saver.parent else None, saver.wandb_run_id),
        }

    def gathered(self, dist: Dist) -> list[dict[str, Any]]:
        """Collective, at the job's end: the recoveries, each phase the slowest survivor's (detect: the earliest
        notice); on rank 0, an empty list elsewhere. A grow whose new ranks still warm up never joins: given up."""
        self.grower.abandon(self.dists[0], "training ended while they warmed up", job_ends=True)
        views = dist.gather([(record["phases"], record["cause"], record.get("survivors_stall"),
                              record.get("ordinary_step")) for record in self.records])
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
            merged = {**record, "cause": cause, "phases": phases}
            if cause == "grew":  # the slowest survivor's stand-still (the new ranks have none)
                stalls = [view[index][2:4] for view in views if view[index][2] is not None]
                merged["survivors_stall"], merged["ordinary_step"] = \
                    max(stalls, key=lambda stall: stall[0]) if stalls else (None, None)
            out.append(merged)
        return out
