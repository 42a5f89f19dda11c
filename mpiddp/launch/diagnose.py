"""Why an attempt failed: the job's failure record first, else what the launcher printed, else the exit status.

A rank killed by SIGKILL (the OOM killer, a node that lost power) writes no record, and the ranks that lose their
peer then fail too, some of them fast enough to write a record of their own. So a rank the launcher reports dead
by a signal outranks an `exception` record whose message is a lost peer (a gloo/NCCL/MPI connection failure): the
record names a consequence there, not the cause. Any other record wins: launchers kill every other rank once one
fails (srun --kill-on-bad-exit reports them `Terminated`, Hydra prints `KILLED BY SIGNAL: 9` for each), so their
text would blame the healthy hosts. srun lines after `Terminating StepId` / `CANCELLED` are that clean-up: ignored.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from mpiddp.failure import FailureRecord

EXIT_USER_ERROR, EXIT_STOPPED, EXIT_HANG, EXIT_INTERRUPTED = 2, 3, 4, 130  # as mpiddp.job.failfast (a job module)

# Open MPI 5: "prterun noticed that process rank 1 with PID 1234 on node nodeb exited on signal 9 (Killed)."
OPENMPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node (\S+?)\.? exited on\s+signal (\d+)")
# Open MPI, when a survivor's MPI noticed first (its abort may then be all prterun reports):
# "An MPI communication peer process has unexpectedly disconnected. ... Local host: nodea ... Peer host: nodeb"
OPENMPI_PEER_LOST = re.compile(r"peer process has unexpectedly disconnected.*?Peer host:\s*(\S+)", re.DOTALL)
# MPICH/Hydra: "=   RANK 1 PID 1234 RUNNING AT nodeb" then "=   KILLED BY SIGNAL: 9 (Killed)"
HYDRA_SIGNAL = re.compile(r"RANK (\d+) PID \d+ RUNNING AT (\S+)\s*\n=?\s*KILLED BY SIGNAL: (\d+)")
# MPICH 4+/Hydra names the host and PID of the first process that ended badly, not its rank:
# "=   PID 1234 RUNNING AT nodeb" / "=   EXIT CODE: 9"; when mpiexec itself survives the clean-up it adds
# "EXIT STRING: Killed (signal 9)" (a lost remote rank makes it abort first: then the exit code is the signal)
HYDRA_BAD_TERMINATION = re.compile(r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\s*\n=?\s*"
                                   r"PID \d+ RUNNING AT (\S+)\s*\n=?\s*EXIT CODE: (\d+)")
HYDRA_EXIT_SIGNAL = re.compile(r"EXIT STRING: [^\n]*\(signal (\d+)\)")
# srun: "srun: error: nodeb: task 1: Killed" or "tasks 2-3: Segmentation fault"
SRUN_SIGNAL = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (Killed|Segmentation fault|Aborted|Bus error|Terminated)")
SRUN_SIGNALS = {"Killed": 9, "Segmentation fault": 11, "Aborted": 6, "Bus error": 7, "Terminated": 15}
# srun's clean-up of the step after the first task failed: the tasks it reports dead after this, it killed itself
SRUN_CLEANUP = re.compile(r"Terminating StepId|CANCELLED")
# An exception about a lost peer, not a fault of the rank that raised it (gloo, NCCL, MPI, plain sockets)
LOST_PEER = re.compile(r"connection reset|connection closed|connection refused|broken pipe|socket closed"
                       r"|peer process has unexpectedly disconnected|remote process exited|got 0 bytes"
                       r"|DistNetworkError|ncclRemoteError|NCCL communicator was aborted"
                       r"|MPI_ERR_PROC_FAILED|MPI_ERR_REVOKED", re.IGNORECASE)


@dataclass(frozen=True)
class Failure:
    """One failed attempt, as the policy sees it."""

    kind: str  # a failure-record kind (mpiddp.failure.KINDS)
    status: int
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    message: str = ""
    step: int | None = None
    source: str = "exit status"  # failure record, launcher output, or exit status


def killed_by_signal(output: str) -> tuple[tuple[int, ...], tuple[str, ...], int] | None:
    """(ranks, hosts, signal) of ranks the launcher reports dead by a signal, or None."""
    found: list[tuple[int, str, int]] = []
    for match in OPENMPI_SIGNAL.finditer(output):
        found.append((int(match.group(1)), match.group(2), int(match.group(3))))
    for match in HYDRA_SIGNAL.finditer(output):
        found.append((int(match.group(1)), match.group(2), int(match.group(3))))
    cleanup = SRUN_CLEANUP.search(output)
    for match in SRUN_SIGNAL.finditer(output, 0, cleanup.start() if cleanup else len(output)):
        for rank in _task_ranks(match.group(2)):
            found.append((rank, match.group(1), SRUN_SIGNALS[match.group(3)]))
    if not found:
        hydra = HYDRA_BAD_TERMINATION.search(output)
        if hydra is not None:  # the host only: the supervisor finds its ranks through the placement
            exit_signal = HYDRA_EXIT_SIGNAL.search(output, hydra.end())
            return (), (hydra.group(1),), int(exit_signal.group(1) if exit_signal else hydra.group(2))
        lost = list(dict.fromkeys(match.group(1) for match in OPENMPI_PEER_LOST.finditer(output)))
        return ((), tuple(lost), signal.SIGKILL) if lost else None
    ranks = tuple(sorted({rank for rank, _, _ in found}))
    hosts = tuple(dict.fromkeys(host for _, host, _ in found))
    return ranks, hosts, found[0][2]


def _task_ranks(text: str) -> list[int]:
    ranks = []
    for item in text.split(","):
        low, _, high = item.partition("-")
        ranks.extend(range(int(low), int(high or low) + 1))
    return ranks


def lost_peer(record: FailureRecord) -> bool:
    """Whether the record is an exception about a lost peer (a consequence of another rank's death)."""
    return record.kind == "exception" and LOST_PEER.search(record.message) is not None


def diagnose(status: int, record: FailureRecord | None, output: str) -> Failure:
    """Combine the exit status, the job's record and the launcher's output into one Failure."""
    killed = killed_by_signal(output)
    if killed is not None and (record is None or lost_peer(record)):
        ranks, hosts, signum = killed
        name = signal.Signals(signum).name if signum in set(signal.Signals) else f"signal {signum}"
        step = record.step if record is not None else None
        who = f"rank {', '.join(map(str, ranks))} on " if ranks else "a rank on "
        return Failure("killed", status, ranks, hosts, f"{who}{', '.join(hosts)} died ({name} or lost)", step,
                       "launcher output")
    if record is not None:
        return Failure(record.kind, status, tuple(record.ranks), tuple(record.hosts), record.message, record.step,
                       "failure record")
    kind = {EXIT_USER_ERROR: "user_error", EXIT_STOPPED: "stopped", EXIT_INTERRUPTED: "stopped",
            EXIT_HANG: "hang"}.get(status, "exit")
    return Failure(kind, status, message=f"the launcher exited with status {status} and no failure record")
