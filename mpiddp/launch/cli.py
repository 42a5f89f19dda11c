"""`python -m mpiddp launch`: resolve hosts, launcher and run directory, then hand over to the supervisor."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from mpiddp.launch.command import LAUNCHERS, choose_launcher, find_program, mpi_flavour, version_text
from mpiddp.launch.hosts import HostListError, discover, place
from mpiddp.errors import UserError
from mpiddp.launch.supervisor import Plan, Supervisor, say
from mpiddp.runname import new_timestamped_dir

EXIT_USER_ERROR = 2
USAGE = ("python -m mpiddp launch [--hostfile FILE | -H a:8,b:8] -np N [--max-restarts 3] [--min-np M] "
         "[--host-strikes 1] [--exclude HOST,...] "
         "[--launcher auto|mpirun|mpiexec|srun] -- TRAINING FLAGS | run SCRIPT ARGS")


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
    p.add_argument("--launcher", choices=LAUNCHERS, default="auto",
                   help="auto: srun inside Slurm, else mpirun (Open MPI) or mpiexec (MPICH), judged by mpirun --version")
    p.add_argument("--launcher-path", help="the launcher program to run, e.g. /opt/mpich/bin/mpiexec (default: the one "
                                          "beside this python, else on PATH); an MPI's own launcher is judged by "
                                          "its --version")
    p.add_argument("--launcher-args", action="append", default=[],
                   help="extra arguments for the launcher, one string (shell-split), e.g. '--mca btl tcp,self'")
    p.add_argument("--run-dir", help="where failures/ (every rank's record) and attempts.json go (training: its --run-dir; "
                                     "default: a new directory under runs/)")
    return p


def split_job(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        if "-h" in argv or "--help" in argv:
            parser().parse_args(argv)  # prints the help and exits 0
        raise LaunchError(f"give the job after `--`: {USAGE}")
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def option_value(argv: list[str], name: str) -> str | None:
    for index, arg in enumerate(argv):
        if arg == name and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def new_run_dir(runs_root: Path) -> Path:
    try:
        return new_timestamped_dir(runs_root)
    except UserError as exc:
        raise LaunchError(str(exc)) from None


def job_global_batch(job: list[str], num_ranks: int) -> tuple[int, int] | None:
    """(samples per optimizer step, largest per-rank batch) of training flags `job` on `num_ranks` ranks; None when
    the flags do not parse (the first attempt says why, as a user error)."""
    from mpiddp.trainer.config import HelpRequested, parse_args  # standard library only: no torch, no MPI

    try:
        cfg = parse_args(job[1:] if job[:1] == ["train"] else job)
    except (ValueError, HelpRequested):  # a ConfigError or --help: the job reports them itself
        return None
    return cfg.global_batch or cfg.batch_size * num_ranks * cfg.grad_accum, cfg.batch_size


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
    if args.host_strikes < 1:
        raise LaunchError(f"--host-strikes must be >= 1 (1 leaves a failed host out at once), got {args.host_strikes}")
    hosts, source = discover(args.hostfile, args.host_option, env)
    excluded = [name.strip() for name in args.exclude.split(",") if name.strip()]
    free = [h for h in hosts if h.name not in excluded]
    num_ranks = args.num_ranks if args.num_ranks is not None else sum(h.slots for h in free)
    if num_ranks < 1:
        raise LaunchError("give -np N (the number of ranks): no host list to count slots from")
    if args.min_np is not None and not 1 <= args.min_np <= num_ranks:
        raise LaunchError(f"--min-np must be in [1, -np {num_ranks}], got {args.min_np}")
    if hosts:
        used, spares = place(free, num_ranks)  # fails now, not after the first failure
        say(f"hosts from {source}: {len(used)} in use, {len(spares)} spare"
            f"{', excluded ' + ','.join(excluded) if excluded else ''}")
    inner_dir = option_value(job, "--run-dir") if mode == "train" else None
    if args.run_dir and inner_dir and Path(args.run_dir).resolve() != Path(inner_dir).resolve():
        raise LaunchError(f"--run-dir {args.run_dir} (launch) and --run-dir {inner_dir} (training) differ: give one")
    run_dir = Path(inner_dir or args.run_dir or new_run_dir(Path(option_value(job, "--runs-root") or "runs")))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"cannot create the run directory {run_dir} ({exc.strerror or exc}): "
                          f"give a writable --run-dir") from None
    if mode == "train" and inner_dir is None:
        job = [*job, "--run-dir", str(run_dir)]  # every attempt writes to, and resumes from, the same place
    global_batch = job_global_batch(job, num_ranks) if mode == "train" and args.min_np is not None else None
    if global_batch is not None and option_value(job, "--global-batch") is None:
        job = [*job, "--global-batch", str(global_batch[0])]  # a shrunk attempt keeps it: the job derives --grad-accum
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
    flavour = mpi_flavour(version_text(judged))
    launcher = choose_launcher(args.launcher, env, flavour)
    program = given or (mpirun if launcher == "mpirun" else find_program(launcher) or launcher)
    return Plan(mode=mode, inner=job, run_dir=run_dir, num_ranks=num_ranks, hosts=hosts, excluded=excluded,
                max_restarts=args.max_restarts, launcher=launcher, program=program, flavour=flavour,
                extra=extra, min_np=args.min_np,
                global_batch=global_batch, host_strikes=args.host_strikes)


def main(argv: list[str]) -> int:
    try:
        plan = make_plan(argv, os.environ)
    except (LaunchError, HostListError) as exc:
        sys.stderr.write(f"mpiddp launch: error: {exc}\n")
        return EXIT_USER_ERROR
    except SystemExit as exc:  # argparse: --help (0) or a bad flag of launch itself (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USER_ERROR
    return Supervisor(plan).run()
