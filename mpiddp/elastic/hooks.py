"""The contract between the elastic engine and a user's recovery policy, in one place: what the engine
(mpiddp.elastic.engine.Engine) calls on its policy during a recovery (RecoveryHooks), and what growing back
(mpiddp.elastic.grow.GrowBack) calls on it at a step boundary (GrowHooks). Two policies implement both: the
trainer's (mpiddp.trainer.elastic_policy.TrainerPolicy) and a script's (mpiddp.elastic.api.ScriptRecovery), each
through engine.Policy, which binds the engine's side (engine, members, dists) and gives the optional hooks their
defaults. This file imports neither the engine nor the grower (they import it): what a hook sees of them is
declared here too (JobSize, LossWatcher).

Each is generic in what only the policy reads: RecoveryHooks in the outcome its `resume` hands its own `settle`
(the trainer: whether a survivor caught up, and the re-split; a script: the rank its state came from), GrowHooks in
the split its `grow_split` decides and its `handover` and `rewrap_grown` are given (the trainer: a Resplit; a
script: the new world size)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Protocol, TypeVar

if TYPE_CHECKING:
    from mpiddp.elastic.membership import Membership
    from mpiddp.job.collective import Dist
    from mpiddp.job.failfast import FailFast
    from mpiddp.job.topology import Topology

OutcomeT = TypeVar("OutcomeT")
SplitT = TypeVar("SplitT")

# a recovery's or a grow's phases, in seconds (None: not known yet, as a first step that has not ended)
Phases = dict[str, "float | None"]


class LossWatcher(Protocol):
    """What a recovery tells the policy's grower (mpiddp.elastic.grow.GrowBack) before the shrink."""

    def members_lost(self, dist: Dist, lost: tuple[int, ...], records: Path | None) -> None:
        """Every survivor, not collective: a grow under way is given up (its communicator numbers the old world)."""


class RecoveryHooks(Protocol[OutcomeT]):
    """What the engine asks of a policy, on every survivor, in this order during a recovery: alive_at,
    records_dir, refusal, before_shrink (then the shrink), after_rebind, resume (collective), settle; regrown after
    a grow instead. (engine.Policy also holds the engine's side, which the engine binds: engine, members, dists.)"""

    hide_cause: bool  # a fall-back's NotRecovered without the exception it was raised in (a script's report)

    @property
    def grower(self) -> LossWatcher | None:
        """Growing back after a recovery (mpiddp.elastic.grow.GrowBack), where the policy grows."""

    @property
    def guard(self) -> FailFast | None:
        """Follows the survivors with every Dist (survivors.bind_topology), as does the logging at `log_level`."""

    @property
    def log_level(self) -> str | None: ...

    def alive_at(self) -> float:
        """This rank's last sign of life of the job (time.time()): the detect phase runs from it."""

    def records_dir(self) -> Path | None:
        """The failures directory: an end recorded there stops the recovery."""

    def refusal(self) -> str | None:
        """A failure this policy does not recover from, in one line (None: it does)."""

    def before_shrink(self) -> None:
        """Note or stop what must be, before the shrink (the hang watchdog)."""

    def after_rebind(self, dist: Dist) -> None:
        """Follow the survivors before the state moves (a finish watch)."""

    def regrown(self) -> None:
        """New ranks joined (mpiddp.elastic.grow): before the body runs again."""

    def resume(self, dist: Dist, before: Topology, failed: tuple[int, ...]) -> tuple[str, OutcomeT]:
        """Collective: the state from the furthest survivor, wrapped again: (its phase's name, what settle gets)."""

    def settle(self, before: Topology, failed: tuple[int, ...], phases: Phases, outcome: OutcomeT) -> None:
        """The recovery into the policy's records, and its lines."""

    def fall_back(self, reason: str, ranks: tuple[int, ...]) -> NoReturn:
        """One line why, then the fail-fast path (Engine.fall_back)."""

    def bind(self, topology: Topology, verb: str = "goes on") -> None:
        """Every holder of the job's Dist now sees `topology` (after a grow)."""


class JobSize(Protocol):
    """What a grow reads of the engine: the job's full size and the fewest ranks it goes on with."""

    @property
    def initial_world(self) -> int: ...

    @property
    def min_size(self) -> int: ...


class GrowHooks(Protocol[SplitT]):
    """What GrowBack asks of a policy at a step boundary (collective over the survivors, then over the merged
    job): when a grow may start, and each of its steps the policy takes part in."""

    @property
    def engine(self) -> JobSize: ...

    @property
    def members(self) -> Membership: ...

    @property
    def dists(self) -> list[Dist]: ...

    @property
    def stepped_since_change(self) -> bool:
        """A step completed since the job last changed size (that change's first step is on record)."""

    def steps_done(self) -> int:
        """The step (or commit) the job stands at: a record's `step`."""

    def records_dir(self) -> Path | None:
        """The failures directory: rank 0 marks a spawn there while it is under way."""

    def grow_split(self, world: int, grown: int) -> SplitT | str | None:
        """The split on `grown` ranks at this position; None when not here (later it is); why not, when never."""

    def spawn_command(self) -> list[str]:
        """What a new rank runs (MPI_Comm_spawn's command line)."""

    def pause_watch(self) -> None:
        """Stop the hang watchdog's clock while the survivors stand still (spawn, take-in)."""

    def follow_watch(self, dist: Dist) -> None:
        """The watchers follow `dist` again after a grow's step (or its failure)."""

    def handover(self, split: SplitT) -> dict[str, object]:
        """Rank 0's state for the new ranks, from memory (their join takes it: mpiddp.elastic.grow.receive)."""

    def bind(self, topology: Topology, verb: str = "goes on") -> None:
        """Every holder of the job's Dist now sees `topology` (the merged job)."""

    def rewrap_grown(self, split: SplitT, dist: Dist) -> None:
        """Collective over the merged job: the state wrapped again at `split` (DDP, the loaders)."""

    def grown(self, record: dict[str, object], split: SplitT, stalled_from: float) -> None:
        """The grow into the policy's records (`record`: decide.grow_record's, with the new ranks' warm-up), and
        its lines; `stalled_from`: the monotonic time the survivors stood still from."""

    def fall_back(self, reason: str, ranks: tuple[int, ...]) -> NoReturn:
        """One line why, then the fail-fast path: a new rank failed while joining."""
