"""Who am I in the job: world and per-host ranks from MPI (the only reader of MPI.COMM_WORLD and launcher env vars)."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from mpiddp.contract import (FAILURE_FILE_ENV, JOB_RECORD_ENV, LAUNCH_ID_ENV, RESTART_COUNT_ENV, RUN_DIR_ENV,
                             SUPERVISOR_ENV)
from mpiddp.errors import UserError


class TopologyError(UserError):
    """The MPI job is not laid out the way training needs: reported as one line on every rank."""


class LauncherMismatch(TopologyError):
    """mpi4py's MPI is not the launcher's: every process is alone in a world of one."""

    def __init__(self, message: str, launcher_rank: int) -> None:
        super().__init__(message)
        self.launcher_rank = launcher_rank


class RankRecord(NamedTuple):
    """What one rank says about itself in the start-up allgather."""

    rank: int
    hostname: str
    host_leader: int  # lowest world rank in this rank's shared-memory (per-host) communicator
    local_rank: int
    local_world_size: int


@dataclass(frozen=True)
class Topology:
    """This rank's place in the job. Computed once from MPI, then passed explicitly."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    host_index: int
    num_hosts: int
    hostname: str
    # host name -> its world ranks in local-rank order; hosts ordered by their lowest world rank
    hosts: tuple[tuple[str, tuple[int, ...]], ...]
    mpi_library: str = "unknown"
    mpi_settings: str = ""  # what mpiddp set for MPI before starting it (mpistart), '' when nothing
    restarts: int = 0  # the scheduler or `launch` restarted this job this many times (training resumes by itself)
    restarted_by: str = ""  # who made the last restart: "launch", "the scheduler" ('' when none)
    failure_file: str = ""  # the directory where `launch` reads every rank's failure record; '' for RUN_DIR/failures
    launch_id: str = ""  # which `launch` runs this job ('' when none): a relaunch prefers the snapshots it saved
    launch_run_dir: str = ""  # launch's run dir: training's default when its flags name none
    job_record: str = ""  # where training tells `launch` its run dir and global batch ('' when not supervised)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def hosts_dict(self) -> dict[str, list[int]]:
        return {name: list(ranks) for name, ranks in self.hosts}

    def host_of(self, rank: int) -> str:
        """The name of the host world rank `rank` runs on."""
        return next(name for name, ranks in self.hosts if rank in ranks)

    @property
    def mpi_description(self) -> str:
        """The MPI library, and what mpiddp set for it (for the log and `check`)."""
        if not self.mpi_settings:
            return self.mpi_library
        return f"{self.mpi_library} (mpiddp set {self.mpi_settings}; set OMPI_MCA_btl to choose the BTLs yourself)"

    @property
    def label(self) -> str:
        return f"rank {self.rank}/{self.world_size} on {self.hostname}"


def build_topology(rank: int, records: list[RankRecord], mpi_library: str = "unknown") -> Topology:
    """Turn every rank's self-description into this rank's Topology, checking the parts agree.

    Every rank runs this on the same records, so every rank raises the same error together.
    """
    assert [r.rank for r in records] == list(range(len(records))), "records must be in world-rank order"
    groups: dict[int, list[RankRecord]] = {}
    for record in records:
        groups.setdefault(record.host_leader, []).append(record)
    leaders = sorted(groups)

    names_to_leaders: dict[str, list[int]] = {}
    for leader in leaders:
        members = groups[leader]
        local_ranks = sorted(m.local_rank for m in members)
        if local_ranks != list(range(len(members))) or any(m.local_world_size != len(members) for m in members):
            raise TopologyError(
                f"MPI's per-host communicator of rank {leader} is inconsistent "
                f"(local ranks {local_ranks}, {len(members)} members): check the MPI installation"
            )
        names_to_leaders.setdefault(members[0].hostname, []).append(leader)
        other_names = {m.hostname for m in members} - {members[0].hostname}
        if other_names:
            raise TopologyError(
                f"ranks {[m.rank for m in members]} share memory according to MPI but report different host names "
                f"{sorted({m.hostname for m in members})}: give each host a distinct, stable hostname"
            )
    for name, group_leaders in names_to_leaders.items():
        if len(group_leaders) > 1:
            split = [[m.rank for m in groups[lead]] for lead in group_leaders]
            raise TopologyError(
                f"host name {name!r} appears in {len(group_leaders)} separate shared-memory groups {split}: "
                f"each group would number its ranks from local rank 0 and several ranks would share one device. "
                f"Give every host a distinct hostname, or check that MPI sees one node per host"
            )

    me = records[rank]
    hosts = tuple(
        (groups[leader][0].hostname, tuple(m.rank for m in sorted(groups[leader], key=lambda m: m.local_rank)))
        for leader in leaders
    )
    return Topology(
        rank=rank,
        world_size=len(records),
        local_rank=me.local_rank,
        local_world_size=me.local_world_size,
        host_index=leaders.index(me.host_leader),
        num_hosts=len(leaders),
        hostname=me.hostname,
        hosts=hosts,
        mpi_library=mpi_library,
    )


class LauncherInfo(NamedTuple):
    size: int
    rank: int
    variable: str
    launcher: str


# Variables a launcher sets to tell each process how many it started. Used only to detect the
# mpi4py/mpirun mismatch: MPI itself stays the source of truth for the layout.
_LAUNCHER_VARS = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI's mpirun"),
    ("PMI_SIZE", "PMI_RANK", "an MPICH/Hydra (PMI) launcher"),
    ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MVAPICH's launcher"),
    ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "Slurm's srun"),
)
# Slurm's batch and extern steps carry SLURM_STEP_* of the allocation, not of an srun launch.
_SLURM_PSEUDO_STEP_IDS = {"batch", "extern", "interactive"}


def launcher_info(env: Mapping[str, str]) -> LauncherInfo | None:
    """The process count a launcher announced in the environment, if any."""
    for size_var, rank_var, launcher in _LAUNCHER_VARS:
        if size_var not in env:
            continue
        if size_var.startswith("SLURM"):
            step = env.get("SLURM_STEP_ID", "")
            if not step.isdigit() or int(step) >= 0xFFFFFFF0 or step in _SLURM_PSEUDO_STEP_IDS:
                continue
        try:
            size, rank = int(env[size_var]), int(env.get(rank_var, "0"))
        except ValueError:
            continue
        return LauncherInfo(size, rank, size_var, launcher)
    return None


def mismatch_message(info: LauncherInfo, mpi_library: str, mpi4py_file: str, python: str) -> str:
    """What to tell a user whose mpirun does not belong to the MPI that mpi4py loaded."""
    if info.variable.startswith("SLURM"):
        plugin = "pmi2" if "MPICH" in mpi_library or "HYDRA" in mpi_library.upper() else "pmix"
        return (
            f"srun started {info.size} processes, but mpi4py sees a world of 1: srun's --mpi plugin does not "
            f"match the MPI that mpi4py ({mpi4py_file}) loaded ('{mpi_library}'). Launch with "
            f"srun --mpi={plugin} (see srun --mpi=list; pmix for Open MPI, pmi2 for MPICH), or start the job "
            f"with that MPI's own mpirun inside the allocation"
        )
    own_mpirun = Path(python).parent / "mpirun"
    use = f"{own_mpirun}" if own_mpirun.exists() else "the mpirun of the MPI that mpi4py was built against"
    return (
        f"{info.launcher} started {info.size} processes ({info.variable}={info.size}), but mpi4py sees a world of 1: "
        f"mpi4py ({mpi4py_file}) loaded '{mpi_library}', which is not the MPI of that launcher. "
        f"Launch with {use}, or rebuild mpi4py against your MPI: "
        f"MPICC=$(which mpicc) pip install --no-binary=mpi4py --force-reinstall mpi4py"
    )


def launcher_restarts(env: Mapping[str, str]) -> tuple[int, str]:
    """How many times this job was restarted, and who made the last restart: the scheduler (Slurm's requeue keeps
    the job id and counts in SLURM_RESTART_COUNT) or the supervisor (`python -m mpiddp launch` counts its
    relaunches in MPIDDP_RESTART_COUNT; inside a requeued Slurm job its count starts again at 0, so a count of its
    own means the last restart was its). (0, '') when neither restarted it."""
    slurm, launch = (int(value) if value.isdigit() else 0
                     for value in (env.get("SLURM_RESTART_COUNT", "0"), env.get(RESTART_COUNT_ENV, "0")))
    if launch > 0:
        return max(slurm, launch), "launch"
    return (slurm, "the scheduler") if slurm > 0 else (0, "")


def supervisor_settings(env: Mapping[str, str]) -> dict[str, str]:
    """What `launch` told the job through the environment (mpiddp.contract), as Topology's fields; '' when unset."""
    return {"failure_file": env.get(FAILURE_FILE_ENV, ""), "launch_id": env.get(LAUNCH_ID_ENV, ""),
            "launch_run_dir": env.get(RUN_DIR_ENV, ""), "job_record": env.get(JOB_RECORD_ENV, "")}


def supervisor_identity(env: Mapping[str, str]) -> str:
    """HOST:PID of the supervisor (`launch`) that started this job (MPIDDP_SUPERVISOR), '' when not supervised."""
    return env.get(SUPERVISOR_ENV, "")


def mpi_library_version() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()


def check_launcher(comm: Any) -> None:
    """Stop when the launcher started N processes but each of them sees a world of one."""
    from mpi4py import MPI

    info = launcher_info(os.environ)
    # COMM_WORLD's size: the job's own communicator leaves hot spares out (mpiddp.job.spares)
    if info is None or MPI.COMM_WORLD.Get_size() != 1 or info.size <= 1:
        return
    import mpi4py

    message = mismatch_message(info, mpi_library_version(), mpi4py.__file__, sys.executable)
    raise LauncherMismatch(message, launcher_rank=info.rank)


def gather_records(comm: Any) -> tuple[list[RankRecord], str]:
    """Collective: every rank's self-description, in world-rank order, and the MPI library's name."""
    from mpi4py import MPI

    local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        host_leader = local_comm.allreduce(comm.Get_rank(), op=MPI.MIN)
        record = RankRecord(
            comm.Get_rank(), socket.gethostname(), host_leader, local_comm.Get_rank(), local_comm.Get_size()
        )
    finally:
        local_comm.Free()
    return comm.allgather(record), mpi_library_version()
