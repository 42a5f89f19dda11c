"""Graceful stop on SIGTERM, SIGINT, SIGUSR1 or SIGUSR2: every rank agrees on the same step, saves, exits 3."""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpiddp.collective import Dist

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class Stopped(Exception):
    """Raised on every rank at the same step after the stop snapshot is saved."""

    def __init__(self, signal_name: str, step: int) -> None:
        super().__init__(f"stopped by {signal_name} at step {step}")
        self.signal_name = signal_name
        self.step = step


class StopRequest:
    """Remembers a stop signal; `agreed` turns one rank's signal into every rank's decision."""

    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> StopRequest:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            # A second signal: the user wants out now, snapshot or not.
            raise KeyboardInterrupt(f"second signal {signal.Signals(signum).name}")
        self.signum = signum
        # Not through logging: a handler that logs can re-enter a logging call the main thread was in.
        os.write(2, f"mpiddp: received {signal.Signals(signum).name}: stopping after the current step and saving "
                    f"a snapshot\n".encode())

    def agreed(self, dist: Dist) -> int:
        """Collective, once per step: the signal any rank received (0 if none)."""
        return dist.agree_stop(self.signum)
