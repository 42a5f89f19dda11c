"""Snapshots by time (--save-interval): when one is due by global rank 0's clock, and what the saves cost.

Nothing here communicates: the loop hands rank 0's `due()` to the per-step stop agreement (`StopRequest.
agreed_with_save`), so every rank saves at the same step without a collective of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class SaveClock:
    """Wall time since the last snapshot (or since the clock was made, at the start of training). `now` is
    injectable so tests need no sleeps."""

    def __init__(self, interval_s: float = 0.0, now: Callable[[], float] = time.monotonic) -> None:
        assert interval_s >= 0, interval_s
        self.interval_s = interval_s
        self._now = now
        self.last = now()
        # Agreed at an epoch's last step: the epoch's own snapshot, after its evaluation, is the time-based one.
        self.pending = False

    def due(self) -> bool:
        """Local: whether `interval_s` has passed since the last snapshot (never, with an interval of 0)."""
        return self.interval_s > 0 and self._now() - self.last >= self.interval_s

    def restart(self) -> None:
        """A snapshot was just saved, whatever caused it: the next one is due an interval from now."""
        self.last = self._now()
        self.pending = False


@dataclass
class SaveCost:
    """What this job's snapshots cost: each save's wall time from its start to every rank agreeing it is
    published (the slowest rank's), and the size of the last file."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    bytes_last: int = 0

    def add(self, seconds: float, nbytes: int) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)
        self.bytes_last = nbytes

    def record(self) -> dict[str, Any]:
        """summary.json's `snapshots` entry."""
        return {"count": self.count, "total_s": self.total_s, "max_s": self.max_s,
                "mean_s": self.total_s / self.count if self.count else None, "bytes_last": self.bytes_last}
