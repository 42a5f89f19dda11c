"""The job and its supervisor (`python -m mpiddp launch`) watch each other's life: helpers die with their parent, the
launcher hears of its supervisor's death, and a job whose supervisor died stops with a snapshot and records why
(nobody else is left to). Stdlib only: the supervisor, the job and the loader's helper processes all use it."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from mpiddp import failure
from mpiddp.atomicfile import move, write_text_atomic
from mpiddp.contract import HELPER_PARENT_ENV, JOB_RECORD_FILE, SUPERVISOR_ENV  # noqa: F401
from mpiddp.errors import EXIT_STOPPED

# The pid a loader's helper process must die with (mpiddp.job.helper_signals): the rank sets its own before its helpers
# start (the fork and spawn methods' workers, the forkserver), the forkserver its own for the workers it forks.
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# The decision in attempts.json of an attempt whose supervisor died (the job writes it): the next launch continues it.
SUPERVISOR_DIED = "the supervisor died: not relaunched; rerun the same launch command"


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no prctl in the C library
        return None


def parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send `signum` to this process when its parent dies (strictly: when the parent's thread
    that forked it ends). Linux only: False elsewhere, or when prctl refuses."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def launcher_preexec(signum: int) -> Callable[[], None] | None:
    """For Popen(preexec_fn=...): the launcher gets `signum` when the supervisor dies, and never starts when it has
    already died. Resolved here, in the parent: between fork and exec the child only calls prctl. None off Linux."""
    prctl, parent = _prctl(), os.getpid()
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != parent:  # died before the request: no signal will come
            os._exit(EXIT_STOPPED)

    return preexec


def identity() -> str:
    """This process, as the job learns it from SUPERVISOR_ENV: HOST:PID."""
    return f"{socket.gethostname()}:{os.getpid()}"


def parse_identity(value: str) -> tuple[str, int] | None:
    """(host, pid) from HOST:PID, None when unset or malformed."""
    host, _, pid = value.rpartition(":")
    return (host, int(pid)) if host and pid.isdigit() else None


def is_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):  # no /proc (not Linux), or gone meanwhile
        return True
    return state not in ("Z", "X")


def record_supervisor_death(run_dir: Path, records: Path, rank: int, supervisor: str, step: int) -> None:
    """The job stopped because its supervisor died: say so in this rank's failure record (in `records`), and complete the supervisor's
    last attempt in attempts.json (it stays `status: null` otherwise), so that the run dir tells what happened."""
    message = (f"the supervisor (python -m mpiddp launch, {supervisor}) died; the job stopped at step {step} with "
               f"a snapshot. Rerun the same launch command: it resumes from the snapshot")
    failure.write_rank(records, rank, failure.FailureRecord("stopped", [], [], message, step=step, rank=rank, status=3))
    complete_last_attempt(run_dir / failure.ATTEMPTS_FILE, message, step)


def complete_last_attempt(path: Path, message: str, step: int) -> bool:
    """Fill in the last attempt of attempts.json, when nobody did (its status is still null), atomically. False
    when there is no such file or attempt, or it cannot be written."""
    try:
        data = json.loads(path.read_text())
        last = data["attempts"][-1]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return False
    if not isinstance(last, dict) or last.get("status") is not None:
        return False
    last.update(status=EXIT_STOPPED, ended_at=time.time(), cause="stopped", cause_source="job", message=message,
                failed_at_step=step, decision=SUPERVISOR_DIED)
    try:
        write_text_atomic(path, json.dumps(data, indent=1) + "\n")
    except OSError:
        return False
    return True


def stopped_by_supervisor_death(run_dir: Path) -> bool:
    """Whether the last finished attempt in `run_dir`'s attempts.json stopped because its supervisor died. The job
    told the user to rerun the same launch command to resume; that command names no --resume, so the new launch's
    first attempt must resume by itself, as a requeue does (else it refuses the snapshots as an earlier job's).
    This launch's own attempt, listed as it starts, has no status yet and is passed over."""
    try:
        attempts = json.loads((run_dir / failure.ATTEMPTS_FILE).read_text())["attempts"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    finished = [a for a in attempts if isinstance(a, dict) and a.get("status") is not None] \
        if isinstance(attempts, list) else []
    return bool(finished) and finished[-1].get("decision") == SUPERVISOR_DIED


def move_records(before: Path, after: Path) -> None:
    """Move launch's records of the attempt from its own run dir `before` to the job's `after` (the job's flags
    named another): every file of failures/, the job record, the attempts' output. File by file: `after` may
    hold a failures/ of an earlier launch already, which a whole directory cannot replace (os.replace then
    failed, and this attempt's records stayed behind, unread). Those earlier records no longer describe it."""
    records, target = before / failure.FAILURES_DIR, after / failure.FAILURES_DIR
    outputs = [path.name for pattern in ("attempt*.out", "attempt*.err") for path in before.glob(pattern)]
    moves = [(before / name, after / name) for name in (JOB_RECORD_FILE, *outputs)]
    if records.is_dir():
        failure.clear(target)
        target.mkdir(parents=True, exist_ok=True)
        moves += [(path, target / path.name) for path in records.iterdir()]
    for source, destination in moves:
        try:
            move(source, destination)
        except OSError:  # none there (no failure record: the job succeeded, or died without one)
            pass
    try:
        records.rmdir()
    except OSError:
        pass


def adopt_launch_records(launch_dir: Path, run_dir: Path) -> None:
    """After its supervisor died, a job whose flags named another run dir than launch's does what the supervisor
    did after each attempt: moves launch's records into its own run dir, and lists this launch's attempts after
    the earlier launches' in its attempts.json (so that the same launch command, rerun, finds them)."""
    if launch_dir.resolve() == run_dir.resolve():
        return
    move_records(launch_dir, run_dir)
    ours, theirs = launch_dir / failure.ATTEMPTS_FILE, run_dir / failure.ATTEMPTS_FILE
    try:
        data = json.loads(ours.read_text())
        attempts = [a for a in data["attempts"] if isinstance(a, dict)]
    except (OSError, ValueError, KeyError, TypeError):
        return
    try:
        earlier = [a for a in json.loads(theirs.read_text())["attempts"] if isinstance(a, dict)]
    except (OSError, ValueError, KeyError, TypeError):
        earlier = []
    launch = max([a.get("launch", 0) for a in earlier if isinstance(a.get("launch", 0), int)], default=-1) + 1
    listed = [*earlier, *({**a, "launch": launch} for a in attempts)]
    try:
        write_text_atomic(theirs, json.dumps({**data, "restarts": max(0, len(listed) - 1), "attempts": listed},
                                             indent=1) + "\n")
        ours.unlink()
    except OSError:
        pass
