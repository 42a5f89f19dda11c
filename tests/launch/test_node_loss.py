"""A host that goes silent under `launch` without the relay layout: its processes stopped and its network down at
once, as when a node loses power or its kernel hangs (no process exits, no connection is closed). Open MPI 5
notices only when the TCP connection to the host's daemon fails; launch asks mpirun to probe it
(command.NODE_LOSS_ARGS), so the attempt ends in seconds, not in the 8 minutes of the defaults (or the 10 of
--hang-timeout), and launch goes on without the host. With the relays (training's default) the survivors cut the
host off and go on in the job instead: test_host_loss.py."""

import json
import os
import signal
import subprocess

import pytest

from fakehosts import FakeHosts, running_fake_hosts
from test_drill import SPARE_USED, start_on
from test_launch_e2e import FAST, attempts
from test_leftovers import assert_nothing_left

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, mpirun):
    with running_fake_hosts(FakeHosts(["nodea", "nodeb", "nodec"], tmp_path_factory.mktemp("silent-hosts"),
                                      tag="q")) as hosts:
        yield hosts


def go_silent(cluster, name):
    """Every process on host `name` stopped, then its link down; the stopped pids."""
    netns = cluster.prefix + name
    pids = [int(pid) for pid in subprocess.run(["ip", "netns", "pids", netns], capture_output=True,
                                                  text=True).stdout.split()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "set", "eth0", "down"], check=True)
    return pids


def power_off(cluster, name, pids):
    """The silent host's processes end (as on a host that never comes back) and its link is up for the next test."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "exec", cluster.prefix + name, "ip", "link", "set", "eth0", "up"], check=True)


def test_a_host_gone_silent_ends_the_attempt_in_seconds_and_launch_finishes_without_it(cluster, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    # --hang-timeout 600 (the default): only mpirun's probe of the silent daemon can end the attempt in time
    job = ("--run-dir", str(run_dir), "--epochs", "4", *FAST, "--log-every", "1")
    # without the relay layout (its default for training, where the survivors cut a silent host off in the job:
    # test_host_loss.py): the path of a script under `run`, and of --no-host-crash-relays
    process, mark = start_on(cluster, job, log, launch=("--no-host-crash-relays",))
    silent = go_silent(cluster, "nodeb")
    try:
        process.wait(timeout=240)
    finally:
        power_off(cluster, "nodeb", silent)
        if process.poll() is None:
            process.kill()
        assert_nothing_left(mark)
    output = log.read_text()
    record = attempts(run_dir)
    assert process.returncode == 0, output[-5000:]
    first, second = record["attempts"]  # no attempt wasted on the same hosts
    assert (first["cause"], first["failed_hosts"], first["blamed_hosts"]) == ("unreachable", ["nodeb"], ["nodeb"]), first
    assert "lost nodeb while the job ran" in first["message"] and "without nodeb" in first["decision"], first
    assert record["excluded_hosts"] == ["nodeb"]
    assert (second["hosts"], second["status"]) == (["nodea", "nodec"], 0)
    assert json.loads((run_dir / "summary.json").read_text())["hosts"] == SPARE_USED
