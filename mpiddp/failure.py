"""The failure record: why a job failed, in RUN_DIR/failure.json, for the supervisor (`python -m mpiddp launch`).

The protocol between the job and the supervisor (plain stdlib, no MPI): the first rank that sees a failure writes
it, later ones leave it alone. Writing never communicates with other ranks, because it runs while they may be
stuck; whoever wins the race to create the file (a hard link of a complete temporary file) is first.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FAILURE_FILE = "failure.json"
ATTEMPTS_FILE = "attempts.json"  # written by the supervisor after each attempt; the job's summary includes it
# exception: a rank raised; killed: a rank died by a signal (inferred by the supervisor from the launcher, since a
# SIGKILLed rank writes nothing); hang: the watchdog fired; user_error: exit 2; stopped: a stop signal or an
# interrupt; exit: a rank (or the user's script) exited early; host_fault: some hosts cannot run their ranks (a
# GPU lost) where the others can.
KINDS = ("exception", "killed", "hang", "user_error", "stopped", "exit", "host_fault")


@dataclass(frozen=True)
class FailureRecord:
    kind: str
    ranks: list[int]
    hosts: list[str]
    message: str
    step: int | None = None
    time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FailureRecord:
        kind = data.get("kind")
        return cls(kind=kind if kind in KINDS else "exception", ranks=[int(r) for r in data.get("ranks", [])],
                   hosts=[str(h) for h in data.get("hosts", [])], message=str(data.get("message", "")),
                   step=data.get("step"), time=float(data.get("time", 0.0)))


def failure_path(failure_file: str, run_dir: Path | None) -> Path | None:
    """Where a failure is recorded: the file the supervisor named, else RUN_DIR/failure.json, else nowhere."""
    if failure_file:
        return Path(failure_file)
    return run_dir / FAILURE_FILE if run_dir is not None else None


def clear_stale(run_dir: Path) -> None:
    """Rank 0, as a job starts in RUN_DIR: an earlier job's record (a crash before a requeue or a rerun with
    --resume) no longer describes this job, and would keep this job's own failure from being written."""
    try:
        (run_dir / FAILURE_FILE).unlink()
    except FileNotFoundError:
        pass


def write_first(path: Path, record: FailureRecord) -> bool:
    """Write `record` unless a record is already there; True when this one was written. Never raises OSError:
    a record that cannot be written must not hide the failure it describes."""
    try:
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "w") as out:
                json.dump(asdict(record), out, indent=1)
            os.link(temporary, path)  # fails if a record exists: the first complete record wins, atomically
            return True
        finally:
            os.unlink(temporary)
    except OSError:
        return False


def read(path: Path) -> FailureRecord | None:
    """The record, or None when there is none (or it cannot be read)."""
    try:
        return FailureRecord.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def read_attempts(run_dir: Path, resumed_at_step: int) -> dict[str, Any] | None:
    """The supervisor's attempts.json, for this job's summary (None when not supervised). This job is the
    attempt after the last one listed; it knows where it resumed, so it fills in that failure's steps lost."""
    try:
        data = json.loads((run_dir / ATTEMPTS_FILE).read_text())
    except (OSError, ValueError):
        return None
    attempts = data.get("attempts") if isinstance(data, dict) else None
    if not attempts:
        return None
    last = attempts[-1]
    if last.get("steps_lost") is None:
        last["resumed_at_step"] = resumed_at_step
        if isinstance(last.get("failed_at_step"), int):
            last["steps_lost"] = max(0, last["failed_at_step"] - resumed_at_step)
    return data
