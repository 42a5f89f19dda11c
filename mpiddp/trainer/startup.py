"""Where the time before the first step goes: each rank marks the end of each start-up phase; the summary
keeps, per phase, the slowest rank and its seconds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PHASES = (
    "interpreter_and_imports",  # from the process's start (so the interpreter counts) to mpiddp's main()
    "mpi_and_topology",  # MPI initialised, hosts and local ranks known, the config agreed
    "preflight",  # same code and packages everywhere, run directory ready
    "process_group",  # rendezvous, device, torch.distributed
    "data",
    "model",  # built, wrapped in DDP, restored from a snapshot
    "logger",  # metrics.jsonl opened, wandb started (in the background)
    "first_step",  # the first optimizer step finished
)


@dataclass
class StartupClock:
    """This rank's phase ends, as time.time() values; a phase not reached (a resumed run with nothing to do)
    has no end."""

    started_at: float
    ends: dict[str, float] = field(default_factory=dict)

    def mark(self, phase: str, at: float | None = None) -> None:
        assert phase in PHASES, phase
        self.ends[phase] = time.time() if at is None else at

    def durations(self) -> dict[str, float]:
        """Seconds per phase reached, each from the end of the previous phase reached."""
        out: dict[str, float] = {}
        previous = self.started_at
        for phase in PHASES:
            if phase in self.ends:
                out[phase] = max(0.0, self.ends[phase] - previous)
                previous = self.ends[phase]
        return out


def slowest_per_phase(per_rank: list[dict[str, float] | None]) -> dict[str, dict[str, float | int]]:
    """{phase: {"seconds": the slowest rank's, "rank": that rank}} for the phases every rank reached. A None is a
    rank that joined the running job (a grow): its own start is the grow's cost, recorded with the grow, not the
    job's, so it is left out (the ranks keep their numbers)."""
    started = {rank: durations for rank, durations in enumerate(per_rank) if durations is not None}
    out: dict[str, dict[str, float | int]] = {}
    for phase in PHASES:
        if started and all(phase in durations for durations in started.values()):
            slowest = max(started, key=lambda r: started[r][phase])
            out[phase] = {"seconds": started[slowest][phase], "rank": slowest}
    return out
