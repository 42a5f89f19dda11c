"""Snapshots by time (--save-interval) in-process: the duration flag, rank 0's clock (a fake one: no sleeps), the
agreement riding on the per-step stop reduction, where the loop saves, and the saving cost's record and report line."""

import pytest

from mpiddp.job.collective import AGREEMENT_MARK as MARK, solo_dist
from mpiddp.job.stopping import StopRequest
from mpiddp.tools.report import snapshot_line
from mpiddp.trainer.config import Config, ConfigError, parse_args, parse_duration
from mpiddp.trainer.saveclock import SaveClock, SaveCost
from mpiddp.trainer.train import train
from test_collective import PeersTransport, dist_for
from test_loop import hooks, job


@pytest.mark.parametrize("text, seconds", [("15m", 900.0), ("90s", 90.0), ("1h", 3600.0), ("30", 30.0),
                                           ("0", 0.0), ("1.5h", 5400.0), (" 2M ", 120.0), ("0.5", 0.5)])
def test_durations_parse_to_seconds(text, seconds):
    assert parse_duration(text) == seconds
    assert parse_args(["--save-interval", text]).checkpoint.save_interval_s == seconds


@pytest.mark.parametrize("text", ["15x", "-5", "m", "", "1h30m", "nan"])
def test_a_bad_duration_is_one_line_saying_what_to_give(text):
    with pytest.raises(ConfigError) as caught:
        parse_args(["--save-interval", text])
    message = str(caught.value)
    assert message.startswith("--save-interval must be a duration such as 90s, 15m or 1h") and "\n" not in message


def test_the_interval_is_off_by_default_and_never_negative():
    assert Config().checkpoint.save_interval_s == 0.0
    with pytest.raises(ValueError, match="--save-interval must be a duration >= 0"):
        Config.of(save_interval_s=-1.0)
    with pytest.raises(ValueError, match="--save-interval must be a duration >= 0"):
        Config.of(save_interval_s=float("inf"))


class FakeTime:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_the_clock_is_due_an_interval_after_its_start_or_the_last_save():
    fake = FakeTime()
    clock = SaveClock(60.0, fake)
    fake.now += 59.9
    assert not clock.due()
    fake.now += 0.1
    assert clock.due()
    clock.pending = True
    clock.restart()
    assert not clock.due() and not clock.pending
    fake.now += 60.0
    assert clock.due()


def test_an_interval_of_zero_is_never_due():
    fake = FakeTime()
    clock = SaveClock(0.0, fake)
    fake.now += 1e9
    assert not clock.due()


def test_rank_0s_clock_decides_for_every_rank():
    # rank 1 whose own clock says due, rank 0's not: no snapshot; rank 0's says due: every rank saves.
    def peers(rank, reduced):
        return dist_for(PeersTransport(rank, [None], reduce_with=[[*reduced, MARK]]))

    assert StopRequest().agreed_with_save(peers(1, [0, 0]), True) == (0, False)
    assert StopRequest().agreed_with_save(peers(1, [0, 1]), False) == (0, True)
    assert StopRequest().agreed_with_save(peers(0, [0, 0]), True) == (0, True)
    stop = StopRequest()
    stop.signum = 10
    assert stop.agreed_with_save(solo_dist(), False) == (10, False)


def test_the_per_step_agreement_is_one_reduction_that_carries_the_save_request():
    calls = []

    class Counting(PeersTransport):
        def allreduce(self, values, op):
            calls.append((list(values), op))
            return super().allreduce(values, op)

    StopRequest().agreed_with_save(dist_for(Counting(0, [None], reduce_with=[[0, 0, MARK]])), True)
    assert calls == [([0.0, 1.0, MARK], "max")]


@pytest.mark.usefixtures("solo_group")
def test_a_due_clock_saves_mid_epoch_at_that_step_and_counts_again_from_there():
    cfg, dist, loaders, state = job(epochs=1, batch_size=64)
    steps = len(loaders.train)
    fake, saved = FakeTime(), []
    loop_hooks = hooks(saved)
    loop_hooks.save_clock = SaveClock(100.0, fake)

    def heartbeat(phase, step):  # the time passes during training steps 3 (100 s) and 5 (50 s more: not due)
        if phase == "train" and state.epoch == 0:
            fake.now += {3: 100.0, 5: 50.0}.get(step, 0.0)

    loop_hooks.heartbeat = heartbeat
    train(cfg, state, loaders, dist, loop_hooks)
    assert steps > 5
    assert saved == [(0, 3, 3), (1, steps, 0)]  # mid-epoch (0 epochs done, 3 batches into epoch 1), then the last


@pytest.mark.usefixtures("solo_group")
def test_a_clock_due_at_an_epochs_last_step_saves_that_epoch_after_its_evaluation():
    cfg, dist, loaders, state = job(epochs=2, batch_size=64, save_every=5)
    steps = len(loaders.train)
    fake, saved = FakeTime(), []
    loop_hooks = hooks(saved)
    loop_hooks.save_clock = SaveClock(100.0, fake)
    loop_hooks.heartbeat = lambda phase, step: setattr(fake, "now", fake.now + (100.0 if step == steps else 0.0)) \
        if phase == "train" else None
    train(cfg, state, loaders, dist, loop_hooks)
    # epoch 1 by time (not a mid-epoch copy of it a moment before its evaluation), epoch 2 as the last
    assert saved == [(1, steps, 0), (2, 2 * steps, 0)]


@pytest.mark.usefixtures("solo_group")
def test_without_an_interval_the_loop_saves_by_epoch_only():
    cfg, dist, loaders, state = job(epochs=2, batch_size=128, save_every=5)
    saved = []
    loop_hooks = hooks(saved)
    fake = FakeTime()
    loop_hooks.save_clock = SaveClock(0.0, fake)
    loop_hooks.heartbeat = lambda phase, step: setattr(fake, "now", fake.now + 1e6)
    train(cfg, state, loaders, dist, loop_hooks)
    assert saved == [(2, 2 * len(loaders.train), 0)]


def test_the_saving_cost_record_and_its_report_line():
    cost = SaveCost()
    assert cost.record() == {"count": 0, "total_s": 0.0, "max_s": 0.0, "mean_s": None, "bytes_last": 0}
    cost.add(0.5, 1_000_000)
    cost.add(1.5, 2_500_000)
    record = cost.record()
    assert record == {"count": 2, "total_s": 2.0, "max_s": 1.5, "mean_s": 1.0, "bytes_last": 2_500_000}
    line = snapshot_line({"snapshots": record, "wall_time_s": 40.0, "config": {"save_interval_s": 900.0}})
    assert line == "snapshots: 2 saved, every 900 s by time, 2.00 s in all (5.0% of the wall time), slowest 1.50 s, last 2.5 MB"
    assert snapshot_line({"wall_time_s": 40.0}) is None  # a summary written before snapshots were recorded
    assert snapshot_line({"snapshots": {"count": 0}, "wall_time_s": 1.0}) is None


def test_report_shows_the_saving_cost_in_one_line():
    from mpiddp.tools.report import text_summary

    summary = {"arch": "resnet18", "dataset": "synthetic", "world_size": 2, "num_hosts": 1, "backend": "gloo",
               "device": "cpu", "epochs": 1, "images_per_second": 300.0, "wall_time_s": 20.0,
               "time_to_first_step_s": 5.0, "config": {"save_interval_s": 0.0},
               "snapshots": {"count": 1, "total_s": 0.2, "max_s": 0.2, "mean_s": 0.2, "bytes_last": 93_600_000}}
    lines = text_summary([], summary).splitlines()
    assert [line for line in lines if line.startswith("snapshots:")] == [
        "snapshots: 1 saved, 0.20 s in all (1.0% of the wall time), slowest 0.20 s, last 93.6 MB"]
