"""A stopped rank 0 under launch's defaults (issue 44): rank 0 holds the rendezvous store, and a stopped process
keeps its sockets open, so every request to its store waits forever. The survivors' hang watchdogs give each
request a deadline, find rank 0 after --hang-timeout, and have it ended (launch ends it: no other rank runs on
its host); the survivor recovers in the job on a new store. A SIGTERM to launch while such a hang holds the job
ends everything within the stop's grace (fake hosts, real processes)."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, past_start_races, rank_pid
from fakehosts import SUBNET, FakeHosts, running_fake_hosts
from test_leftovers import assert_nothing_left, marked_env

pytestmark = pytest.mark.mpi
FAST = ("--no-progress", "--wandb", "disabled", "--log-every", "1")
HANG_TIMEOUT_S = 10
# from the stop to the survivor's recovery: the hang timeout, two watchdog intervals (1 s each here), launch's
# look at the failures directory (0.5 s), the kill through the agent and MPI's notice, with room for 2 busy cores
RECOVERED_WITHIN_S = HANG_TIMEOUT_S + 20
STOP_GRACE_S = 5


@pytest.fixture
def hosts(tmp_path, mpirun):
    (tmp_path / "fakehosts").mkdir()
    with running_fake_hosts(FakeHosts(["nodea", "nodeb", "nodec"], tmp_path / "fakehosts")) as cluster:
        yield cluster


class Launch:
    """`launch -H nodea:1,nodeb:1,nodec:1 -np 2` started on nodea, its output lines timed as they come."""

    def __init__(self, hosts, run_dir, job, env):
        command = [sys.executable, "-m", "mpiddp", "launch", "-H", "nodea:1,nodeb:1,nodec:1", "-np", "2",
                   "--max-restarts", "1", "--launcher-args", f"--mca btl_tcp_if_include {SUBNET}.0/24", "--",
                   "--run-dir", str(run_dir), *FAST, *job]
        self.process = subprocess.Popen(hosts.command_on("nodea", command), cwd=REPO, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            with self.changed:
                self.lines.append((time.monotonic(), line))
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, text, timeout):
        """When the first line with `text` came (None: not within `timeout`, or launch ended first)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                found = next((at for at, line in self.lines if text in line), None)
                if found is not None or (self.process.poll() is not None and not self.reader.is_alive()):
                    return found
                if not self.changed.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    return None

    @property
    def output(self):
        return "".join(line for _, line in self.lines)


def attempts(run_dir):
    """The attempts, less one lost to Open MPI's start-up race (launch relaunched it: the run these tests follow)."""
    return past_start_races(run_dir)


def test_a_stopped_rank_0_is_ended_and_the_survivor_recovers_in_the_job_on_a_new_store(hosts, tmp_path):
    """The MPI gradient transport (the main thread waits in MPI_Allreduce, the case that hung 7.5 min): rank 0 is
    SIGSTOPped after the first epoch; within the hang timeout plus a bound launch ends it, the survivor on nodeb
    recovers in the same attempt (cause "hang", rank 0 on nodea lost) and the run finishes."""
    run_dir = tmp_path / "run"
    env, mark = marked_env(PRTE_MCA_plm_ssh_agent=str(hosts.agent))
    env.pop("PRTE_MCA_rmaps_default_mapping_policy")  # slots come from -H
    # 10 epochs: the stop lands 9 epochs before the end (test_drill's 2b saw a busy CI machine read a line 2 epochs
    # late), and the survivor trains those 9 after its recovery
    launch = Launch(hosts, run_dir, ("--epochs", "10", "--hang-timeout", str(HANG_TIMEOUT_S), "--grad-transport",
                                     "mpi"), env)
    try:
        assert launch.wait_for("snapshot-epoch0001.pt", 240) is not None, launch.output[-6000:]
        pid = rank_pid(run_dir, 0)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        recovered = launch.wait_for("in-job recovery: ranks [0] of 2 failed", RECOVERED_WITHIN_S + 30)
        assert recovered is not None, launch.output[-6000:]
        launch.process.wait(timeout=240)
    finally:
        if launch.process.poll() is None:
            launch.process.kill()
        assert_nothing_left(mark)
    launch.reader.join(30)
    output = launch.output
    print(f"SIGSTOP of rank 0 -> the survivor's recovery: {recovered - stopped:.1f} s")
    assert recovered - stopped < RECOVERED_WITHIN_S, (recovered - stopped, output[-6000:])
    assert f"ending hung rank 0 (pid {pid}) on nodea for in-job recovery" in output, output[-6000:]
    assert launch.process.returncode == 0, output[-6000:]
    (hang_file,) = run_dir.glob("hang-*.txt")
    assert "ranks behind: 0 on nodea" in hang_file.read_text()
    (attempt,) = attempts(run_dir)
    recovery = attempt["recoveries"][0]
    assert (recovery["cause"], recovery["ranks_lost"], recovery["hosts_lost"]) == ("hang", [0], ["nodea"]), attempt
    # its downtime holds the hang timeout and the bound, never the length of a hang nothing ended
    assert recovery["phases"]["detect"] < RECOVERED_WITHIN_S + 5, recovery


def test_sigterm_to_launch_while_rank_0_is_stopped_ends_everything_within_the_grace(hosts, tmp_path):
    """Rank 0 stopped, its hang not yet due (--hang-timeout 60): SIGTERM to launch asks the ranks for a snapshot,
    which the survivor cannot take without rank 0; once the stop's grace ran out launch ends the job whole, with
    nothing of it left on any host and no "recovery" recorded from its own kill."""
    run_dir = tmp_path / "run"
    env, mark = marked_env(PRTE_MCA_plm_ssh_agent=str(hosts.agent), MPIDDP_STOP_GRACE_S=str(STOP_GRACE_S))
    env.pop("PRTE_MCA_rmaps_default_mapping_policy")
    launch = Launch(hosts, run_dir, ("--epochs", "30", "--hang-timeout", "60"), env)
    try:
        assert launch.wait_for("snapshot-epoch0001.pt", 240) is not None, launch.output[-6000:]
        os.kill(rank_pid(run_dir, 0), signal.SIGSTOP)
        launch.process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        launch.process.wait(timeout=STOP_GRACE_S + 40)
        ended = time.monotonic()
    finally:
        if launch.process.poll() is None:
            launch.process.kill()
        assert_nothing_left(mark)  # the stopped rank 0 and the survivor on nodeb too
    launch.reader.join(30)
    output = launch.output
    print(f"SIGTERM -> launch's end: {ended - sent:.1f} s")
    assert f"the job still runs {STOP_GRACE_S} s after the stop" in output, output[-6000:]
    (attempt,) = attempts(run_dir)
    assert attempt["recoveries"] == [] and "stopped by SIGTERM" in attempt["decision"], attempt
