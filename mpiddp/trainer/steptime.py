"""Per-rank step timing that measures the work, not its enqueueing: the whole step, the wait for data, and the
compute until this rank's gradients were ready (before it waits for the others in the all-reduce).

After DDP's all-reduce every rank's step takes as long as the slowest one's, so the whole step cannot show a
straggler; the time to data and the time to ready gradients can. On a GPU the host only enqueues kernels, so
the clock records CUDA events on the compute stream and reads them back when the loop synchronises anyway
(at log windows and epoch ends), never per step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Union

import torch

Mark = Union[float, torch.cuda.Event]


@dataclass(frozen=True)
class StepTime:
    """One optimizer step on one rank, in seconds."""

    step: float  # from the end of the previous step to the end of this one (what throughput is made of)
    data_wait: float  # blocked in the data loader (host time: the loader runs on the host)
    compute: float  # from the start of the forward pass to this rank's last gradient bucket being ready
    images: int


class StepClock:
    """Marks the phases of each step; `flush()` turns the steps since the last flush into StepTimes.

    `gradients_ready()` is called by the communication hook each time a gradient bucket is ready, possibly
    from autograd's thread; the last call of a step marks the end of its compute.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._pending: list[tuple[Mark, Mark, Mark | None, Mark, float, int]] = []
        self._previous_end = self._mark()
        self._wait_started = time.perf_counter()
        self._data_wait = 0.0
        self._compute_start: Mark = self._previous_end
        self._gradients_ready: Mark | None = None
        self.steps_done = 0

    def _mark(self) -> Mark:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, start: Mark, end: Mark) -> float:
        if isinstance(start, float):
            assert isinstance(end, float)
            return end - start
        assert isinstance(end, torch.cuda.Event)
        return start.elapsed_time(end) / 1000.0

    def restart(self) -> None:
        """The next step starts now (after an in-job recovery): the steps timed so far stay to be flushed."""
        self._previous_end = self._mark()
        self._gradients_ready = None

    def waiting_for_data(self) -> None:
        self._wait_started = time.perf_counter()

    def computing(self) -> None:
        self._data_wait = time.perf_counter() - self._wait_started
        self._gradients_ready = None
        self._compute_start = self._mark()

    def gradients_ready(self) -> None:
        self._gradients_ready = self._mark()

    def step_done(self, images: int) -> None:
        end = self._mark()
        self._pending.append((self._previous_end, self._compute_start, self._gradients_ready, end, self._data_wait, images))
        self._previous_end = end
        self.steps_done += 1
        if self._cuda and self.steps_done == 1:
            end.synchronize()  # once per clock (epoch): the first step really ended when time-to-first-step says

    def flush(self) -> list[StepTime]:
        """The steps since the last flush (waits for the device once when on a GPU)."""
        if not self._pending:
            return []
        last_end = self._pending[-1][3]
        if isinstance(last_end, torch.cuda.Event):
            last_end.synchronize()
        times = [
            StepTime(
                step=self._seconds(previous_end, end),
                data_wait=data_wait,
                compute=self._seconds(compute_start, end if ready is None else ready),
                images=images,
            )
            for previous_end, compute_start, ready, end, data_wait, images in self._pending
        ]
        self._pending = []
        return times



# Durations from 1 microsecond to 10,000 s in log-spaced bins, 40 per decade: a quantile read from them is
# within 3% of the true value, and the whole record is 400 integers however long the run.
_BINS_PER_DECADE = 40
_SMALLEST_DECADE = -6
_NUM_BINS = 10 * _BINS_PER_DECADE


@dataclass
class Durations:
    """Count, sum, largest and a histogram of one kind of duration on one rank: a fixed size for a run of any
    length, and merged across ranks by adding, so the summary costs O(bins) memory and traffic, not O(steps)."""

    count: int = 0
    total: float = 0.0
    largest: float = 0.0
    bins: list[int] = field(default_factory=lambda: [0] * _NUM_BINS)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.largest = max(self.largest, seconds)
        self.bins[_bin_of(seconds)] += 1

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def quantile(self, fraction: float) -> float:
        """The value below which `fraction` of the durations lie, to the histogram's resolution (0 when empty)."""
        if not self.count:
            return 0.0
        wanted, seen = fraction * self.count, 0
        for index, number in enumerate(self.bins):
            seen += number
            if number and seen >= wanted:
                return min(self.largest, 10 ** (_SMALLEST_DECADE + (index + 0.5) / _BINS_PER_DECADE))
        return self.largest

    @classmethod
    def merged(cls, parts: Iterable[Durations]) -> Durations:
        together = cls()
        for part in parts:
            together.count += part.count
            together.total += part.total
            together.largest = max(together.largest, part.largest)
            together.bins = [a + b for a, b in zip(together.bins, part.bins)]
        return together

    def distribution(self) -> dict[str, float]:
        """mean, p50, p90 and max, as summary.json reports them."""
        return {"mean": self.mean, "p50": self.quantile(0.5), "p90": self.quantile(0.9), "max": self.largest}


def _bin_of(seconds: float) -> int:
    if seconds <= 0:
        return 0
    return min(_NUM_BINS - 1, max(0, int((math.log10(seconds) - _SMALLEST_DECADE) * _BINS_PER_DECADE)))


@dataclass
class StepDurations:
    """The three parts of every step on one rank, kept as fixed-size Durations."""

    step: Durations = field(default_factory=Durations)
    data_wait: Durations = field(default_factory=Durations)
    compute: Durations = field(default_factory=Durations)

    def add(self, timed: StepTime) -> None:
        self.step.add(timed.step)
        self.data_wait.add(timed.data_wait)
        self.compute.add(timed.compute)

    @property
    def count(self) -> int:
        return self.step.count
