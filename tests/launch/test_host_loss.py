"""A host that crashes under `launch` (every process on it SIGKILLed, its Open MPI daemon too): with the relay
layout (mpiddp.launch.relay) the survivors recover in the job, as from a lost rank, and the job finishes without a
restart; launch then ends the mpirun that waits for the dead host's ranks.
The host is killed after step 2, in training's steady state: the stand-still measured is a usual recovery's."""

import json
import os
import subprocess
import time

import pytest
from conftest import REPO, hold_survivors_while_the_spare_warms, rank_pids
from fakehosts import FakeHosts, running_fake_hosts
from test_drill import drill_env
from test_launch_e2e import FAST, attempts, describe_attempts, launch_command
from test_leftovers import assert_nothing_left
from test_node_loss import go_silent, power_off

from mpiddp.failure import read_metrics

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, mpirun):
    with running_fake_hosts(FakeHosts(["nodea", "nodeb", "nodec", "noded"], tmp_path_factory.mktemp("crash-hosts"),
                                      tag="h")) as hosts:
        yield hosts


def recovery_records(run_dir):
    path = run_dir / "failures" / "recoveries.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def last_step(run_dir):
    return max((r["step"] for r in read_metrics(run_dir) if r.get("kind") != "start"), default=-1)


def wait_for(condition, seconds, process):
    """Poll `condition` with a generous deadline (not synchronisation: the test fails if it never holds)."""
    deadline = time.monotonic() + seconds
    while not condition() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return condition()


@pytest.mark.parametrize("hosts, num_ranks, relays, grown", [
    ("nodea:1,nodeb:1,nodec:1", 3, "2 relays on this host carry 2 hosts", None),
    ("nodea:2,nodeb:2,nodec:2", 6, "2 relays on this host carry 2 hosts", None),
    ("nodea:1,nodeb:1,nodec:1,noded:1", 3, "2 relays on this host carry 3 hosts", "noded"),
], ids=["3-hosts", "3-hosts-2-ranks-each", "4-hosts-spare"])
def test_a_crashed_host_costs_an_in_job_recovery_not_a_restart(cluster, tmp_path, hosts, num_ranks, relays, grown):
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    job = ("--run-dir", str(run_dir), "--epochs", "4", *FAST, "--log-every", "1")
    command = launch_command("-H", hosts, "-np", str(num_ranks), "--launcher", "mpirun", "--launcher-args",
                             " ".join(cluster.transport_args()), "--run-dir", str(run_dir),
                             "--", *job)
    per_host = int(hosts.split(",")[0].split(":")[1])
    env, mark = drill_env()
    with log.open("w") as out:
        process = subprocess.Popen(cluster.command_on("nodea", command), cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=out)
    try:
        spares = per_host if grown else 0  # the spare host's slots run hot spares, the last ranks (launch)
        assert wait_for(lambda: len(rank_pids(run_dir)) == num_ranks + spares and last_step(run_dir) >= 2, 180,
                        process), log.read_text()[-4000:]
        lost_ranks = list(range(per_host, 2 * per_host))  # nodeb's (--map-by slot)
        survivors = {rank: pid for rank, pid in rank_pids(run_dir).items()
                     if rank not in lost_ranks and rank < num_ranks}
        assert cluster.kill_host("nodeb") > 0
        if grown:  # held while the spare warms up, so that it joins before the end however fast this trains
            hold_survivors_while_the_spare_warms(log.read_text, survivors.values(),
                                                 ended=lambda: process.poll() is not None)
        assert wait_for(lambda: recovery_records(run_dir), 120, process), log.read_text()[-5000:]
        for pid in survivors.values():  # the survivors went on in the job: the same processes
            os.kill(pid, 0)
        process.wait(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
        assert_nothing_left(mark)
    output = log.read_text()
    assert f"relay layout is on: {relays}" in output, output[-3000:]
    assert process.returncode == 0, output[-5000:]
    tried = attempts(run_dir)["attempts"]
    attempt = tried[0]
    (lost,) = [r for r in attempt["recoveries"] if r.get("cause") != "grew"]
    assert lost["hosts_lost"] == ["nodeb"] and lost["ranks_lost"] == lost_ranks, lost
    assert len(tried) == 1, describe_attempts(run_dir, tried)  # no restart, and no spawn for the launcher to crash in
    grew = [r for r in attempt["recoveries"] if r.get("cause") == "grew"]
    assert [r["hosts_added"] for r in grew] == ([[grown]] if grown else []), attempt["recoveries"]
    assert recovery_records(run_dir)[0]["hosts_lost"] == ["nodeb"]
    # mpirun either waits for nodeb's ranks (launch ends it 5 s after the mark, from the job's records) or exits
    # by itself after the mark (seen: 1, 134): never the 60 s wait of a launcher that lingers for no known reason
    assert "s after the job marked its end: ending it" not in output, output[-3000:]
    print(f"host crash -> survivors' next step: {sum(v for v in lost['phases'].values() if v):.3f} s {lost['phases']}")


def test_a_silent_host_is_cut_off_by_the_survivors_and_costs_an_in_job_recovery(cluster, tmp_path):
    """Every process of nodeb stopped and its link down (power lost, kernel hung): nothing closes a connection.
    Rank 0's hang watchdog sees nodeb's rank stop reporting and nodeb answer no connection, and every survivor cuts
    its connections to it: MPI declares the rank failed, and the survivors go on in the job, long before the
    --hang-timeout (600 s here) or TCP's own minutes."""
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    job = ("--run-dir", str(run_dir), "--epochs", "4", *FAST, "--log-every", "1")
    command = launch_command("-H", "nodea:1,nodeb:1,nodec:1", "-np", "3", "--launcher", "mpirun", "--launcher-args",
                             " ".join(cluster.transport_args()), "--run-dir", str(run_dir),
                             "--", *job)
    env, mark = drill_env()
    with log.open("w") as out:
        process = subprocess.Popen(cluster.command_on("nodea", command), cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=out)
    stopped = []
    try:
        assert wait_for(lambda: len(rank_pids(run_dir)) == 3 and last_step(run_dir) >= 2, 180, process), \
            log.read_text()[-4000:]
        survivors = {rank: pid for rank, pid in rank_pids(run_dir).items() if rank != 1}
        stopped = go_silent(cluster, "nodeb")
        assert wait_for(lambda: recovery_records(run_dir), 120, process), log.read_text()[-5000:]
        for pid in survivors.values():  # the same processes went on
            os.kill(pid, 0)
        process.wait(timeout=240)
    finally:
        power_off(cluster, "nodeb", stopped)
        if process.poll() is None:
            process.kill()
        assert_nothing_left(mark)
    output = log.read_text()
    assert process.returncode == 0, output[-5000:]
    assert "host nodeb (ranks 1) went silent: no report for 10 s and no answer at 10.77.0.2" in output, output[-4000:]
    (attempt,) = attempts(run_dir)["attempts"]  # no restart
    (lost,) = attempt["recoveries"]
    assert (lost["cause"], lost["hosts_lost"], lost["ranks_lost"]) == ("silent_host", ["nodeb"], [1]), lost
    print(f"silent host -> survivors' next step: {sum(v for v in lost['phases'].values() if v):.3f} s {lost['phases']}")
