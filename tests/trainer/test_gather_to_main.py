"""What only global rank 0 writes is gathered to it, not to every rank: the epoch record's per-rank step times and
summarise's per-rank timing. In-process, one rank of two played against a transport that counts its calls."""

import time
from types import SimpleNamespace

import torch

from mpiddp.job.collective import Dist, SoloTransport
from mpiddp.trainer.startup import StartupClock
from mpiddp.job.topology import RankRecord, build_topology
from mpiddp.trainer.config import Config
from mpiddp.trainer.train import Meter, RankTiming, TrainOutcome, training_record
from mpiddp.trainer.steptime import StepDurations


class TwoRanks(SoloTransport):
    """This process plays `rank` of two; the other rank contributes the same values."""

    def __init__(self, rank):
        self.rank, self.size, self.calls = rank, 2, []

    def allgather(self, value):
        self.calls.append("allgather")
        return [value, value]

    def gather(self, value):
        self.calls.append("gather")
        return [value, value] if self.rank == 0 else None  # as MPI's gather: the root alone receives

    def allreduce(self, values, op):
        return values * 2 if op == "sum" else values.copy()


def dist_as(rank):
    transport = TwoRanks(rank)
    records = [RankRecord(r, "h", 0, r, 2) for r in range(2)]
    return Dist(build_topology(rank, records), transport), transport


def test_the_epoch_records_rank_times_are_gathered_to_rank_0_only():
    state = SimpleNamespace(step=7, optimizer=SimpleNamespace(param_groups=[{"lr": 0.1}]))
    for rank in (0, 1):
        dist, transport = dist_as(rank)
        record = training_record(state, dist, 1, Meter(torch.tensor(4.0), 8, 2.0), StepDurations())
        assert transport.calls == ["gather"]
        assert record["train_loss"] == 0.5  # reduced: every rank has the job's numbers
        assert record["rank_step_time_s"] == ([0.0, 0.0] if rank == 0 else None)


def test_summarise_gathers_to_rank_0_which_alone_gets_the_summary():
    from mpiddp.trainer.run import summarise

    loaders = SimpleNamespace(num_train=16, num_eval=4)
    outcome = TrainOutcome([], RankTiming(0))
    for rank in (0, 1):
        dist, transport = dist_as(rank)
        summary = summarise(Config(), dist, outcome, loaders, time.time(), StartupClock(time.time()))
        assert "allgather" not in transport.calls and transport.calls.count("gather") == 1
        if rank == 0:
            assert summary["world_size"] == 2 and len(summary["rank_step_time_s"]) == 2
        else:
            assert summary == {}


class JoinedRank1(SoloTransport):
    """Rank 0 of two, where rank 1 joined the running job: gather hands rank 0 what rank 1 sent."""

    def __init__(self, theirs):
        self.rank, self.size, self.theirs = 0, 2, theirs

    def gather(self, value):
        return [value, self.theirs]

    def allreduce(self, values, op):
        return values


def test_a_rank_that_joined_after_a_grow_is_left_out_of_the_jobs_start_up():
    """The joined rank's process started ~10 s after the job and its first step came with the grow: neither is the
    job's time to its first step nor a phase of its start-up."""
    from mpiddp.trainer.run import summarise

    loaders, began = SimpleNamespace(num_train=16, num_eval=4), 1000.0
    sent = []

    class Capture(JoinedRank1):
        def gather(self, value):
            sent.append(value)
            return None

    joined_clock, joined_timing = StartupClock(began + 10.0), RankTiming(0)
    joined_timing.first_step_done_at = began + 24.0
    joined_dist = Dist(build_topology(1, [RankRecord(r, "h", 0, r, 2) for r in range(2)]), Capture(None))
    joined_dist.transport.rank = 1
    assert summarise(Config(), joined_dist, TrainOutcome([], joined_timing), loaders, joined_clock.started_at,
                     joined_clock, joined=True) == {}

    clock, timing = StartupClock(began), RankTiming(0)
    for phase, at in (("interpreter_and_imports", 1.0), ("mpi_and_topology", 1.5), ("process_group", 2.0),
                      ("data", 2.5), ("model", 3.0), ("logger", 3.5)):
        clock.mark(phase, at=began + at)
    timing.first_step_done_at = began + 4.0
    records = [RankRecord(r, "h", 0, r, 2) for r in range(2)]
    summary = summarise(Config(), Dist(build_topology(0, records), JoinedRank1(sent[0])), TrainOutcome([], timing),
                        loaders, began, clock)
    assert summary["time_to_first_step_s"] == 4.0 and summary["first_step_done_at"] == began + 4.0
    assert set(summary["startup_s"]) == {"interpreter_and_imports", "mpi_and_topology", "process_group", "data",
                                         "model", "logger", "first_step"}
    assert summary["startup_s"]["first_step"] == {"seconds": 0.5, "rank": 0}
    assert sum(entry["seconds"] for entry in summary["startup_s"].values()) == summary["time_to_first_step_s"]
