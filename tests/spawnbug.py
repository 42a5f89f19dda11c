"""Whether an e2e grow's failure shows Open MPI 5.0.11's launcher bug (prterun's, in MPI_Comm_spawn's bookkeeping:
PRRTE 3.0's connect_release, docs/recovery.md) by that launcher's own signs, and none of mpiddp's own failure
lines: the grow tests xfail on that, and only on that, so a failure of mpiddp's own fails them."""

import re

# glibc's words as it aborts prterun on a corrupted heap (exit 134 / SIGABRT), each seen in these tests' runs
HEAP_CORRUPTION = ("corrupted size vs. prev_size", "corrupted double-linked list", "free(): invalid pointer",
                   "double free or corruption", "munmap_chunk(): invalid pointer", "malloc(): ",
                   "malloc assertion failure", "free(): invalid next size")
# the launcher itself ended by a signal (the fake hosts' `sh -c 'exec mpirun'`: negative; a shell's 128 + n)
CRASH_STATUSES = {-11: "SIGSEGV", 139: "SIGSEGV", -6: "SIGABRT", 134: "SIGABRT"}
PMIX_SPAWN_ERROR = "PMIX ERROR"  # prterun's, as it takes the buggy connect path of a spawn
LOST_DAEMON = "lost communication with a remote daemon"  # prterun's, naming a healthy host after the spawn
# prterun's report of a rank (not itself) that crashed: its own SIGSEGV or abort, not the launcher's
RANK_CRASHED = re.compile(r"noticed that process rank \d+ .*exited on signal (6|11)\b")
# mpiddp's own words where its own grow failed: the fall-back that ends the job, a new rank that could not warm up
OWN_FAILURES = ("in-job recovery not possible", "could not warm up")
SPAWN_HUNG = "has not returned after"  # mpiddp's bound on an MPI_Comm_spawn that prterun never completes


def prterun_crash(status: int, output: str) -> str | None:
    """The external cause shown in `output` (prterun's and the job's output together) and `status` (mpirun's), as
    one phrase for an xfail; None where the output does not show it, or shows a failure of mpiddp's own."""
    own = next((line for line in OWN_FAILURES if line in output), None)
    if own is not None:
        return None
    heap = next((sign for sign in HEAP_CORRUPTION if sign in output), None)
    rank_crashed = RANK_CRASHED.search(output) is not None
    if heap is not None and status != 0 and not rank_crashed:  # a launcher's status (launch's, 1) or prterun's
        return f'prterun aborted on a corrupted heap ("{heap}", status {status})'
    if CRASH_STATUSES.get(status) == "SIGSEGV" and not rank_crashed:
        return f"prterun itself died of SIGSEGV (status {status}), no rank reported signalled"
    if PMIX_SPAWN_ERROR in output and LOST_DAEMON in output:
        return f'prterun\'s "{PMIX_SPAWN_ERROR} ... pmix_server_dyn.c", then "{LOST_DAEMON}" (status {status})'
    if PMIX_SPAWN_ERROR in output and SPAWN_HUNG in output:
        return f'prterun\'s "{PMIX_SPAWN_ERROR}", then an MPI_Comm_spawn that never returned (status {status})'
    return None


def excuse(cause: str, when: str) -> str:
    """An xfail's reason: the external cause seen, and when."""
    return f"Open MPI 5.0.11's spawn bug {when}: {cause} (docs/recovery.md)"
