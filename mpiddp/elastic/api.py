"""In-job recovery for your own scripts (`mpiddp.init()`): when a rank dies, the survivors carry on without a restart.

    state = mpiddp.State(model=model, optimizer=optimizer, epoch=0, sample=0)  # what must survive
    def train(state: mpiddp.State) -> None:       # re-entered on the survivors after each recovery
        ddp = mpiddp.watch_gradients(DDP(state.model))
        ...  # per step: forward, backward, optimizer.step(), then the counters, then state.commit()
    mpiddp.run_recoverable(train, state)

The shape of Horovod elastic (`hvd.elastic.run`, `State.commit`/`restore`/`sync`), with two differences that make
it cost nothing per step: objects with a `state_dict` (model, optimizer, scheduler, scaler) are not copied at a
commit (in DDP every replica holds the same ones, so a survivor already has them), and the survivors do not go
back to the last commit but on from the furthest survivor. What a commit copies is the plain values (epoch, data
position, any picklable counter), so a step that failed half-way leaves no trace in them.

After a failure, the elastic engine (mpiddp.elastic.engine) has MPI's fault tolerance (ULFM) agree on who failed
and shrink the job; torch's process group is rebuilt on a new store (the death of rank 0 and its store included);
the values go back to this rank's last commit; the survivor with the most commits (the lowest rank among equals)
gives every other survivor its objects and values when they differ (a collective can complete on some ranks only);
gradients left by the interrupted step are dropped; the callbacks registered with `on_membership_change` run; then
`train(state)` runs again. Nothing is read from disk; at most the interrupted step is lost.

Where it cannot work (no ULFM: MPICH, mpirun without `--with-ft ulfm`, srun; a backend other than gloo on CPU or
NCCL on GPUs; NCCL where torch cannot abort it or would end the survivors; fewer survivors than the job needs; a
second failure while recovering) one line says why and a failure ends the job as it does without it (`launch`
relaunches it). A torchrun-style loop can keep its shape instead: mpiddp.elastic.steps.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import hashlib
import logging
import os
import pickle
import time
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, TypeVar

from mpiddp.elastic.decide import furthest, grow_record, recovery_cause, script_refusal
from mpiddp.elastic.engine import Comm, DistComm, Engine, Policy, refused
from mpiddp.elastic.grow import GrowBack, say_grown
from mpiddp.elastic.membership import MembersLost, check_ulfm, nccl_abort_available
from mpiddp.elastic.survivors import bind_topology, hosts_of
from mpiddp import recoveries
from mpiddp.failure import records_dir
from mpiddp.job.collective import Dist, current
from mpiddp.job.spares import release_spares, spare_world
from mpiddp.job.log import chosen_level

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import Work
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mpiddp.job.compression import GradientHook
    from mpiddp.job.failfast import FailFast
    from mpiddp.elastic.grow import Joining, LateJoin
    from mpiddp.job.finishwatch import FinishWatch
    from mpiddp.job.topology import Topology
    from mpiddp.job.watchdog import Watchdog

log = logging.getLogger("mpiddp")
T = TypeVar("T")


@dataclass(frozen=True)
class MembershipChange:
    """What a recovery changed, the same on every survivor (given to the `on_membership_change` callbacks)."""

    rank: int  # this process's new rank
    world_size: int  # the survivors
    world_before: int
    ranks_lost: tuple[int, ...]  # ranks of the world before
    hosts_lost: tuple[str, ...]
    synced_from: int | None  # the new rank whose state the others took, None when every survivor held the same
    phases: dict[str, float] = field(default_factory=dict)  # seconds: detect, agree_and_shrink, process_group, state;
    # a grow: spawn, merge, process_group, state_transfer, ddp; then first_step, and a grow's stand_still (to its end)
    ranks_added: tuple[int, ...] = ()  # a grow: the new ranks (the last ones), on these hosts
    hosts_added: tuple[str, ...] = ()

    @property
    def grew(self) -> bool:
        return bool(self.ranks_added)


class Payload(TypedDict):
    """What the furthest survivor hands the others (State.payload): state dicts by name, the shared values, the
    commits."""

    objects: dict[str, object]
    values: dict[str, object]
    commits: int


class Kept:
    """What a torchrun-style loop under mpiddp.Optimizer declared holds its position (`mpiddp.keep`): names of its own
    variables in a namespace (a module's globals, or an object's attributes). At a grow rank 0 hands their values to
    the new rank, which writes them into its own namespace as it enters the loop; a value with `state_dict` and
    `load_state_dict` (a GradScaler, an LR scheduler) is handed over as its state dict and loaded in place."""

    def __init__(self, where: MutableMapping[str, Any] | object, names: tuple[str, ...]) -> None:
        self.where = where
        self.names: tuple[str, ...] = ()
        self.add(names)

    def add(self, names: tuple[str, ...]) -> None:
        missing = [name for name in names if not self._has(name)]
        if missing:
            raise ValueError(f"mpiddp.keep: {', '.join(map(repr, missing))} {'is' if len(missing) == 1 else 'are'} "
                             "not set there yet: call it after the loop's variables are first assigned")
        self.names = tuple(dict.fromkeys((*self.names, *names)))

    def _has(self, name: str) -> bool:
        return name in self.where if isinstance(self.where, Mapping) else hasattr(self.where, name)

    def _get(self, name: str) -> Any:
        return self.where[name] if isinstance(self.where, Mapping) else getattr(self.where, name)

    def values(self) -> dict[str, tuple[str, object]]:
        """Rank 0's, at a grow: each name's value, or its object's state dict."""
        taken: dict[str, tuple[str, object]] = {}
        for name in self.names:
            value = self._get(name)
            taken[name] = ("state_dict", value.state_dict()) if _has_state(value) else ("value", value)
        return taken

    def load(self, taken: dict[str, tuple[str, object]]) -> None:
        """A new rank, as it joins: rank 0's values written here (objects loaded in place)."""
        unknown = sorted(set(taken) - set(self.names))
        if unknown:
            raise RuntimeError(f"growing back: the survivors keep {', '.join(map(repr, unknown))} (mpiddp.keep), "
                               "which this rank's script did not declare before its first optimizer step")
        for name, (kind, value) in taken.items():
            if kind == "state_dict":
                self._get(name).load_state_dict(value)
            elif isinstance(self.where, MutableMapping):
                self.where[name] = value
            else:
                setattr(self.where, name, value)


class State:
    """What must survive a failed rank, by name: objects with `state_dict`/`load_state_dict` (the model itself,
    not its DDP wrapper; optimizer, scheduler, scaler) and picklable values (epoch, data position, counters),
    read and written as attributes (`state.epoch += 1`). Call `commit()` after each step's optimizer step and
    counter updates; nothing may communicate between the optimizer step and the commit."""

    def __init__(self, *, per_rank: tuple[str, ...] | list[str] = (), **entries: object) -> None:
        """`per_rank`: names of values meant to differ across ranks (a rank's own data position, say): a recovery
        keeps each survivor's own, and the check at the first commit leaves them out."""
        unknown = [name for name in per_rank if name not in entries]
        if unknown:
            raise ValueError(f"mpiddp.State(per_rank=...): {', '.join(map(repr, unknown))} is not an entry")
        objects, values = {}, {}
        for name, entry in entries.items():
            if name.startswith("_") or name in _RESERVED:
                raise ValueError(f"mpiddp.State: {name!r} is not a name an entry can have")
            if _is_ddp(entry):
                raise ValueError(f"mpiddp.State({name}=...): register the module itself (ddp.module), not its DDP "
                                 "wrapper: a recovery wraps it again over the survivors")
            (objects if _has_state(entry) else values)[name] = entry
        if any(name in objects for name in per_rank):
            raise ValueError("mpiddp.State(per_rank=...): only plain values can be per rank, not objects")
        object.__setattr__(self, "_objects", objects)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_per_rank", frozenset(per_rank))
        object.__setattr__(self, "_committed", copy.deepcopy(values))
        object.__setattr__(self, "commits", 0)
        object.__setattr__(self, "_first_commit", None)  # run_recoverable's check that shared values agree
        object.__setattr__(self, "_after_commit", None)  # run_recoverable's step boundary (growing back)

    def __getattr__(self, name: str) -> Any:
        for table in (self.__dict__.get("_objects", {}), self.__dict__.get("_values", {})):
            if name in table:
                return table[name]
        raise AttributeError(f"mpiddp.State has no entry {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        if name in self._objects:
            raise AttributeError(f"mpiddp.State: {name!r} is an object entry; change it in place (load_state_dict)")
        if name not in self._values:
            raise AttributeError(f"mpiddp.State has no entry {name!r}: name every entry when you create it")
        self._values[name] = value

    def __repr__(self) -> str:
        return f"State(objects={sorted(self._objects)}, values={self._values}, commits={self.commits})"

    def commit(self) -> None:
        """This rank completed a step: the values as they are now are what a recovery goes back to. Under in-job
        recovery the first commit is collective: it compares the shared values across ranks (see `digests`)."""
        object.__setattr__(self, "_committed", copy.deepcopy(self._values))
        object.__setattr__(self, "commits", self.commits + 1)
        check = self._first_commit
        object.__setattr__(self, "_first_commit", None)
        if check is not None:
            check(self)
        if self._after_commit is not None:
            self._after_commit(self)

    def check_at_first_commit(self, check: Callable[[State], None] | None) -> None:
        """Collective-to-be (internal): `check(state)` runs inside the next first commit, on every rank."""
        object.__setattr__(self, "_first_commit", check if self.commits == 0 else None)

    def at_each_commit(self, boundary: Callable[[State], None] | None) -> None:
        """Collective-to-be (internal): `boundary(state)` runs at the end of every commit, on every rank."""
        object.__setattr__(self, "_after_commit", boundary)

    def digests(self) -> dict[str, str]:
        """A digest of each shared committed value (per-rank ones left out): equal on ranks that agree."""
        return {name: hashlib.sha256(pickle.dumps(value, protocol=4)).hexdigest()
                for name, value in self._committed.items() if name not in self._per_rank}

    # -- recovery's side (internal) --

    def restore(self) -> None:
        """The values of the last commit (what a step that failed half-way changed is undone)."""
        self._values.clear()
        self._values.update(copy.deepcopy(self._committed))

    def position(self) -> tuple[int, str]:
        """(commits, a digest of the shared committed values): survivors with equal positions hold the same state."""
        return self.commits, hashlib.sha256(pickle.dumps(sorted(self.digests().items()), protocol=4)).hexdigest()

    def payload(self, values_only: bool = False) -> Payload:
        """What the furthest survivor sends: the shared values, and the objects unless `values_only` (survivors
        that completed as many steps hold the same objects: DDP keeps the replicas equal)."""
        shared = {name: value for name, value in self._committed.items() if name not in self._per_rank}
        objects = {} if values_only else {name: entry.state_dict() for name, entry in self._objects.items()}
        return {"objects": objects, "values": shared, "commits": self.commits}

    def load(self, payload: Payload) -> None:
        for name, entry in self._objects.items():
            if name in payload["objects"]:
                entry.load_state_dict(payload["objects"][name])
        own = {name: value for name, value in self._committed.items() if name in self._per_rank}
        object.__setattr__(self, "_committed", {**copy.deepcopy(payload["values"]), **own})
        object.__setattr__(self, "commits", payload["commits"])
        self.restore()

    def drop_gradients(self) -> None:
        """The interrupted step's partial gradients (DDP would add the next step's to them)."""
        for entry in self._objects.values():
            zero_grad = getattr(entry, "zero_grad", None)
            if callable(zero_grad):
                zero_grad(set_to_none=True)


_RESERVED = frozenset({"commit", "commits", "restore", "position", "payload", "load", "drop_gradients", "digests",
                       "per_rank", "check_at_first_commit", "at_each_commit"})


def diverging(digests_per_rank: list[dict[str, str]]) -> list[str]:
    """The shared State entries whose committed values differ across ranks (their digests), in entry order."""
    names = list(dict.fromkeys(name for digests in digests_per_rank for name in digests))
    return [name for name in names if len({digests.get(name) for digests in digests_per_rank}) > 1]


def _has_state(entry: object) -> bool:
    return callable(getattr(entry, "state_dict", None)) and callable(getattr(entry, "load_state_dict", None))


def _is_ddp(entry: object) -> bool:
    return any(cls.__name__ == "DistributedDataParallel" for cls in type(entry).__mro__)


def sync(state: State, comm: Comm) -> int | None:
    """Collective over the survivors: back to this rank's last commit, then every survivor takes the state of the
    furthest one when they differ. Returns that rank, or None."""
    state.restore()
    positions = comm.allgather(state.position())
    leader = furthest(positions)
    if leader is not None:
        values_only = len({commits for commits, _ in positions}) == 1  # the same steps: only values moved apart
        taken = comm.bcast(state.payload(values_only) if comm.rank == leader else None, root=leader)
        if comm.rank != leader:
            state.load(taken)
    state.drop_gradients()
    return leader


# ---- the recovery of a script's job ----------------------------------------------------------------------------

@dataclass(frozen=True)
class OwnJob:
    """What `mpiddp.init()` bootstrapped itself under a plain mpirun, for a recovery to follow onto the survivors:
    every Dist of the job (the placed one first), the failure guard, the finish watch."""

    dists: list[Dist]
    guard: FailFast | None
    watch: FinishWatch | None
    collective_timeout_s: float
    hang_timeout_s: float  # a script's hang watchdog (`run --hang-timeout`, init's hang_timeout_s; 0: off)
    command: list[str]  # what started this process (`python -m mpiddp run ...`, `python train.py ...`): a grow's
    joining: LateJoin | None = None  # this process grows the job back and joins at its first step (elastic.grow)


class StepLoopHooks(Protocol):
    """What growing back asks of a torchrun-style loop under mpiddp.Optimizer (mpiddp.elastic.steps.StepLoop): the
    survivors' side, at a step of its first optimizer (the loop's clock)."""

    @property
    def grows(self) -> bool:
        """The loop said which of its variables hold its position (mpiddp.keep): a new rank can enter it."""

    def handover(self) -> dict[str, object]:
        """Rank 0's: every model's and optimizer's state, the steps, the kept variables."""

    def settle_for_grow(self) -> bool:
        """Collective: every step held under the late commit agreed on; False where a rank failed (recovered)."""

    def rewrap_grown(self) -> None:
        """Collective over the merged job: every model wrapped again over it."""


class CurrentMembers:
    """The job's failure watch as it is when asked (latecommit.Agreement): a rank growing a job back builds its
    wrappers before it has a Membership, which comes at its first step (ScriptRecovery._enter)."""

    def __init__(self, recovery: ScriptRecovery) -> None:
        self._recovery = recovery

    def wait(self, work: Work) -> None:
        self._recovery.members.wait(work)

    def all_completed(self, completed: bool) -> bool:
        return self._recovery.members.all_completed(completed)

    def failed(self) -> tuple[int, ...] | None:
        return self._recovery.members.failed()

    @property
    def lost_at(self) -> float | None:
        return self._recovery.members.lost_at


class ScriptRecovery(Policy):
    """A script's side of the elastic engine (mpiddp.elastic.engine), one per process, made by the first
    `run_recoverable` (collective): what survives (the State), what follows the survivors (init()'s failure
    guard and finish watch), what is said (the MembershipChange, to the callbacks)."""

    hide_cause = True

    def __init__(self, manager: Manager, job: OwnJob) -> None:
        self.manager = manager  # the process's: its callbacks and wrappers
        self.job = job
        self.guard = job.guard
        self.changes: list[MembershipChange] = []
        self.state: State | None = None  # what the recovery under way syncs
        self.started = 0.0  # time.time() when the failed call of the training function began
        self.grower = GrowBack.from_env()  # back to full size after a recovery, at a commit
        self.regrowable = False  # run_recoverable's State holds the position new ranks start from
        self.loop: StepLoopHooks | None = None  # a loop under mpiddp.Optimizer outside run_recoverable
        self._changed_at: float | None = None  # monotonic end of the last change of size, until the next commit
        self._stalled_from: float | None = None  # a grow's: when the survivors stopped for it (its stand-still)
        self.current_members = CurrentMembers(self)  # for the wrappers, built before a new rank's Membership
        self.watchdog: Watchdog | None = None  # the hang watchdog, once the engine watches this rank (watch_hangs)
        self._ended_by_watch: tuple[set[int], set[int]] = (set(), set())  # ranks it ended: hung, on a silent host

    @classmethod
    def enable(cls, manager: Manager, dist: Dist, min_world_size: int | None) -> ScriptRecovery | None:
        """Collective: in-job recovery when this job can do it, else None and one line on rank 0 saying why."""
        job = manager.own
        import torch

        backend = dist.backend if dist.backend != "none" else _process_group_backend()  # `mpiddp run`: the script's
        device_type = "cuda" if backend == "nccl" else dist.device_type
        if job is not None and job.joining is not None:  # spawned by a grow: the survivors decided, and are on
            return cls.joined(manager, job)
        ulfm = check_ulfm() if job is not None else None
        if refused(dist, script_refusal(job is not None, ulfm, device_type, backend, nccl_abort_available(),
                                        torch.__version__, os.environ), logging.WARNING):
            return None
        assert job is not None and job.dists[0] is dist
        policy = cls(manager, job)  # init()'s placed Dist first, then the bootstrap's (the guard's and the exit handler's)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        Engine.enable(job.dists, job.collective_timeout_s, min_world_size, policy, backend, device)
        policy.watch_hangs()
        return policy

    @classmethod
    def joined(cls, manager: Manager, job: OwnJob) -> ScriptRecovery:
        """The policy of a rank that grows a job back: the engine over the merged job once it joined (`_enter`, at its
        first step); the state comes then."""
        assert job.joining is not None
        policy = cls(manager, job)
        policy.dists = job.dists
        policy.grower.joined(job.joining.arrival.hello["grower"])
        return policy

    def _enter(self) -> Joining:
        """A new rank's first step: it joins the job (grow.LateJoin.enter: ready, rank 0's word, the process
        group), every Dist of the script follows it onto the merged job, and the engine watches it from now on."""
        late = self.job.joining
        assert late is not None
        joining = late.enter()
        self.grower.joined(joining.hello["grower"])  # the grow that took it in (a hot spare may have waited again)
        bind_topology(self.job.dists, joining.members, joining.topology, self.guard, None, "joins")
        engine = Engine(joining.members, self.job.dists, joining.hello["min_size"], self)
        engine.initial_world = joining.hello["initial_world"]
        self.after_rebind(self.job.dists[0])  # the finish watch, on the survivors' store
        self.watch_hangs()
        return joining

    def watch_hangs(self) -> None:
        """The hang watchdog (mpiddp.job.watchdog) on this rank, once the engine watches it: a rank kept waiting
        --hang-timeout s on the others in a watched collective (a step's all-reduce, a commit's agreement) names
        the ranks behind in a hang report, and the rank on their host ends them (SIGKILL), so that MPI declares
        them failed and the survivors go on; under launch's relay layout a silent host is cut off alike. A script's
        own phases are not watched: a rank busy in its own evaluation or save keeps no one in a watched wait."""
        from mpiddp.contract import HOST_RELAYS_ENV
        from mpiddp.job.watchdog import Watchdog

        dist, timeout_s = self.dists[0], self.job.hang_timeout_s
        topology = dist.topology
        report_dir = Path(topology.launch_run_dir) if topology.launch_run_dir else Path.cwd()
        self.watchdog = Watchdog.for_job(timeout_s, dist, report_dir, exclude_hung=True,
                                         watch_hosts=os.environ.get(HOST_RELAYS_ENV) == "1",
                                         waited=self.members.waited_s).start()
        if dist.is_main and self.watchdog.active:
            log.info("hang watchdog: a rank kept waiting %g s on the others in a step's all-reduce or agreement "
                     "names the ranks behind (a hang report in %s) and they are ended, so that the others go on "
                     "(--hang-timeout; 0 turns it off)", timeout_s, report_dir)

    def finished(self) -> None:
        """This rank's script ended: no watched collective follows; the finish watch takes over."""
        if self.watchdog is not None:
            self.watchdog.finish()

    def run(self, train: Callable[[State], T], state: State) -> T:
        """Collective: `train(state)`, run again on the survivors after each recovery and after each grow."""
        if self.job.joining is not None:
            self._take_joined_state(state)
        state.check_at_first_commit(self._check_shared)
        state.at_each_commit(self.at_commit)
        self.regrowable = True

        def again() -> T:
            self.state, self.started = state, time.time()
            return train(state)

        return self.engine.run(again)

    def _check_shared(self, state: State) -> None:
        """Collective (the first commit): one line naming the shared values that differ across ranks, which a
        recovery would overwrite from one survivor (a value only some ranks update, such as a best loss that only
        rank 0 tracks), and what to do."""
        dist = self.dists[0]
        differ = diverging(dist.allgather(state.digests()))
        if differ and dist.is_main:  # a local log line, after the collective
            log.warning("mpiddp.State: %s differ%s across ranks at the first commit: a recovery would give every "
                        "survivor one rank's value; make %s the same on every rank, or declare %s "
                        "State(per_rank=[...])", ", ".join(map(repr, differ)), "s" if len(differ) == 1 else "",
                        "it" if len(differ) == 1 else "them", "it" if len(differ) == 1 else "them")

    def at_commit(self, state: State) -> None:
        """Collective, at each commit (a step boundary): the DDP wrappers' bucket re-layout after their first step
        (watched, where DDP's next forward would do it unwatched); the first step after a change of size ends its
        `first_step` phase; afterwards, grow back when due (Regrown: new ranks joined, `train` runs again)."""
        if self.watchdog is not None:  # the step in the hang report (its pid asked of rank 0 at the first)
            self.watchdog.beat("compute", state.commits)
        self.manager.rebuild_buckets()
        if self._changed_at is not None:
            now = time.monotonic()
            if self.changes:
                self.changes[-1].phases["first_step"] = now - self._changed_at
                if self._stalled_from is not None:  # the survivors' stand-still: from the grow's stop to this step
                    self.changes[-1].phases["stand_still"] = now - self._stalled_from
            self._changed_at = self._stalled_from = None
            return
        self.state = state
        self.grower.at_boundary(self)

    @property
    def awaiting_join(self) -> bool:
        """This rank was spawned (or woken) by a grow and has not taken the survivors' state yet."""
        return self.job.joining is not None

    @property
    def grows_back(self) -> bool:
        """A new rank can enter the training: run_recoverable's State, or a step loop that declared its position."""
        return self.regrowable or (self.loop is not None and self.loop.grows)

    def _take_joined_state(self, state: State) -> None:
        """Collective over the merged job (a new rank's half of GrowBack._join): the state a survivor handed over,
        then the callbacks, as on the survivors."""
        from mpiddp.elastic.grow import receive

        payload = receive(self._enter())
        state.load(payload["state"])
        state.drop_gradients()
        self._joined(state.commits)

    def join_step_loop(self, load: Callable[[dict[str, Any]], int]) -> None:
        """Collective over the merged job (a new rank's half of GrowBack._join for a loop under mpiddp.Optimizer,
        at its first optimizer step): the loop's state a survivor handed over, given to `load` (which wraps the
        models again over the merged job and returns the steps the job stands at), then the callbacks."""
        from mpiddp.elastic.grow import receive

        self._joined(load(receive(self._enter())["loop"]))

    def _joined(self, commits: int) -> None:
        """A new rank has the survivors' state: it is one of them from now on; the grow on record, the callbacks."""
        assert self.job.joining is not None and self.job.joining.joining is not None
        joining = self.job.joining.joining
        self.job = dataclasses.replace(self.job, joining=None)
        ranks, hosts, before, _ = joining.added
        record = grow_record(commits, ranks, hosts, before, self.dists[0].world_size, joining.phases)
        self._changed(MembershipChange(self.dists[0].rank, self.dists[0].world_size, before, (), (), 0,
                                       record["phases"], tuple(ranks), tuple(hosts)))

    def _changed(self, change: MembershipChange) -> None:
        self.changes.append(change)
        self._changed_at = time.monotonic()
        for callback in self.manager.callbacks:
            callback(change)

    def recover(self, lost: MembersLost, state: State, waited_from: float) -> None:
        """Collective over the survivors: shrink, rebuild, sync the state, run the callbacks; NotRecovered (the job
        ends) where it cannot."""
        self.state, self.started = state, waited_from
        self.engine.recover(lost)

    # -- the engine's policy --

    @property
    def log_level(self) -> str | None:  # type: ignore[override]
        return chosen_level()  # what the script's logging chose (a recovery keeps it)

    def alive_at(self) -> float:
        return self.started

    def records_dir(self) -> Path | None:
        return records_dir(self.dists[0].topology.failure_file, None)

    def before_shrink(self) -> None:
        if self.watchdog is not None:  # the ranks it ended (the recovery's cause), before it follows the survivors
            self._ended_by_watch = (set(self.watchdog.excluded), set(self.watchdog.silenced))
            self.watchdog.suspend()

    def after_rebind(self, dist: Dist) -> None:
        if self.job.watch is not None:
            self.job.watch.follow(dist)
        if self.watchdog is not None:
            self.watchdog.follow(dist)

    def resume(self, dist: Dist, before: Topology, failed: tuple[int, ...]) -> tuple[str, int | None]:
        assert self.state is not None
        self.manager.drop_old_wrappers()
        # what the survivors' watchdogs ended, in one view: the one that ended a hung rank 0 may be any survivor
        views = dist.allgather([sorted(ranks) for ranks in self._ended_by_watch])
        hung, silent = ({rank for view in views for rank in view[part]} for part in (0, 1))
        self._ended_by_watch = (hung, silent)
        return "state", sync(self.state, DistComm(dist))

    def settle(self, before: Topology, failed: tuple[int, ...], phases: dict[str, float], leader: int | None) -> None:
        dist = self.dists[0]
        change = MembershipChange(dist.rank, dist.world_size, before.world_size, failed,
                                  tuple(hosts_of(before, failed)), leader, phases)
        directory = self.records_dir()
        (hung, silent), self._ended_by_watch = self._ended_by_watch, (set(), set())
        cause = recovery_cause(failed, hung, silent)
        if dist.is_main and directory is not None:  # under launch: it learns of the host lost, as the trainer's
            recoveries.record(directory, {"time": time.time(), "cause": cause, "ranks_lost": list(failed),
                                          "hosts_lost": list(change.hosts_lost), "world_before": before.world_size,
                                          "world_after": dist.world_size, "phases": phases})
        if dist.is_main:
            synced = "the same on every survivor" if leader is None else f"from rank {leader}"
            log.warning("in-job recovery: ranks %s on %s %s; %d ranks go on (state %s; agree and shrink %.3f s, "
                        "process group %.3f s, state sync %.3f s)", list(failed), ", ".join(change.hosts_lost),
                        {"hang": "hung and were ended", "silent_host": "went silent"}.get(cause, "failed"),
                        change.world_size, synced, phases["agree_and_shrink"], phases["process_group"],
                        phases["state"])
        self.engine.say_reduced(len(self.changes) == 0)
        if not self.grows_back and self.grower.offered:
            self.grower.stop_growing(dist, "a loop under mpiddp.Optimizer keeps its position in its own variables, "
                                     "which it did not declare: a new rank could not enter it (mpiddp.keep(globals(), "
                                     "\"iter_num\", ...) declares them; or hand the loop to mpiddp.run_recoverable)")
        self._changed(change)

    # -- growing back (mpiddp.elastic.grow): the survivors' side, at a commit --

    @property
    def stepped_since_change(self) -> bool:
        return self._changed_at is None

    def steps_done(self) -> int:
        return self.state.commits if self.state is not None else 0

    def grow_split(self, world: int, grown: int) -> int | None:
        """A script re-splits its batch itself (`split_global_batch` in an on_membership_change callback): the
        grow goes ahead at any commit. A step loop's take-in first agrees on every step held under the late commit
        (the state that moves must be committed): where a rank failed meanwhile the survivors recovered, and the
        grow, given up, is not taken in (None)."""
        taking_in = self.grower.warming is not None
        if self.loop is not None and taking_in and not self.loop.settle_for_grow():
            return None
        return grown

    def spawn_command(self) -> list[str]:
        return self.job.command

    def pause_watch(self) -> None:
        if self.watchdog is not None:
            self.watchdog.suspend()

    def follow_watch(self, dist: Dist) -> None:
        self.after_rebind(dist)

    def handover(self, split: int) -> dict[str, object]:
        if self.loop is not None:
            return {"loop": self.loop.handover()}
        assert self.state is not None
        return {"state": self.state.payload()}

    def rewrap_grown(self, split: int, dist: Dist) -> None:
        if self.loop is not None:  # the loop goes on in the same call of its optimizer's step: wrapped again now
            self.loop.rewrap_grown()
            return
        assert self.state is not None
        self.state.drop_gradients()  # the script wraps its model again when `train` runs again

    def grown(self, record: dict[str, Any], split: int, stalled_from: float) -> None:
        """The grow on record (the failures directory, on rank 0), said, and handed to the callbacks."""
        dist, directory = self.dists[0], self.records_dir()
        if dist.is_main and directory is not None:
            recoveries.record(directory, {"time": time.time(), **record})
        say_grown(dist, self.engine.initial_world, record, "(the script re-splits in its on_membership_change "
                  "callbacks)")
        self._changed(MembershipChange(dist.rank, dist.world_size, record["world_before"], (), (), 0,
                                       record["phases"], tuple(record["ranks_added"]), tuple(record["hosts_added"])))
        self._stalled_from = stalled_from

    def regrown(self) -> None:
        self.manager.drop_old_wrappers()  # the wrapper of the call that grew is gone with its frames


def _process_group_backend() -> str:
    """The backend of torch's default process group, which a torchrun-style script starts itself; "none"."""
    import torch.distributed as tdist

    return str(tdist.get_backend()) if tdist.is_available() and tdist.is_initialized() else "none"


class Manager:
    """A script's in-job recovery, one per process (the shape of torchft's Manager, which its DDP and optimizer
    wrappers are handed): the job `mpiddp.init()` or `mpiddp run` bootstrapped, the callbacks, whether this
    process decided (once, collectively) if it can recover and the ScriptRecovery it turned on, and the wrappers a
    recovery rebuilds or checks gone. mpiddp's public names (mpiddp.script.recovery) hand the process's one
    Manager to everything here; nothing here holds it."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[MembershipChange], None]] = []
        self.own: OwnJob | None = None  # None under `mpiddp run` before it adopts its job, or before init
        self.recovery: ScriptRecovery | None = None
        self.decided = False  # whether this process decided (once, collectively) if it can recover
        self.wrappers: list[weakref.ref[DDP]] = []  # torch's DDP wrappers: a recovery checks they are gone
        self.gradient_hooks: list[weakref.ref[GradientHook]] = []  # watch_gradients': their bucket re-layout
        self.models: list[weakref.ref[nn.Module]] = []  # mpiddp's wrappers (elastic.steps), rebuilt after a recovery
        self.optimizers: list[weakref.ref[torch.optim.Optimizer]] = []  # mpiddp.Optimizer: held steps rolled back
        self.generation = 0  # recoveries this process went through: gradients from before the last one are stale
        self.kept: Kept | None = None  # the step loop's own variables that hold its position (mpiddp.keep)
        self.running = 0  # run_recoverable calls under way (one, or none)
        self.loop_stepped = False  # a loop under mpiddp.Optimizer took its first step (its keep is decided then)

    def on_membership_change(self, callback: Callable[[MembershipChange], None]) -> Callable[[MembershipChange], None]:
        """Run `callback(change)` on every survivor after each recovery, once the state is synced and before the
        training function runs again (rescale a learning rate, reopen a per-rank file). Usable as a decorator."""
        self.callbacks.append(callback)
        return callback

    def adopt(self, job: OwnJob | None) -> None:
        """`mpiddp.init()` (or `mpiddp run`) hands over the job it bootstrapped itself."""
        self.own = job

    def hold(self, dist: Dist) -> None:
        """`mpiddp.init()` under `mpiddp run`: the Dist it returns to the script, placed on the runner's job, is
        the one a recovery rebinds first (the script's `dist.rank` follows the survivors)."""
        assert self.own is not None, "mpiddp run adopts its job before the script runs"
        self.own = dataclasses.replace(self.own, dists=[dist, *self.own.dists])

    def active(self) -> ScriptRecovery | None:
        """The job's in-job recovery once `run_recoverable` turned it on, else None."""
        return self.recovery

    def enabled(self, min_world_size: int | None = None) -> ScriptRecovery | None:
        """Collective the first time (every rank calls it at the same point): the job's in-job recovery, turned
        on when this job can recover, else None with one line on rank 0 saying why; later calls return the same."""
        dist = current()
        if dist is None:
            raise RuntimeError("mpiddp's in-job recovery needs mpiddp's job: run the script under `python -m mpiddp "
                               "run` or call mpiddp.init() first")
        return self._decide(dist, min_world_size)

    def _decide(self, dist: Dist, min_world_size: int | None) -> ScriptRecovery | None:
        if not self.decided:
            self.recovery = ScriptRecovery.enable(self, dist, min_world_size)
            self.decided = True
        return self.recovery

    def run_recoverable(self, train: Callable[[State], T], state: State, min_world_size: int | None = None) -> T:
        """Collective: run `train(state)` and return what it returns; when a rank dies, the survivors recover in
        the job (see the module) and run `train(state)` again, with `state` synced. `min_world_size`: the fewest
        ranks the job may go on with (default MPIDDP_MIN_NP, which `launch --min-np` sets, else 1). Needs
        `mpiddp.init()` first. Where recovery cannot work, one line on rank 0 says why and `train(state)` runs as
        without it."""
        if not isinstance(state, State):
            raise TypeError(f"mpiddp.run_recoverable(train, state): state must be an mpiddp.State, not "
                            f"{type(state).__name__}")
        dist = current()
        if dist is None:
            raise RuntimeError("mpiddp.run_recoverable() needs mpiddp's job: call mpiddp.init() first")
        recovery = self._decide(dist, min_world_size)
        if recovery is None:
            return train(state)
        self.running += 1
        try:
            return recovery.run(train, state)
        finally:
            self.running -= 1

    def keep(self, where: MutableMapping[str, Any] | object, names: tuple[str, ...]) -> None:
        """The step loop's own variables that hold its position (mpiddp.keep): a grow hands them to new ranks.
        Declared after the loop's first step they would come too late: whether the loop grows back (its spares
        kept or released) was decided there, and a new rank takes them at its first step."""
        if self.loop_stepped and (self.kept is None or self.kept.where is not where
                                  or not set(names) <= set(self.kept.names)):
            raise ValueError("mpiddp.keep after the loop's first optimizer.step(): whether the loop grows back was "
                             "decided at that step, and a new rank takes the kept variables at its own first step: "
                             "call mpiddp.keep before the loop")
        if self.kept is not None and self.kept.where is not where:
            raise ValueError("mpiddp.keep: the loop's variables are already kept in another namespace: keep them "
                             "all in one (the module's globals(), or one object)")
        if self.kept is None:
            self.kept = Kept(where, names)
        else:
            self.kept.add(names)

    def release_spares_of_step_loop(self) -> None:
        """Every rank, at the first step of a loop under mpiddp.Optimizer (mpiddp.elastic.steps): where that loop
        cannot grow back (it did not declare its position: mpiddp.keep), the job's hot spares are released now
        (each ends at once) and rank 0 says once why and what to do, instead of holding them all run for nothing;
        spare hosts to spawn onto are given up the same way. Not collective: every rank takes its first step at the
        same point of its script, and what decides (recovery on, run_recoverable running, the loop's keep, the
        spares waiting) is the same on every rank, so each worker sends every spare its word to leave without
        asking the others."""
        recovery, spares = self.recovery, spare_world()
        self.loop_stepped = True
        # Known at the first step, and not earlier: a new rank enters a loop under mpiddp.Optimizer at its first
        # step, where it takes the loop's variables the script declared (mpiddp.keep, usually just before the
        # loop); a loop that declared none keeps its position where a new rank cannot start from. The DDP wrapper
        # alone decides nothing: run_recoverable's training function may wrap its model in it. Without recovery (no
        # ULFM) nothing changes: a spare's exit without MPI_Finalize would end such a job, and it could never grow
        # back either.
        if recovery is None or self.running or self.kept is not None or not recovery.grower.offered:
            return
        hot = spares is not None and bool(spares.waiting)
        if recovery.dists[0].is_main:  # a local log line, no collective
            if hot:
                hosts, count = sorted(set(spares.hosts)), len(spares.waiting)  # type: ignore[union-attr]
                ending = (f"the {count} hot spare{'' if count == 1 else 's'} on {', '.join(hosts)} "
                          f"end{'s' if count == 1 else ''} now")
            else:
                ending = "the spare hosts are not used"
            log.warning("%s: this loop under mpiddp.Optimizer recovers from a lost rank but cannot grow back, as "
                        "it did not say which of its own variables hold its position (a new rank could not enter "
                        "it), so %s and a lost rank leaves the job at reduced size; to grow back, declare them before "
                        "the loop (mpiddp.keep(globals(), \"iter_num\", ...); mpiddp.keep(globals()) where "
                        "optimizer.steps is the position) or hand the loop to mpiddp.run_recoverable, else run "
                        "without spares",
                        "hot spares released at start-up" if hot else "not growing back", ending)
        recovery.grower.give_up_spares()
        if hot:
            release_spares("released at start-up: the script's loop under mpiddp.Optimizer does not grow back (rank "
                           "0 says why)")

    def wait_for_every_rank(self, dist: Dist) -> None:
        """Collective, once this rank's script has finished: wait, asleep, until every rank's has. Under in-job
        recovery a rank that fails meanwhile ends the job with one line (LostAfterFinish), not a traceback from
        the barrier: what it had left to do (rank 0's save, say) is not recovered."""
        from mpiddp.errors import LostAfterFinish
        from mpiddp.elastic.membership import members_lost

        if self.recovery is not None:
            self.recovery.finished()
        try:
            dist.wait_for_all()
        except Exception as exc:
            lost = members_lost(self.recovery.members, exc) if self.recovery is not None else None
            if lost is None:
                raise
            names = ", ".join(map(str, lost.ranks)) or "?"
            raise LostAfterFinish(f"rank(s) {names} failed after the script had finished here; in-job recovery "
                                  f"covers the training, not what a lost rank had left to do (rank 0's save, say): "
                                  f"ending the job (MPI_ERR_PROC_FAILED: ranks {names} failed)") from None
        if self.recovery is not None:
            self.recovery.grower.finished_while_warming(dist)

    def drop_old_wrappers(self) -> None:
        """The interrupted call's DDP wrapper hooks the parameters (its reducer, left mid-step, would fail the next
        backward with "marked as ready twice") until it is destroyed: usually at once, with the failed call's
        frames; a reference cycle keeps it until a collection (a tenth of a second, so only when one is left)."""
        if not self.wrappers or any(ref() is not None for ref in self.wrappers):
            gc.collect()
        left = [ref for ref in self.wrappers if ref() is not None]
        self.wrappers = []
        if left:
            log.warning("in-job recovery: %d DDP wrapper(s) from before the recovery are still referenced; their "
                        "hooks would fail the next backward: wrap the model inside the function run_recoverable "
                        "runs, and keep no other reference to the wrapper", len(left))

    def track_wrapper(self, ddp: DDP) -> None:
        """A torch DDP wrapper that must be gone when a recovery rebuilds the process group (drop_old_wrappers):
        tracked, a recovery collects garbage only when one is left (a collection costs a tenth of a second or
        more)."""
        self.wrappers.append(weakref.ref(ddp))

    def track_model(self, model: nn.Module) -> None:
        """One of mpiddp's DDP wrappers: a recovery under mpiddp.Optimizer rebuilds it over the survivors."""
        self.models.append(weakref.ref(model))

    def live_models(self) -> list[nn.Module]:
        return [model for ref in self.models if (model := ref()) is not None]

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """One of mpiddp's optimizers: a recovery rolls back the step each holds under the late commit."""
        self.optimizers.append(weakref.ref(optimizer))

    def live_optimizers(self) -> list[torch.optim.Optimizer]:
        return [optimizer for ref in self.optimizers if (optimizer := ref()) is not None]

    def watch_gradients(self, ddp: DDP, compression: str = "none") -> DDP:
        """Collective-free: under in-job recovery, DDP's gradient all-reduce runs on the process group as DDP's
        own does (`compression`: "none", "fp16" or "bf16" sends half the bytes) but is waited for under MPI's
        failure watch, so a rank whose peer dies while it waits in gloo's all-reduce learns it at once. Without
        recovery, DDP's own all-reduce (or `compression`'s hook). Returns `ddp`. Call it on each new DDP wrapper."""
        from mpiddp.job.compression import register
        from mpiddp.job.transport import HOOK_COMPRESSIONS

        if compression not in HOOK_COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(HOOK_COMPRESSIONS)}, got {compression!r}")
        members = self.recovery.members if self.recovery is not None else None
        if members is not None or compression != "none":
            hook = register(ddp, compression, backend="gloo", members=members)
            if members is not None:
                self.gradient_hooks.append(weakref.ref(hook))
        self.track_wrapper(ddp)
        return ddp

    def rebuild_buckets(self) -> None:
        """Collective, at a commit: the watched wrappers' DDP bucket re-layout, after their first step
        (GradientHook.rebuild_buckets: MembersLost when a peer failed); nothing once done."""
        live = [hook for ref in self.gradient_hooks if (hook := ref()) is not None]
        self.gradient_hooks = [weakref.ref(hook) for hook in live]
        for hook in live:
            hook.rebuild_buckets()

    def wait(self, work: Work) -> None:
        """Wait for a torch collective of your own, issued with `async_op=True`: under in-job recovery, under
        MPI's failure watch (a blocking gloo collective would wait out its whole timeout for a dead peer)."""
        if self.recovery is None:
            work.wait()
        else:
            self.recovery.members.wait(work)
