"""The failure records: why a job failed, one file per rank in RUN_DIR/failures/, for the supervisor (`launch`).

The protocol between the job and the supervisor (plain stdlib, no MPI): every rank that sees a failure writes its
own record, RUN_DIR/failures/rank-N.json, and keeps the first it wrote (its first failure is its cause; what
follows, such as the abort, is a consequence). No rank's record hides another's: the supervisor reads them all and
decides from all of them (mpiddp.launch.diagnose). Writing never communicates with other ranks, because it runs
while they may be stuck. Rank 0 also records where every rank runs (placement.json), as soon as the job knows.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mpiddp.atomicfile import write_new, write_text_atomic

FAILURES_DIR = "failures"  # RUN_DIR/failures/rank-N.json, one per rank that recorded a failure
PLACEMENT_FILE = "placement.json"  # in the same directory: {"hosts": [[host, [ranks...]], ...]} (rank 0 writes it)
RECOVERIES_FILE = "recoveries.jsonl"  # in the same directory: one line per in-job recovery, as it happens
# in the same directory once the job grows back: {"hosts": [...], "time"} (rank 0 writes it before MPI_Comm_spawn
# and adds "ended" once the new ranks joined or the grow was given up): a launcher that fails before that failed
# during the spawn; one that crashes after it may still have been corrupted by it (launch's diagnose.after_spawn)
SPAWNING_FILE = "spawning.json"
# In-job recovery: a hung rank with no peer on its host to end it; launch ends it through its agent (ssh, the
# rsh agent), and MPI then declares it failed. RUN_DIR/failures/end-pid-PID-HOST.json: {"host", "pid", "rank"}
END_PREFIX = "end-pid-"
ATTEMPTS_FILE = "attempts.json"  # written by the supervisor after each attempt; the job's summary includes it
# exception: a rank raised; killed: a rank died by a signal (inferred by the supervisor from the launcher, since a
# SIGKILLed rank writes nothing); hang: the watchdog fired; user_error: exit 2; stopped: a stop signal or an
# interrupt; exit: a rank (or the user's script) exited early; host_fault: some hosts cannot run their ranks (a
# GPU lost) where the others can; unreachable: the launcher could not start its daemon on a host.
KINDS = ("exception", "killed", "hang", "user_error", "stopped", "exit", "host_fault", "unreachable")


@dataclass(frozen=True)
class FailureRecord:
    """One rank's account. `ranks`/`hosts`: whom it names (itself, or for a hang or a host fault, the ranks at
    fault); `rank`: who wrote it; `step`: the writer's last completed training step (None: unknown, or a `run`
    script); `status`: the exit status the writer ended with; `progressed`: whether the writer had made progress in
    this job before it failed (a training step, or for a `run` script, torch.distributed set up)."""

    kind: str
    ranks: list[int]
    hosts: list[str]
    message: str
    step: int | None = None
    time: float = field(default_factory=time.time)
    rank: int | None = None
    status: int | None = None
    progressed: bool | None = None

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FailureRecord:
        kind = data.get("kind")
        step, rank, status = (data.get(key) for key in ("step", "rank", "status"))
        progressed = data.get("progressed")
        return cls(kind=kind if kind in KINDS else "exception", ranks=[int(r) for r in data.get("ranks", [])],
                   hosts=[str(h) for h in data.get("hosts", [])], message=str(data.get("message", "")),
                   step=step if isinstance(step, int) else None, time=float(data.get("time", 0.0)),
                   rank=rank if isinstance(rank, int) else None, status=status if isinstance(status, int) else None,
                   progressed=progressed if isinstance(progressed, bool) else None)


def records_dir(failure_dir: str, run_dir: Path | None) -> Path | None:
    """Where failures are recorded: the directory the supervisor named, else RUN_DIR/failures, else nowhere."""
    if failure_dir:
        return Path(failure_dir)
    return run_dir / FAILURES_DIR if run_dir is not None else None


def clear(directory: Path) -> None:
    """Remove the records and placement in `directory` (an earlier job's or attempt's no longer describe this one);
    never raises: a stale record is read with its time, and a clear that fails must not stop a job."""
    try:
        for path in directory.iterdir():
            if path.name.startswith(("rank-", ".rank-", END_PREFIX)) or path.name in (PLACEMENT_FILE, RECOVERIES_FILE, SPAWNING_FILE):
                path.unlink(missing_ok=True)
    except OSError:
        pass


def clear_stale(run_dir: Path) -> None:
    """Rank 0, as a job starts in RUN_DIR: an earlier job's records (a crash before a requeue or a rerun with
    --resume) no longer describe this job."""
    clear(run_dir / FAILURES_DIR)


def _write_new(path: Path, data: dict[str, Any]) -> bool:
    """Write `data` to `path` unless a file is there; True when written. Never raises OSError."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_new(path, json.dumps(data, indent=1))  # the first complete one stays, atomically
    except OSError:
        return False


def write_first(path: Path, record: FailureRecord) -> bool:
    """Write `record` to `path` unless a record is already there; True when this one was written. Never raises
    OSError: a record that cannot be written must not hide the failure it describes."""
    return _write_new(path, asdict(record))


def rank_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.json"


def write_rank(directory: Path, rank: int, record: FailureRecord) -> bool:
    """This rank's record, unless it recorded one already (its first failure is the cause); never raises."""
    return write_first(rank_path(directory, rank), record)


def ask_to_end(directory: Path, rank: int, host: str, pid: int) -> bool:
    """Ask `launch` to end process `pid` (rank `rank`) on `host`: a hung rank that no peer on its host can end
    (in-job recovery). True when written; never raises."""
    # the host in the name too: containers on different hosts give their processes the same pids
    name = f"{END_PREFIX}{pid}-{host.replace('/', '_')}.json"
    return _write_new(directory / name, {"host": host, "pid": pid, "rank": rank, "time": time.time()})


def to_end(directory: Path) -> list[tuple[str, dict[str, Any]]]:
    """(file name, request) of every request to end a hung rank in `directory`: only well-formed ones."""
    found = []
    try:
        paths = sorted(directory.glob(f"{END_PREFIX}*.json"))
    except OSError:
        return []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written (write_new renames a complete file in, so rarely) or broken
        if isinstance(data, dict) and isinstance(data.get("host"), str) and isinstance(data.get("pid"), int):
            found.append((path.name, data))
    return found


def read(path: Path) -> FailureRecord | None:
    """The record, or None when there is none (or it cannot be read)."""
    try:
        return FailureRecord.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def read_all(directory: Path) -> list[FailureRecord]:
    """Every rank's record in `directory`, oldest first (unreadable ones are skipped)."""
    try:
        paths = sorted(directory.glob("rank-*.json"))
    except OSError:
        return []
    records = [record for path in paths if (record := read(path)) is not None]
    return sorted(records, key=lambda r: r.time)


def end_decided(directory: Path | None) -> FailureRecord | None:
    """The record by which a rank decided the end of this job (the oldest in `directory`), or None. Records are
    cleared as each attempt and job starts, and a rank writes one only as it ends the job (never for a failure
    it recovers from), so any record means the job is ending: a peer that leaves now left on purpose."""
    if directory is None:
        return None
    records = read_all(directory)
    return records[0] if records else None


def mark_spawning(directory: Path | None, hosts: list[str]) -> None:
    """Rank 0, just before the job spawns new ranks onto `hosts` (growing back); never raises."""
    if directory is not None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            write_text_atomic(directory / SPAWNING_FILE, json.dumps({"hosts": hosts, "time": time.time()}))
        except OSError:
            pass


def spawned(directory: Path | None) -> None:
    """Rank 0, once the new ranks joined (or the grow was given up): no spawn under way, and the mark says when it
    ended (`ended`, wall time: last_spawn reads it); never raises. A spawn MPI refused keeps its mark (a launcher
    that lost the spawn's daemon refuses it, then ends the job)."""
    mark = last_spawn(directory) if directory is not None else None
    if directory is None or mark is None:
        return
    try:
        write_text_atomic(directory / SPAWNING_FILE,
                          json.dumps({"hosts": mark[0], "time": mark[1], "ended": time.time()}))
    except OSError:
        pass


def hold_spawning(directory: Path | None, seconds: float) -> None:
    """A survivor, as it gives up a grow at another rank's failure: the spawn's mark stands `seconds` more and
    then no longer counts (`until`, wall time); never raises."""
    mark = spawning(directory) if directory is not None else None
    if directory is None or mark is None:
        return
    try:
        write_text_atomic(directory / SPAWNING_FILE,
                          json.dumps({"hosts": mark[0], "time": mark[1], "until": time.time() + seconds}))
    except OSError:
        pass


def spawning(directory: Path, at: float | None = None) -> tuple[list[str], float] | None:
    """(the hosts, when it began) of a spawn that had not ended when the job stopped, or None; None also for a
    grow given up before `at` (default: now) by more than its hold (hold_spawning)."""
    data = _spawn_mark(directory)
    if data is None or "ended" in data:
        return None
    until = data.get("until")
    if isinstance(until, (int, float)) and (time.time() if at is None else at) > until:
        return None
    return data["hosts"], data["time"]


def last_spawn(directory: Path) -> tuple[list[str], float] | None:
    """(the hosts, when it began) of the last spawn of this attempt's job, ended or not (the mark is cleared as
    each attempt starts), or None when the job spawned nothing."""
    data = _spawn_mark(directory)
    return None if data is None else (data["hosts"], data["time"])


def _spawn_mark(directory: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((directory / SPAWNING_FILE).read_text())
        return {**data, "hosts": [str(host) for host in data["hosts"]], "time": float(data["time"])}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def write_placement(directory: Path, hosts: list[tuple[str, list[int]]]) -> bool:
    """Rank 0: where every rank runs, as the job observed it (host name, its world ranks), written once."""
    return _write_new(directory / PLACEMENT_FILE, {"hosts": [[name, list(ranks)] for name, ranks in hosts]})


def replace_placement(directory: Path, hosts: list[tuple[str, list[int]]]) -> bool:
    """The new rank 0 after an in-job recovery: the survivors' placement in place of the start's (a later
    failure's records number ranks in the survivors' world); True when written. Never raises OSError."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_text_atomic(directory / PLACEMENT_FILE, json.dumps({"hosts": [[n, list(r)] for n, r in hosts]}, indent=1))
    except OSError:
        return False
    return True


def read_placement(directory: Path) -> dict[int, str] | None:
    """rank -> host name as the job recorded it, or None when it recorded none (it failed before start-up)."""
    try:
        data = json.loads((directory / PLACEMENT_FILE).read_text())
        return {int(rank): str(name) for name, ranks in data["hosts"] for rank in ranks}
    except (OSError, ValueError, TypeError, KeyError):
        return None


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records that carry a step (a torn last line, or any line that is not one, is skipped)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _time(record: dict[str, Any], key: str = "time") -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def last_progress_at(records: list[dict[str, Any]], since: float, until: float) -> float | None:
    """When training last made progress between `since` and `until`: the newest record in metrics.jsonl other
    than a job's `start` (step records come every --log-every steps, so this is exact to within that many)."""
    times = [t for r in records if r.get("kind") != "start" and (t := _time(r)) is not None and since <= t <= until]
    return max(times) if times else None


# Where a failed attempt's downtime goes, in order; each phase ends where the next begins:
# detection: the last good step -> the launcher of the failed attempt exited;
# relaunch: -> the supervisor started the next launcher (its decision); launcher: -> the first rank's process
# started; startup: -> rendezvous done (interpreter, imports, MPI, preflight, torch.distributed);
# restore: -> data, model and snapshot loaded; first_step: -> the relaunched job's first step finished.
DOWNTIME_PHASES = ("detection", "relaunch", "launcher", "startup", "restore", "first_step")
START_MARKS = ("process_started_at", "rendezvous_at", "restored_at")  # the `start` record's times (rank 0's clock)


def downtime(last_step_at: float | None, ended_at: float | None, relaunched_at: float,
             records: list[dict[str, Any]]) -> tuple[float | None, dict[str, float]]:
    """(seconds from the failed attempt's last good step to the first finished step of the job relaunched at
    `relaunched_at`, those seconds per DOWNTIME_PHASES); (None, {}) while that job has not finished a step, or
    when a time is missing (a job of an older mpiddp, a `run` script). Times on different hosts assume
    synchronised clocks."""
    start = next((r for r in records if r.get("kind") == "start" and (_time(r) or 0) >= relaunched_at), None)
    first = next((r for r in records if r.get("kind") == "first_step" and (_time(r) or 0) >= relaunched_at), None)
    if start is None or first is None:
        return None, {}
    marks = [last_step_at, ended_at, relaunched_at, *(_time(start, key) for key in START_MARKS), _time(first)]
    if any(mark is None for mark in marks):
        return None, {}
    phases = {name: round(end - begin, 3) for name, begin, end in zip(DOWNTIME_PHASES, marks, marks[1:])}
    return round(marks[-1] - marks[0], 3), phases


def read_attempts(run_dir: Path, resumed_at_step: int) -> dict[str, Any] | None:
    """The supervisor's attempts.json, for this job's summary (None when not supervised, or this is the first
    attempt). The supervisor lists each attempt as it starts, so the last entry (no exit status yet) is this
    job: the summary lists the attempts before it. This job knows where it resumed and when its first step
    finished, so it fills in the steps lost and the downtime of the failure before it."""
    try:
        data = json.loads((run_dir / ATTEMPTS_FILE).read_text())
    except (OSError, ValueError):
        return None
    attempts = data.get("attempts") if isinstance(data, dict) else None
    if not attempts:
        return None
    relaunched_at = None
    if attempts[-1].get("status") is None:  # this job's own entry
        relaunched_at = _time(attempts.pop(), "started_at")
    if not attempts:
        return None
    last = attempts[-1]
    if last.get("steps_lost") is None:
        last["resumed_at_step"] = resumed_at_step
        if isinstance(last.get("failed_at_step"), int):
            last["steps_lost"] = max(0, last["failed_at_step"] - resumed_at_step)
    if relaunched_at is not None and last.get("downtime_s") is None:
        last["downtime_s"], last["downtime_phases"] = downtime(
            _time(last, "last_step_at"), _time(last, "ended_at"), relaunched_at, read_metrics(run_dir))
    return data
