"""A rank whose launcher's daemon ends without ending it ends too (mpiddp.job.orphan): in-process for the rule,
a real parent SIGKILLed for the watch (pidfd and polling alike), and real mpirun and MPICH launchers whose
daemon is SIGKILLed under ranks that are busy in Python (no MPI call would tell them)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, mpich_env
from mpiddp.job import orphan
from test_leftovers import assert_nothing_left, marked_env, processes_of

# a rank busy in Python: it arms the watch as MPI's start does, writes its pid, then runs on for a minute
BUSY_RANK = """
import os, sys, time
from pathlib import Path
if sys.argv[2] == "poll":
    del os.pidfd_open  # the fallback: a Python or kernel without pidfds
from mpiddp.job.orphan import watch_launcher_daemon
if sys.argv[2] == "mpi":
    from mpiddp.job.mpistart import init_mpi
    init_mpi()  # arms the watch, as every rank's start of MPI does
    assert watch_launcher_daemon() is None  # once per process
else:
    assert watch_launcher_daemon() is not None
Path(sys.argv[1], f"pid.{os.getpid()}").write_text(str(os.getppid()))
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    sum(range(10000))
"""

# the middle process: a daemon's stand-in that starts the rank, says its pid, then waits to be killed
DAEMON = """
import subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], stderr=open(sys.argv[4], "w"))
print(rank.pid, flush=True)
rank.wait()
"""


def test_only_a_process_a_launchers_daemon_started_is_watched():
    assert orphan.launched_by_a_daemon({"OMPI_COMM_WORLD_SIZE": "2"})
    assert orphan.launched_by_a_daemon({"PMIX_RANK": "0"})  # srun --mpi=pmix too
    assert orphan.launched_by_a_daemon({"PMI_RANK": "1"})  # MPICH's Hydra
    assert not orphan.launched_by_a_daemon({"HOME": "/root", "SLURM_JOB_ID": "4"})  # `python train.py`, nohup too
    assert orphan.watch_launcher_daemon(env={"HOME": "/root"}) is None


def wait_until_gone(pid: int, deadline_s: float = 20) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True  # ended: a zombie until init reaps it
        except (OSError, IndexError):
            return True
        time.sleep(0.05)  # polling a condition with a deadline, not synchronising
    return False


@pytest.mark.parametrize("how", ["pidfd", "poll"])
def test_a_process_whose_daemon_is_killed_ends_with_one_line(tmp_path, how):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PMIX_RANK": "0"}
    daemon = subprocess.Popen([sys.executable, "-c", DAEMON, BUSY_RANK, str(tmp_path), how, str(tmp_path / "err")],
                              env=env, stdout=subprocess.PIPE, text=True)
    rank = int(daemon.stdout.readline())
    deadline = time.monotonic() + 30
    while not (tmp_path / f"pid.{rank}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition with a deadline, not synchronising
    assert (tmp_path / f"pid.{rank}").read_text() == str(daemon.pid)  # armed, its parent the daemon
    daemon.send_signal(signal.SIGKILL)
    daemon.wait()
    ended = wait_until_gone(rank)
    if not ended:
        os.kill(rank, signal.SIGKILL)
    assert ended, "the rank ran on after its daemon was killed"
    said = (tmp_path / "err").read_text()
    assert f"launcher daemon (pid {daemon.pid}) ended without ending it: this rank (pid {rank}) ends now" in said


def busy_ranks_then_kill(command: list[str], env: dict[str, str], out: Path, daemon_name: str, mark: str) -> None:
    """Start `command` (2 busy ranks), SIGKILL every process named `daemon_name` once both ranks run, then every
    rank must end (nothing of the job left running)."""
    job = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(list(out.glob("pid.*"))) < 2 and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.1)  # polling a condition with a deadline, not synchronising
        ranks = [int(path.suffix[1:]) for path in out.glob("pid.*")]
        assert len(ranks) == 2, f"the ranks did not start (status {job.poll()})"
        daemons = {int(path.read_text()) for path in out.glob("pid.*")}
        for pid in daemons:
            assert Path(f"/proc/{pid}/comm").read_text().strip().startswith(daemon_name)
            os.kill(pid, signal.SIGKILL)
        assert all(wait_until_gone(pid) for pid in ranks), f"left running: {processes_of(mark)}"
    finally:
        job.kill()
        job.wait()
        assert_nothing_left(mark)


@pytest.mark.mpi
def test_ranks_busy_in_python_end_when_open_mpis_daemon_is_killed(mpirun, tmp_path):
    """mpirun's prterun is the parent of the ranks on its host: SIGKILLed (as prterun 5.0.11's own crash after a
    spawn ends it), the ranks would run on as orphans."""
    env, mark = marked_env(PYTHONPATH=str(REPO))
    command = [mpirun, "--with-ft", "ulfm", "-np", "2", sys.executable, "-c", BUSY_RANK, str(tmp_path), "mpi"]
    busy_ranks_then_kill(command, env, tmp_path, "prterun", mark)


@pytest.mark.mpi
def test_ranks_busy_in_python_end_when_mpichs_proxy_is_killed(mpich, tmp_path):
    env, mark = marked_env(PYTHONPATH=str(REPO), MPI4PY_LIBMPI=mpich_env(mpich)["MPI4PY_LIBMPI"])
    command = [str(mpich / "bin" / "mpiexec"), "-n", "2", sys.executable, "-c", BUSY_RANK, str(tmp_path), "mpi"]
    busy_ranks_then_kill(command, env, tmp_path, "hydra_pmi_proxy", mark)
