"""What only global rank 0 writes is gathered to it, not to every rank: the epoch record's per-rank step times and
summarise's per-rank timing. In-process, one rank of two played against a transport that counts its calls."""

import time
from types import SimpleNamespace

import torch

from mpiddp.job.collective import Dist, SoloTransport
from mpiddp.job.startup import StartupClock
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
