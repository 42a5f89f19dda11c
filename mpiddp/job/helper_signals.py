"""The DataLoader's helper processes (forkserver, workers) ignore stop signals: only the rank acts on them."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

# The signals that stop a run (mpiddp.job.stopping acts on them in the rank); here, so that the forkserver's preload
# imports nothing else.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def ignore_stop_signals() -> None:
    """In a helper process: ignore the stop signals, then unblock them (a helper may start with them blocked)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block the stop signals in this thread while helper processes start: they inherit the block (through fork
    and exec alike) and cannot die of a signal before they ignore it. Here a blocked signal stays pending, and
    is handled when the block ends (or at once by another thread of the rank): none is lost."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
