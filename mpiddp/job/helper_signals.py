"""The DataLoader's helper processes (forkserver, workers) ignore stop signals: only the rank acts on them. And they
die with the process that started them: a rank killed outright (the OOM killer, SIGKILL) must not leave them behind,
orphaned, holding the launcher's output pipe open (then mpirun waits for it forever)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from mpiddp.supervision import HELPER_PARENT_ENV, parent_death_signal

# The signals that stop a run (mpiddp.job.stopping acts on them in the rank); here, so that the forkserver's preload
# imports nothing heavy (stdlib only).
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


def mark_helper_parent() -> None:
    """In the rank, before helpers start: they die with this process (see die_with_parent)."""
    os.environ[HELPER_PARENT_ENV] = str(os.getpid())


def die_with_parent() -> None:
    """In a helper process: SIGKILL when the parent dies (a helper ignores every stop signal, so only SIGKILL ends
    it), and exit now if the parent is already gone (it died before the request was made). A helper whose parent
    named no pid (started outside mpiddp's loaders) gets the signal only."""
    parent_death_signal(signal.SIGKILL)
    expected = os.environ.get(HELPER_PARENT_ENV, "")
    if expected.isdigit() and os.getppid() != int(expected):
        os._exit(1)


def prepare_forkserver(also: tuple[str, ...] = ()) -> None:
    """Make the forkserver itself ignore stop signals (it forks every worker, and a dead one fails every later
    worker start with BrokenPipeError) and die with its rank: it imports mpiddp.job.forkserver_preload before
    anything else. Then it imports the modules `also` names, once, and every worker it forks has them: the
    modules a worker needs to unpickle its dataset (torch, torchvision: about 2 s of CPU each time) would
    otherwise be imported again by every worker, on the cores the ranks compute on. Never one that imports
    mpi4py.MPI: a helper must not start MPI."""
    import multiprocessing
    import multiprocessing.forkserver

    context = multiprocessing.get_context("forkserver")
    preload = list(getattr(multiprocessing.forkserver._forkserver, "_preload_modules", ["__main__"]))  # type: ignore[attr-defined]
    wanted = [name for name in ("mpiddp.job.forkserver_preload", *also) if name not in preload]
    if wanted:
        context.set_forkserver_preload([*preload, *wanted])
