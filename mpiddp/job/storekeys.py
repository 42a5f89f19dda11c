"""Every key mpiddp's own threads use in the rendezvous store, in one place (the store also holds torch's keys,
under the process group's own prefix). The hang watchdog, the finish watch and the failure report of every rank
meet here; a key spelled anywhere else would be a second protocol."""

from __future__ import annotations

PREFIX = "mpiddp"

# the failure report (mpiddp.job.failfast, through the bootstrap): counters every failing rank adds to
FAILURE_REPORTS = f"{PREFIX}/failures"  # the rank whose add returns 1 writes the one full report
FAILED_RANKS = f"{PREFIX}/failed-ranks"  # how many ranks failed so far

# the hang watchdog (mpiddp.job.watchdog)
PROGRESS_CLOCK = f"{PREFIX}/progress-clock"  # advanced by every publish: how fresh each rank's progress is
HANG_REQUEST = f"{PREFIX}/hang-request"  # set by the rank that writes the hang file: every watchdog answers
STACKS_GIVEN = f"{PREFIX}/stacks-given"  # how many ranks have put their stacks in the store
HANG_REPORTS = f"{PREFIX}/hang-reports"  # the first watchdog to fire (its add returns 1) describes the hang
# in-job recovery: the ranks behind, to be ended so that MPI declares them failed (JSON: rank -> pid, host, and
# whether to end them now: only once the hang file is written)
HANG_EXCLUDE = f"{PREFIX}/hang-exclude"
# in-job recovery: the hosts gone silent (mpiddp.job.silenthost), named by rank 0's watchdog (JSON: a list of
# host, its addresses, its ranks, how long they were quiet): every rank cuts its connections to them
SILENT_HOSTS = f"{PREFIX}/silent-hosts"

# the finish watch (mpiddp.job.finishwatch)
FINISHED = f"{PREFIX}/finished"  # how many ranks' scripts finished


def progress(rank: int) -> str:
    """A rank's last progress record: JSON of phase, step, idle seconds and the clock's tick."""
    return f"{PREFIX}/progress/{rank}"


def rank_of_progress(key: str) -> int:
    """The rank whose progress record `key` (one of progress()'s) is."""
    return int(key.rsplit("/", 1)[1])


def stacks(rank: int) -> str:
    """A rank's Python stacks, for the hang file."""
    return f"{PREFIX}/stacks/{rank}"


def trace(rank: int) -> str:
    """A rank's answer to the flight-recorder request: "" when its dump is in the run dir, else why not."""
    return f"{PREFIX}/trace/{rank}"


def finished(rank: int) -> str:
    """Set once the rank's script finished."""
    return f"{FINISHED}/{rank}"
