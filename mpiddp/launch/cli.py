"""`python -m mpiddp launch`: resolve hosts, launcher and run directory, then hand over to the supervisor."""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from mpiddp.launch.command import (LAUNCHERS, NO_RECOVERY_FLAG, InJobRecovery, choose_launcher,
                                   decide_in_job_recovery, find_program, mpi_flavour, node_loss_args, ompi_info_text,
                                   users_ft_choice, version_text)
from mpiddp.launch.hosts import HostListError, discover, place
from mpiddp.launch.relay import NO_RELAYS, NO_RELAYS_FLAG, RELAYS_FLAG, decide_layout
from mpiddp.errors import EXIT_USER_ERROR, UserError
from mpiddp.launch.supervisor import STARTUP_TIMEOUT_S, Plan, Supervisor, say
from mpiddp.runname import DEFAULT_RUNS_ROOT, new_timestamped_dir

USAGE = ("python -m mpiddp launch [--hostfile FILE | -H a:8,b:8] -np N [--max-restarts 3] [--min-np M] "
         "[--host-strikes 1] [--exclude HOST,...] [--startup-timeout 600] "
         "[--launcher auto|mpirun|mpiexec|srun] [--no-in-job-recovery] [--[no-]host-crash-relays] "
         "-- TRAINING FLAGS | run SCRIPT ARGS")


class LaunchError(ValueError):
    """A launch command that cannot work: one line, exit status 2, no attempt made."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpiddp launch", usage=USAGE,
                                description="Run the job, and after a failure relaunch it without the failed host "
                                            "(spare hosts replace it), resuming from the newest snapshot.")
    p.add_argument("--hostfile", help="Open MPI (`host slots=N`) or MPICH (`host:N`) hostfile")
    p.add_argument("-H", "--host", dest="host_option", help="hosts and slots: a:8,b:8,c:8")
    p.add_argument("-np", "-n", dest="num_ranks", type=int,
                   help="ranks to run (default: every slot); hosts beyond what it needs are spares")
    p.add_argument("--max-restarts", type=int, default=3, help="relaunches after failures (default 3)")
    p.add_argument("--min-np", type=int, default=None,
                   help="with no spare host left after a failure, continue on the slots left if at least this many "
                        "ranks, at the same global batch (more accumulation steps; training only keeps it exactly)")
    p.add_argument("--host-strikes", type=int, default=1,
                   help="leave a host out on its N-th failure (default 1: at once); 2 tries it once more, "
                        "for an allocation with no spare host")
    p.add_argument("--exclude", default="", help="hosts never to use: HOST,HOST")
    p.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S, metavar="S",
                   help=f"end an attempt whose ranks have not all come through MPI's start-up S seconds after it "
                        f"started (a host's daemon or a rank stuck there), and relaunch it (default "
                        f"{STARTUP_TIMEOUT_S:g}; 0 never)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="auto",
                   help="auto: srun inside Slurm, else mpirun (Open MPI) or mpiexec (MPICH), judged by mpirun --version")
    p.add_argument("--launcher-path", help="the launcher program to run, e.g. /opt/mpich/bin/mpiexec (default: the one "
                                          "beside this python, else on PATH); an MPI's own launcher is judged by "
                                          "its --version")
    p.add_argument("--launcher-args", action="append", default=[],
                   help="extra arguments for the launcher, one string (shell-split), e.g. '--mca btl tcp,self' "
                        "or --oversubscribe (a value that starts with '-' is taken as it is)")
    p.add_argument(NO_RECOVERY_FLAG, dest="in_job_recovery", action="store_false",
                   help="do not run the job with MPI fault tolerance: a failed rank then always ends the job and "
                        "launch relaunches it. By default launch passes --with-ft ulfm to Open MPI 5's mpirun when "
                        "its ompi_info says it has ULFM, so the survivors can recover in the job (never with MPICH "
                        "or srun, which cannot; launch says why in one line)")
    p.add_argument(RELAYS_FLAG, dest="relays", action="store_true", default=None,
                   help="with in-job recovery (Open MPI 5.0, two hosts or more): run mpirun with relays on this "
                        "host so that a crashed or silent host is recovered in the job instead of relaunched. On by "
                        "default for training; a script under `run` asks for it with this flag (docs/recovery.md)")
    p.add_argument(NO_RELAYS_FLAG, dest="relays", action="store_false",
                   help="no relays: a crashed or silent host ends the job and launch relaunches without it")
    p.add_argument("--run-dir", help="where failures/ (every rank's record) and attempts.json go, and training's outputs unless its "
                                     "own --run-dir or --runs-root names another place, which launch then follows "
                                     "(default: a new directory under runs/)")
    return p


def split_job(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        if "-h" in argv or "--help" in argv:
            parser().parse_args(argv)  # prints the help and exits 0
        raise LaunchError(f"give the job after `--`: {USAGE}")
    at = argv.index("--")
    return attach_launcher_args(argv[:at]), argv[at + 1:]


def attach_launcher_args(own: list[str]) -> list[str]:
    """`--launcher-args --oversubscribe` as `--launcher-args=--oversubscribe`: its value is other flags, which
    argparse would otherwise take for one of launch's own and report "expected one argument"."""
    out, index = [], 0
    while index < len(own):
        if own[index] == "--launcher-args" and index + 1 < len(own):
            out.append(f"--launcher-args={own[index + 1]}")
            index += 2
            continue
        out.append(own[index])
        index += 1
    return out


def new_run_dir(runs_root: Path) -> Path:
    try:
        return new_timestamped_dir(runs_root)
    except UserError as exc:
        raise LaunchError(str(exc)) from None


def make_plan(argv: list[str], env: Mapping[str, str]) -> Plan:
    own, job = split_job(argv)
    args = parser().parse_args(own)
    if not job:
        raise LaunchError(f"nothing to launch after `--`: {USAGE}")
    if job[0] in ("check", "report", "launch"):
        raise LaunchError(f"launch supervises training and `run SCRIPT`, not `{job[0]}`")
    mode = "run" if job[0] == "run" else "train"
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not args.startup_timeout >= 0:  # NaN too
        raise LaunchError(f"--startup-timeout must be >= 0 seconds (0 never ends a start-up), "
                          f"got {args.startup_timeout}")
    if args.host_strikes < 1:
        raise LaunchError(f"--host-strikes must be >= 1 (1 leaves a failed host out at once), got {args.host_strikes}")
    hosts, source = discover(args.hostfile, args.host_option, env)
    excluded = [name.strip() for name in args.exclude.split(",") if name.strip()]
    free = [h for h in hosts if h.name not in excluded]
    if args.num_ranks is not None and args.num_ranks < 1:
        raise LaunchError(f"-np must be at least 1, got {args.num_ranks}")
    if hosts and not free:
        raise LaunchError(f"--exclude {args.exclude} leaves none of the {len(hosts)} hosts from {source}")
    num_ranks = args.num_ranks if args.num_ranks is not None else sum(h.slots for h in free)
    if num_ranks < 1:
        raise LaunchError("give -np N (the number of ranks): no host list to count slots from")
    if args.min_np is not None and not 1 <= args.min_np <= num_ranks:
        raise LaunchError(f"--min-np must be in [1, -np {num_ranks}], got {args.min_np}")
    if hosts:
        used, spares = place(free, num_ranks)  # fails now, not after the first failure
        say(f"hosts from {source}: {len(used)} in use, {len(spares)} spare"
            f"{', excluded ' + ','.join(excluded) if excluded else ''}")
    run_dir = writable_run_dir(args.run_dir)
    launcher, program, flavour, extra, version = pick_launcher(args, env, bool(hosts))
    recovery = in_job_recovery(args.in_job_recovery, launcher, flavour, program, version, extra, mode)
    layout = NO_RELAYS
    if hosts and recovery.on:  # recovery's own line says why it is off
        layout = decide_layout(recovery.on, launcher, flavour, version, free, socket.gethostname(), extra,
                               args.relays, mode)
        say(layout.why)
    return Plan(mode=mode, inner=job, run_dir=run_dir, num_ranks=num_ranks, hosts=hosts, excluded=excluded,
                max_restarts=args.max_restarts, launcher=launcher, program=program, flavour=flavour,
                extra=extra, min_np=args.min_np, host_strikes=args.host_strikes,
                made_run_dir=not args.run_dir, in_job_recovery=recovery, relay_layout=layout,
                node_loss_args=node_loss_args(launcher, flavour, version, extra),
                startup_timeout_s=args.startup_timeout)


def writable_run_dir(given: str | None) -> Path:
    """--run-dir, or a new one under runs/, created and written in once."""
    # Never parsed from the job's flags: the job takes this directory from the environment unless its own flags
    # name another, and then says so in its record (mpiddp.contract), which the supervisor follows.
    run_dir = Path(given) if given else new_run_dir(Path(DEFAULT_RUNS_ROOT))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"cannot create the run directory {run_dir} ({exc.strerror or exc}): "
                          f"give a writable --run-dir") from None
    try:  # launch writes its records and each attempt's output there: fail now, not as a launcher that cannot start
        tempfile.TemporaryFile(dir=run_dir).close()
    except OSError as exc:
        raise LaunchError(f"cannot write in the run directory {run_dir} ({exc.strerror or exc}): "
                          f"give a writable --run-dir") from None
    return run_dir


def pick_launcher(args: argparse.Namespace, env: Mapping[str, str],
                  has_hosts: bool) -> tuple[str, str, str, list[str], str]:
    """(launcher, the program to run, MPI flavour, extra launcher arguments, the --version it was judged by)
    from launch's flags."""
    mpirun = find_program("mpirun") or "mpirun"
    given = args.launcher_path
    if given and not Path(given).is_file():
        raise LaunchError(f"--launcher-path {given}: no such file")
    if given and not os.access(given, os.X_OK):
        raise LaunchError(f"--launcher-path {given}: not executable (give mpirun, mpiexec or srun)")
    try:
        extra = [arg for text in args.launcher_args for arg in shlex.split(text)]
    except ValueError as exc:  # an unbalanced quote
        raise LaunchError(f"--launcher-args {' '.join(args.launcher_args)!r}: {exc}") from None
    # MPICH or Open MPI: the given launcher's own word, unless it is srun (then the mpirun that belongs to this MPI)
    judged = given if given and Path(given).name != "srun" else mpirun
    version = version_text(judged)
    flavour = mpi_flavour(version)
    launcher = choose_launcher(args.launcher, env, flavour)
    if launcher == "srun" and not has_hosts:  # inside an allocation the hosts come from it: this is outside one
        raise LaunchError("--launcher srun runs inside a Slurm allocation (sbatch, salloc): none here, and no "
                          "--hostfile or -H; use --launcher mpirun, or launch from within the allocation")
    program = given or (mpirun if launcher == "mpirun" else find_program(launcher) or launcher)
    return launcher, program, flavour, extra, version


def in_job_recovery(wanted: bool, launcher: str, flavour: str, program: str, version: str,
                    extra: list[str], mode: str = "train") -> InJobRecovery:
    """Decided once per launch from the launcher it will run: its --version (`version`, judged from `program`
    unless that is srun) and its Open MPI's ompi_info; said in one line."""
    if not wanted and users_ft_choice(extra) == "ulfm":
        raise LaunchError(f"{NO_RECOVERY_FLAG} and --launcher-args --with-ft ulfm contradict each other: give one")
    info = ompi_info_text(program) if wanted and launcher != "srun" and flavour == "openmpi" else None
    recovery = decide_in_job_recovery(wanted, launcher, flavour, version, info, extra, mode)
    say(recovery.why)
    return recovery


def main(argv: list[str]) -> int:
    try:
        plan = make_plan(argv, os.environ)
    except (LaunchError, HostListError) as exc:
        sys.stderr.write(f"mpiddp launch: error: {exc}\n")
        return EXIT_USER_ERROR
    except SystemExit as exc:  # argparse: --help (0) or a bad flag of launch itself (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USER_ERROR
    return Supervisor(plan).run()
