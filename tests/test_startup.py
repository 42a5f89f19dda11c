"""The start-up breakdown: phase durations on one rank, the slowest rank per phase."""

from mpiddp.job.startup import PHASES, StartupClock, slowest_per_phase


def test_each_phase_runs_from_the_end_of_the_previous_one_reached():
    clock = StartupClock(started_at=100.0)
    clock.mark("interpreter_and_imports", at=101.5)
    clock.mark("mpi_and_topology", at=102.0)
    clock.mark("data", at=104.0)  # phases in between not reached (or not marked) are left out
    assert clock.durations() == {"interpreter_and_imports": 1.5, "mpi_and_topology": 0.5, "data": 2.0}


def test_the_summary_keeps_the_slowest_rank_of_each_phase_every_rank_reached():
    per_rank = [{"interpreter_and_imports": 2.0, "data": 1.0}, {"interpreter_and_imports": 3.0, "data": 0.5},
                {"interpreter_and_imports": 1.0}]
    assert slowest_per_phase(per_rank) == {"interpreter_and_imports": {"seconds": 3.0, "rank": 1}}
    assert list(slowest_per_phase([{p: 1.0 for p in reversed(PHASES)}])) == list(PHASES)  # in phase order
