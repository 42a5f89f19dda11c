"""One stopped rank under launch's defaults (in-job recovery, a spare host): the hung rank is ended through the
agent however the user named it, the healthy host is never blamed, and a job that ends itself leaves no
recovery record (fake hosts, real processes)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import (LAUNCHER_NEVER_STARTED, REPO, job_env, past_start_races, raced_at_start, rank_pid, rank_pids,
                      run_acting_on)
from fakehosts import SUBNET, FakeHosts, running_fake_hosts
from mpiddp import recoveries
from mpiddp.failure import FAILURES_DIR

pytestmark = pytest.mark.mpi
FAST = ("--no-progress", "--wandb", "disabled")
# the watchdog must speak before the healthy rank's gloo timeout (launch raises --collective-timeout anyway)
HANG = ("--hang-timeout", "8", "--collective-timeout", "8", "--grad-transport", "gloo")


@pytest.fixture
def hosts(tmp_path, mpirun):
    (tmp_path / "fakehosts").mkdir()
    with running_fake_hosts(FakeHosts(["nodea", "nodeb", "nodec"], tmp_path / "fakehosts")) as cluster:
        yield cluster


def stop_rank_1_and_wait(hosts, command, env, run_dir, timeout=300):
    """Run launch on nodea; once the epoch-2 snapshot is saved, SIGSTOP rank 1 (nodeb): alive and silent, as a
    wedged GPU or NFS. Returns (launch's status, its output)."""
    return run_acting_on(hosts.command_on("nodea", command), env, run_dir,
                         lambda line: "saved " in line and "snapshot-epoch0002.pt" in line,
                         lambda: os.kill(rank_pid(run_dir, 1), signal.SIGSTOP), timeout)


def attempts(run_dir):
    """The attempts, less one lost to Open MPI's start-up race (launch relaunched it: the run these tests follow)."""
    return past_start_races(run_dir)


@pytest.mark.parametrize("named", ["PRTE_MCA_plm_ssh_agent", "--prtemca plm_ssh_agent"])
def test_a_stopped_rank_is_ended_through_the_agent_as_open_mpi_5_reads_it_and_the_healthy_host_is_kept(
        hosts, tmp_path, named):
    """The agent given only the way Open MPI 5 reads it (not as plm_rsh_agent): launch ends the hung rank through
    it, the survivor recovers, and the run finishes with nodea (healthy) never left out."""
    run_dir = tmp_path / "run"
    env = job_env()
    env.pop("PRTE_MCA_rmaps_default_mapping_policy")  # slots come from -H
    transport = f"--mca btl_tcp_if_include {SUBNET}.0/24"
    if named.startswith("PRTE"):
        env[named] = str(hosts.agent)
    else:
        transport += f" {named} {hosts.agent}"
    command = [sys.executable, "-m", "mpiddp", "launch", "-H", "nodea:1,nodeb:1,nodec:1", "-np", "2",
               "--max-restarts", "2", "--launcher-args", transport, "--",
               "--run-dir", str(run_dir), "--epochs", "6", *FAST, *HANG]
    status, output = stop_rank_1_and_wait(hosts, command, env, run_dir)
    assert status == 0, output[-6000:]
    assert "ending hung rank 1 (pid " in output and f"on nodeb for in-job recovery: {hosts.agent} nodeb kill -KILL" \
        in output, output[-6000:]
    assert "cannot end it through" not in output, output[-6000:]
    every = attempts(run_dir)
    assert all("nodea" not in attempt["excluded_hosts"] for attempt in every), every
    assert "nodea" in json.loads((run_dir / "summary.json").read_text())["hosts"]
    lost = [host for item in recoveries.recorded(run_dir / FAILURES_DIR) for host in item.get("hosts_lost", [])]
    assert "nodea" not in lost, lost


def test_a_job_that_ends_itself_on_a_hang_leaves_no_recovery_record(hosts, tmp_path):
    """launch cannot end the hung rank (its agent refuses `kill`): the watchdog's fallback ends the job with
    status 4. mpirun's teardown resumes the stopped rank (SIGCONT, then SIGTERM, which training takes as a stop):
    it must not "recover" from rank 0, whose hang record decided the end; nodea is not blamed."""
    run_dir = tmp_path / "run"
    refusing = tmp_path / "refuses-kill.sh"
    refusing.write_text(f'#!/bin/sh\ncase "$*" in *"kill -KILL"*) echo "ssh: connect to host $1 port 22: '
                        f'Connection refused" >&2; exit 255;; esac\nexec {hosts.agent} "$@"\n')
    refusing.chmod(0o755)
    env = job_env(PRTE_MCA_plm_ssh_agent=str(refusing))
    env.pop("PRTE_MCA_rmaps_default_mapping_policy")
    command = [sys.executable, "-m", "mpiddp", "launch", "-H", "nodea:1,nodeb:1,nodec:1", "-np", "2",
               "--max-restarts", "0", "--launcher-args", f"--mca btl_tcp_if_include {SUBNET}.0/24", "--",
               "--run-dir", str(run_dir), "--epochs", "6", *FAST, *HANG]
    status, output = stop_rank_1_and_wait(hosts, command, env, run_dir)
    assert status == 4, output[-6000:]
    assert "(exit status 255: cannot end it through" in output, output[-6000:]
    assert recoveries.recorded(run_dir / FAILURES_DIR) == [], output[-6000:]
    (first,) = attempts(run_dir)
    assert (first["cause"], first["blamed_hosts"]) == ("hang", ["nodeb"]), first
    assert first["recoveries"] == [] and "nodea" not in first["excluded_hosts"], first


def test_a_spare_host_lost_while_its_hot_spare_waits_never_stops_the_survivors(hosts, tmp_path):
    """Under launch's defaults the spare host nodec runs a hot spare, which waits. nodec is lost whole (its MPI
    daemon too), then rank 1 (nodeb) is killed: the survivor recovers in the job, finds no live spare to grow
    back onto, says so once and trains on alone to the end. Under launch's relay layout the runtime survives the
    spare's host, so the run finishes in its first attempt, and only nodeb is held against."""
    run_dir = tmp_path / "run"
    env = job_env()
    env.pop("PRTE_MCA_rmaps_default_mapping_policy")
    command = [sys.executable, "-m", "mpiddp", "launch", "-H", "nodea:1,nodeb:1,nodec:1", "-np", "2",
               "--max-restarts", "2", "--launcher-args", " ".join(hosts.transport_args()), "--",
               "--run-dir", str(run_dir), "--epochs", "3", *FAST, "--grad-transport", "gloo",
               "--inject-fault", "stall-data:1:5"]
    for _ in range(2):  # Open MPI's start-up race can fail the first attempt before any rank ran: once more then
        process = subprocess.Popen(hosts.command_on("nodea", command), cwd=REPO, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        seen = []
        reader = threading.Thread(target=lambda: seen.extend(process.stdout), daemon=True)
        reader.start()
        deadline = time.monotonic() + 240
        while "injecting fault 'stall-data'" not in "".join(seen) and process.poll() is None and \
                time.monotonic() < deadline:
            time.sleep(0.05)  # polling the output for the stall, which comes after start-up (tens of seconds)
        if "injecting fault 'stall-data'" in "".join(seen):
            break
        process.wait(timeout=60)
        reader.join(30)
        # the stall never came: an attempt met Open MPI's start-up race (launch relaunched it, without the fault)
        tried = json.loads((run_dir / "attempts.json").read_text())["attempts"]
        raced = [a for a in tried if raced_at_start(run_dir, a)]
        assert LAUNCHER_NEVER_STARTED in "".join(seen) or raced, "".join(seen)[-4000:]
        shutil.rmtree(run_dir)
    try:
        pids = rank_pids(run_dir)
        assert sorted(pids) == [0, 1, 2], ("".join(seen)[-4000:], pids)  # two ranks and nodec's spare
        hosts.kill_host("nodec")  # the spare and its daemon
        os.kill(pids[1], signal.SIGKILL)
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(30)
    output = "".join(seen)
    assert process.returncode == 0, output[-6000:]
    # MPI has reported the spare failed by the time the survivor plans its grow, or the grow finds it at the shrink
    assert output.count("not growing back: no hot spare is left") == 1, output[-6000:]
    (attempt,) = attempts(run_dir)
    assert attempt["status"] == 0 and attempt["excluded_hosts"] == [], attempt
    assert [item["hosts_lost"] for item in attempt["recoveries"]] == [["nodeb"]], attempt
