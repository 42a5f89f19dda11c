"""A rank ends itself when its launcher's daemon on its host ends (Open MPI's prted or prterun, MPICH's Hydra proxy,
Slurm's slurmstepd): nothing is left running.

Such a daemon starts the ranks of its host and is their parent; it ends them when the job ends. When it dies
instead (Open MPI 5.0.11's prterun crashes after a spawn: "corrupted size vs. prev_size"; a daemon SIGKILLed by
the OOM killer), a rank inside MPI's own calls learns of it from MPI, but a rank in Python, in gloo or NCCL, or
warming up, is never told: measured, such ranks ran on as orphans, and ranks of one job went on training among
themselves over gloo while `mpiddp launch` relaunched the job. The evidence is the kernel's: this process's parent
changed (it was reparented to init or a subreaper). The watch runs from MPI's start, before the rendezvous store
the other watcher (mpiddp.job.watch) polls exists, and in a new rank growing back, which has no store until it
joins; so it is its own thread, which waits on the parent's pidfd (Linux 5.3+) and polls the parent otherwise.
"""

from __future__ import annotations

import os
import select
import sys
import threading
from collections.abc import Callable, Mapping

from mpiddp.errors import EXIT_CRASH

# what a launcher's daemon sets for each rank it starts: Open MPI's and PMIx's (srun --mpi=pmix too), MPICH
# Hydra's and Slurm's PMI
LAUNCHED_BY = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")
POLL_INTERVAL_S = 1.0  # where there is no pidfd

_watching: threading.Thread | None = None


def launched_by_a_daemon(env: Mapping[str, str]) -> bool:
    """Whether a launcher's daemon started this process (a lone `python train.py` has no such parent to follow:
    its parent is a shell, which may end on purpose, e.g. under nohup)."""
    return any(name in env for name in LAUNCHED_BY)


def say_orphaned(parent: int) -> None:
    """The rank's one line, where stderr still goes somewhere (the daemon forwarded it: often it does not)."""
    try:
        print(f"mpiddp: this rank's launcher daemon (pid {parent}) ended without ending it: this rank (pid "
              f"{os.getpid()}) ends now, so that nothing of the job is left running", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _end(parent: int) -> None:
    say_orphaned(parent)
    os._exit(EXIT_CRASH)  # no teardown: MPI, the store and every peer went with the daemon


def wait_for_parent_end(parent: int, interval_s: float = POLL_INTERVAL_S) -> None:
    """Return once process `parent` is no longer this process's parent."""
    try:
        pidfd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # Python < 3.9, a kernel without pidfd_open, or already gone
        pidfd = None
    if pidfd is not None:
        if os.getppid() == parent:  # the pidfd is of the parent, not of a reused pid
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)  # readable once that process has ended
            poller.poll()
        os.close(pidfd)
    stopped = threading.Event()  # never set: a timed wait that is not a busy loop
    while os.getppid() == parent:  # and after the pidfd: only a parent that changed counts
        stopped.wait(interval_s)


def watch_launcher_daemon(env: Mapping[str, str] | None = None,
                          end: Callable[[int], None] = _end) -> threading.Thread | None:
    """Once per process, where a launcher's daemon started it: a daemon thread that calls `end(parent pid)` when
    that parent ends (by default: one line, then this process ends at once with EXIT_CRASH). Returns the
    thread, or None when not watching (no launcher's daemon, a parent that is init already, or watching)."""
    global _watching
    parent = os.getppid()
    if _watching is not None or parent <= 1 or not launched_by_a_daemon(os.environ if env is None else env):
        return None

    def watch() -> None:
        wait_for_parent_end(parent)
        end(parent)

    _watching = threading.Thread(target=watch, name="mpiddp-launcher-daemon-watch", daemon=True)
    _watching.start()
    return _watching
