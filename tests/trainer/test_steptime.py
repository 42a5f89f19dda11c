"""The step clock on the CPU: which interval each phase is, read from a fake clock."""

import torch

from mpiddp.trainer import steptime
from mpiddp.trainer.steptime import StepClock, StepTime


def test_phases_are_the_intervals_they_name(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(steptime.time, "perf_counter", lambda: now[0])

    def at(seconds, action, *args):
        now[0] = float(seconds)
        action(*args)

    clock = StepClock(torch.device("cpu"))  # t=0: the previous step's end
    at(1, clock.waiting_for_data)
    at(2, clock.computing)  # data wait 1 s; compute starts
    at(3, clock.gradients_ready)  # a first bucket
    at(5, clock.gradients_ready)  # the last bucket: compute ends here, not at the step's end
    at(9, clock.step_done, 32)
    at(9, clock.waiting_for_data)
    at(10, clock.computing)
    at(12, clock.step_done, 16)  # no bucket reported (no DDP): compute runs to the step's end
    assert clock.flush() == [StepTime(step=9.0, data_wait=1.0, compute=3.0, images=32),
                             StepTime(step=3.0, data_wait=1.0, compute=2.0, images=16)]
    assert clock.flush() == []
