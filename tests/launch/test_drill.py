"""The drill: ONE cluster of three fake hosts (nodea, nodeb, nodec, one slot each) and on it, one after the other,
the failures a run nobody watches meets, each under `python -m mpiddp launch -np 2` (nodec is the spare). Each ends
in the right decision (the culprit named, healthy hosts kept, user errors not retried), and after each nothing of
the job is left running on any host (every process of the job carries an environment mark of its own).

The tests run in file order and share the cluster: it is the mix on one cluster that is drilled; the single cases
have their own tests in test_launch_e2e.py and test_leftovers.py, whose helpers these use."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, JobResult, hold_survivors_while_the_spare_warms, rank_pid, run_command
from fakehosts import FakeHosts, running_fake_hosts
from test_launch_e2e import FAST, attempts, launch_command, refusing_transport
from test_leftovers import _trained, assert_nothing_left, data_dir, kill_supervisor_and_wait, marked_env  # noqa: F401

pytestmark = pytest.mark.mpi
HOSTS = "nodea:1,nodeb:1,nodec:1"
SPARE_USED = {"nodea": [0], "nodec": [1]}  # nodeb left out, nodea kept, the spare nodec in its place


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, mpirun):
    with running_fake_hosts(FakeHosts(["nodea", "nodeb", "nodec"], tmp_path_factory.mktemp("drill-hosts"),
                                      tag="d")) as hosts:
        yield hosts


def drill_env():
    """The job's environment with its own mark (and the mark): slots come from -H, not oversubscription."""
    env, mark = marked_env()
    env.pop("PRTE_MCA_rmaps_default_mapping_policy")
    return env, mark


def on_cluster(cluster, job, launch=(), transport=None):
    """`launch -H nodea:1,nodeb:1,nodec:1 -np 2 [launch...] -- job...`, started on nodea."""
    command = launch_command("-H", HOSTS, "-np", "2", "--launcher", "mpirun", "--launcher-args",
                             transport or " ".join(cluster.transport_args()), *launch, "--", *job)
    return cluster.command_on("nodea", command)


def launch_on(cluster, run_dir, job, launch=(), transport=None):
    """Run it to its end; then nothing of it may be left running."""
    env, mark = drill_env()
    try:
        return run_command(on_cluster(cluster, job, launch, transport), run_dir, timeout=300, env=env)
    finally:
        assert_nothing_left(mark)


def start_on(cluster, job, log, launch=()):
    """Start the launch in the background, its output to `log` (a file: nobody need read it as it comes);
    (the supervisor's process, the job's mark) once training made progress (a generous deadline)."""
    env, mark = drill_env()
    with log.open("w") as out:
        process = subprocess.Popen(on_cluster(cluster, job, launch), cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=out)
    run_dir = Path(job[job.index("--run-dir") + 1])
    deadline = time.monotonic() + 180
    while not _trained(run_dir) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # polling a condition with a deadline, not synchronising
    if process.poll() is not None or not _trained(run_dir):
        process.kill()
        assert_nothing_left(mark)
        pytest.fail(f"no training progress while running: {log.read_text()[-4000:]}")
    return process, mark


def assert_nodeb_replaced_by_the_spare(run_dir, job, cause):
    record = attempts(run_dir)
    assert job.returncode == 0, job.output[-5000:]
    first, second = record["attempts"]
    assert (first["cause"], first["failed_ranks"], first["failed_hosts"]) == (cause, [1], ["nodeb"]), first
    assert first["blamed_hosts"] == ["nodeb"] and "without nodeb" in first["decision"], first
    assert record["excluded_hosts"] == ["nodeb"]
    assert (second["hosts"], second["status"]) == (["nodea", "nodec"], 0)
    assert json.loads((run_dir / "summary.json").read_text())["hosts"] == SPARE_USED


def test_1_a_rank_killed_with_loader_workers_is_left_behind_and_the_survivor_finishes_in_the_job(
        cluster, tmp_path, data_dir):  # noqa: F811
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    # 160 images, 16 per rank: 5 steps per epoch; rank 1 (nodeb) dies by SIGKILL at step 3 with 2 workers alive.
    # launch runs the job with MPI fault tolerance (this Open MPI has ULFM): the survivor goes on in the job, at
    # the same global batch, its loader workers re-made for one rank, and nothing of nodeb's rank is left; then
    # the job grows back onto the spare nodec, whose new rank (with loader workers of its own) ends with the job.
    # The survivor is held while the new rank warms up, so that it joins before the end however fast this trains.
    job = ("--run-dir", str(run_dir), "--dataset", "cifar10", "--data-dir", str(data_dir), "--arch", "digits_cnn",
           "--num-classes", "10", "--batch-size", "16", "--num-workers", "2", "--epochs", "8", *FAST,
           "--inject-fault", "kill:1:3")
    process, mark = start_on(cluster, job, log)
    try:
        hold_survivors_while_the_spare_warms(log.read_text, [rank_pid(run_dir, 0)],
                                             ended=lambda: process.poll() is not None)
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
        assert_nothing_left(mark)
    assert process.returncode == 0, log.read_text()[-5000:]
    tried = attempts(run_dir)["attempts"]
    (attempt,) = tried  # nodec's hot spare joined: no spawn for the launcher to crash in, no relaunch
    assert attempt["in_job_recovery"] and attempt["status"] == 0, attempt
    recovery, grew = attempt["recoveries"]
    assert (recovery["ranks_lost"], recovery["hosts_lost"], recovery["world_after"]) == ([1], ["nodeb"], 1), recovery
    assert (grew["cause"], grew["hosts_added"], grew["world_after"]) == ("grew", ["nodec"], 2), grew
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["hosts"] == SPARE_USED, summary  # the survivor, and the spare grown onto


def test_1b_the_same_without_in_job_recovery_is_relaunched_on_the_spare(cluster, tmp_path, data_dir):  # noqa: F811
    run_dir = tmp_path / "run"
    job = launch_on(cluster, run_dir, ("--run-dir", str(run_dir), "--dataset", "cifar10", "--data-dir", str(data_dir),
                                       "--arch", "digits_cnn", "--num-classes", "10", "--batch-size", "16",
                                       "--num-workers", "2", "--epochs", "2", *FAST, "--inject-fault", "kill:1:3"),
                    launch=("--no-in-job-recovery",))
    assert_nodeb_replaced_by_the_spare(run_dir, job, "killed")


def test_2_a_stopped_rank_is_named_by_the_hang_and_its_host_left_out(cluster, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    job = ("--run-dir", str(run_dir), "--epochs", "3", *FAST, "--log-every", "1", "--hang-timeout", "8",
           "--collective-timeout", "8")  # the healthy rank's gloo timeout must not speak first
    process, mark = start_on(cluster, job, log, launch=("--no-in-job-recovery",))  # in the job: test_2b
    try:
        os.kill(rank_pid(run_dir, 1), signal.SIGSTOP)  # rank 1, on nodeb: alive but silent, as a wedged GPU or NFS
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
        assert_nothing_left(mark)  # the stopped rank too
    assert_nodeb_replaced_by_the_spare(run_dir, JobResult(process.returncode, log.read_text(), 0, run_dir), "hang")
    (hang_file,) = run_dir.glob("hang-*.txt")
    assert "ranks behind: 1 on nodeb" in hang_file.read_text()


def test_2b_under_in_job_recovery_launch_ends_the_stopped_rank_and_the_survivor_finishes(cluster, tmp_path):
    """The same stop with in-job recovery (launch's default here): the hang file names rank 1, and since no other
    rank runs on nodeb, the job asks launch, which ends it (SIGKILL through the agent it reaches hosts with);
    MPI declares it failed and the survivor on nodea finishes in the same attempt, the recovery's cause a hang."""
    from mpiddp.failure import read_metrics

    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    # 8 epochs: at 3 a loaded CI machine saw step 10 only as the training ended, and the stop fell in its teardown
    job = ("--run-dir", str(run_dir), "--epochs", "8", *FAST, "--log-every", "1", "--hang-timeout", "8")
    process, mark = start_on(cluster, job, log)
    try:
        deadline = time.monotonic() + 120
        while not any(r.get("step", 0) >= 10 for r in read_metrics(run_dir) if r.get("kind") == "step") \
                and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # polling with a deadline: the watchdogs have reported their pids by step 10
        pid, survivor = rank_pid(run_dir, 1), rank_pid(run_dir, 0)
        os.kill(pid, signal.SIGSTOP)  # rank 1, on nodeb: alive but silent
        hold_survivors_while_the_spare_warms(log.read_text, [survivor], ended=lambda: process.poll() is not None)
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
        assert_nothing_left(mark)  # the stopped rank too
    output = log.read_text()
    assert process.returncode == 0, output[-5000:]
    assert f"ending hung rank 1 (pid {pid}) on nodeb for in-job recovery" in output, output[-5000:]
    (hang_file,) = run_dir.glob("hang-*.txt")
    assert "ranks behind: 1 on nodeb" in hang_file.read_text()
    tried = attempts(run_dir)["attempts"]
    (attempt,) = tried
    assert attempt["in_job_recovery"] and attempt["status"] == 0, attempt
    recovery, grew = attempt["recoveries"]  # then back onto the spare
    assert (recovery["cause"], recovery["ranks_lost"], recovery["hosts_lost"], recovery["world_after"]) == \
        ("hang", [1], ["nodeb"], 1), recovery
    assert (grew["cause"], grew["hosts_added"], grew["world_after"]) == ("grew", ["nodec"], 2), grew


def test_3_every_rank_raising_blames_no_host(cluster, tmp_path):
    run_dir = tmp_path / "run"
    # --max-restarts 2: two attempts that ran, or more, even when Open MPI's launcher fails once before starting
    # any rank (conftest.LAUNCHER_NEVER_STARTED: that attempt spends a restart, and attempts() leaves it out)
    job = launch_on(cluster, run_dir, ("--run-dir", str(run_dir), "--epochs", "1", *FAST,
                                       "--inject-fault", "raise:all:3"), launch=("--max-restarts", "2"))
    assert job.returncode != 0, job.output[-5000:]
    record = attempts(run_dir)
    assert record["excluded_hosts"] == [], job.output[-5000:]
    first, *_, last = record["attempts"]
    assert all(a["hosts"] == ["nodea", "nodeb"] for a in record["attempts"])  # no host failed: no spare needed
    assert (first["cause"], first["failed_hosts"], first["blamed_hosts"]) == ("exception", [], []), first
    assert first["ranks_recorded"] == 2 and "no host to blame" in first["decision"]
    assert "--max-restarts 2 spent" in last["decision"] and "relaunching without" not in job.output


def test_4_a_scripts_own_error_on_every_rank_is_one_attempt_and_exit_2(cluster, tmp_path):
    script = tmp_path / "badargs.py"
    script.write_text("import argparse\nargparse.ArgumentParser().parse_args()\nprint('never here')\n")
    run_dir = tmp_path / "launch"
    job = launch_on(cluster, run_dir, ("run", str(script), "--bogus"), launch=("--run-dir", str(run_dir)))
    assert job.returncode == 2 and "never here" not in job.output, job.output[-5000:]
    (attempt,) = attempts(run_dir)["attempts"]  # argparse fails alike on every relaunch: not retried
    assert (attempt["cause"], attempt["failed_hosts"], attempt["ranks_recorded"]) == ("user_error", [], 2), attempt
    assert attempt["excluded_hosts"] == [] and "fix it and launch again" in attempt["decision"]


def test_5_an_unreachable_host_is_left_out_for_the_spare(cluster, tmp_path):
    run_dir = tmp_path / "run"
    transport = refusing_transport(cluster, tmp_path / "refusing-agent.sh", "nodeb")
    job = launch_on(cluster, run_dir, ("--run-dir", str(run_dir), "--epochs", "1", *FAST), transport=transport)
    assert job.returncode == 0, job.output[-5000:]
    record = attempts(run_dir)
    first, second = record["attempts"]
    assert (first["cause"], first["failed_hosts"], first["cause_source"]) == ("unreachable", ["nodeb"],
                                                                             "launcher output"), first
    assert "without nodeb" in first["decision"] and record["excluded_hosts"] == ["nodeb"]
    assert (second["hosts"], second["status"]) == (["nodea", "nodec"], 0)
    assert json.loads((run_dir / "summary.json").read_text())["hosts"] == SPARE_USED


def test_6_a_killed_supervisor_stops_the_job_with_a_snapshot_and_the_same_command_resumes(cluster, tmp_path):
    from mpiddp import failure

    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    job = ("--run-dir", str(run_dir), "--epochs", "3", *FAST, "--log-every", "1")
    supervisor, mark = start_on(cluster, job, log)
    kill_supervisor_and_wait(supervisor, mark)  # command_on's wrappers exec: this is launch itself, on nodea
    stopped = [r for r in failure.read_all(run_dir / failure.FAILURES_DIR) if "supervisor" in r.message]
    assert len(stopped) == 1, (stopped, log.read_text()[-4000:])
    found = stopped[0]
    assert (found.kind, found.status) == ("stopped", 3) and "rerun the same launch command" in found.message.lower()
    last = attempts(run_dir)["attempts"][-1]
    assert last["status"] == 3 and "supervisor died" in last["decision"], last
    assert last["failed_at_step"] == found.step
    assert (run_dir / "checkpoints" / "latest").read_text().strip(), "no snapshot"
    again = launch_on(cluster, run_dir, job)  # the very same launch command
    assert again.returncode == 0, again.output[-5000:]
    assert again.summary["resumed_from"] and again.summary["epochs"] == 3, again.output[-5000:]
    starts = [r for r in again.metrics if r["kind"] == "start"]
    assert starts[-1]["step"] == found.step, starts  # resumed where the supervisor's death stopped it
    assert [a["status"] for a in attempts(run_dir)["attempts"]] == [3, 0]
