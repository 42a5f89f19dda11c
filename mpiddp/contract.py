"""What `launch` and the job tell each other, stdlib only: the environment the supervisor sets for every attempt
(the only place these names are spelled), and the job record the job writes back into the run directory.

`launch` never parses the job's flags, as torchrun's agent never reads its script's: it says where it keeps its
records and how many times it relaunched through the environment, and learns the job's real run directory and
global batch from the record (RUN_DIR/job.json), as it learns why a job failed from the ranks' records in RUN_DIR/failures/.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from mpiddp.atomicfile import write_text_atomic

FAILURE_FILE_ENV = "MPIDDP_FAILURE_FILE"  # where the job records why it failed
RESTART_COUNT_ENV = "MPIDDP_RESTART_COUNT"  # relaunches so far: > 0 and training resumes by itself
LAUNCH_ID_ENV = "MPIDDP_LAUNCH_ID"  # one `launch`: a relaunch resumes a snapshot this launch saved, if any
RUN_DIR_ENV = "MPIDDP_RUN_DIR"  # launch's run dir: training's default, unless its --run-dir/--runs-root say else;
# `mpiddp run` marks a script's end there (FINISHED_FILE)
JOB_RECORD_ENV = "MPIDDP_JOB_RECORD"  # where the job writes its JobRecord at start-up
GLOBAL_BATCH_ENV = "MPIDDP_GLOBAL_BATCH"  # --global-batch's default: a shrunk attempt (--min-np) keeps the batch
SUPERVISOR_ENV = "MPIDDP_SUPERVISOR"  # HOST:PID of `launch`: the job records it when the supervisor died
HELPER_PARENT_ENV = "MPIDDP_HELPER_PARENT"  # set by a rank for its loader helpers: the pid they must die with
MIN_NP_ENV = "MPIDDP_MIN_NP"  # launch --min-np: in-job recovery goes on with no fewer ranks (1 when unset)
SPARE_HOSTS_ENV = "MPIDDP_SPARE_HOSTS"  # host[:slots],...: where a job that lost ranks grows back (MPI_Comm_spawn)
# N: the last N ranks of COMM_WORLD are hot spares: started with the job, they wait until a job that lost ranks
# takes them in (no MPI_Comm_spawn: mpiddp.job.spares, mpiddp.elastic.spawning)
SPARE_RANKS_ENV = "MPIDDP_SPARE_RANKS"
# "1" when launch runs the job under its relay layout (mpiddp.launch.relay): a lost host's daemon no longer ends the
# job, so the survivors may cut a silent host off and go on (mpiddp.job.silenthost); without the relays mpirun ends
# the job on such a host by itself, and launch relaunches without it
HOST_RELAYS_ENV = "MPIDDP_HOST_RELAYS"
MASTER_ADDR_ENV = "MPIDDP_MASTER_ADDR"  # --master-addr's default (set by the user, not by launch)
JOB_RECORD_FILE = "job.json"
# Written by a training job under `launch` when it ended as it should (trained, or nothing left to train): Open MPI's
# mpirun --with-ft ulfm exits 0 even when every rank was killed, so launch takes a 0 only with this file.
FINISHED_FILE = "finished"
CHECKPOINTS_FOLDER = "checkpoints"  # RUN_DIR/checkpoints: the default checkpoint dir


def default_checkpoint_dir(run_dir: Path) -> Path:
    """Where snapshots go without --checkpoint-dir (the one place that says so)."""
    return run_dir / CHECKPOINTS_FOLDER


@dataclass(frozen=True)
class JobRecord:
    """What a training job tells `launch` at start-up (global rank 0 writes it, every attempt anew)."""

    run_dir: str
    checkpoint_dir: str
    world_size: int
    global_batch: int  # samples per optimizer step: per-rank batch x ranks x accumulation
    max_per_rank_batch: int  # --batch-size as given: a shrunk attempt never goes above it

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobRecord:
        values = {f.name: data[f.name] for f in fields(cls)}
        for name in ("world_size", "global_batch", "max_per_rank_batch"):
            if not isinstance(values[name], int) or isinstance(values[name], bool) or values[name] < 1:
                raise ValueError(f"{name} is {values[name]!r}")
        return cls(**{**values, "run_dir": str(values["run_dir"]), "checkpoint_dir": str(values["checkpoint_dir"])})


def write_job_record(path: Path, record: JobRecord) -> bool:
    """Global rank 0: write the record; False (never raises) when it cannot: the record informs, it never stops."""
    try:
        write_text_atomic(path, json.dumps(asdict(record), indent=1) + "\n")
    except OSError:
        return False
    return True


def mark_finished(run_dir: Path) -> None:
    """Global rank 0: the job ended as it should (FINISHED_FILE); never raises (launch then relaunches to be sure)."""
    try:
        write_text_atomic(run_dir / FINISHED_FILE, f"{time.time()}\n")
    except OSError:
        pass


def finished_since(run_dir: Path, since: float) -> bool:
    """Whether a job in `run_dir` said it finished at or after `since` (an earlier attempt's mark does not count)."""
    try:
        return (run_dir / FINISHED_FILE).stat().st_mtime >= since
    except OSError:
        return False


def read_job_record(path: Path) -> JobRecord | None:
    """The record, or None when there is none (a job that failed before writing it, a script) or it is unreadable."""
    try:
        return JobRecord.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None
