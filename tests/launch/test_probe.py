"""launch's probe after a start that failed (mpiddp.launch.probe), in-process: what it runs, how its answers weigh,
and the supervisor keeping an answering host once and leaving it out when its start fails again."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

from conftest import run_supervisor
from mpiddp.launch.diagnose import STARTUP_OVERDUE, Failure, diagnose
from mpiddp.launch.hosts import Host
from mpiddp.launch.probe import (KEPT_ONCE, hosts_to_probe, probe_command, probe_hosts, remote_hosts, run_probe,
                                 weigh)
from mpiddp.launch.supervisor import Attempt, Plan, Supervisor

UNREACHABLE_B = """A daemon failed to report back after being spawned.
  Local host:    a
  Remote host:   b
  Daemon exit status: 255
"""  # Open MPI 5's report, shortened (tests/job/test_evidence.py has it whole)
OVERDUE = STARTUP_OVERDUE.format(seconds=600, failures="/runs/r1/failures")


def test_the_probe_runs_true_through_the_agent_with_a_deadline_and_says_why_not(tmp_path):
    assert probe_command(["ssh", "-p", "2222"], "nodeb") == ["ssh", "-p", "2222", "nodeb", "true"]
    assert run_probe(["true"]) == ""
    assert run_probe(["sh", "-c", "echo 'ssh: connect to host b port 22: No route to host' >&2; exit 255"]) == \
        "exit status 255: ssh: connect to host b port 22: No route to host"
    assert run_probe(["sh", "-c", "exit 1"]) == "exit status 1"
    assert run_probe([str(tmp_path / "no-such-agent"), "b", "true"]).startswith("cannot run ")


def _sleepers(marker):
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()


def test_a_probe_that_hangs_is_ended_whole_at_its_deadline_and_one_that_leaves_a_child_is_not_waited_for():
    """An agent that does not exec its command (a wrapper script) leaves the command as its child: at the deadline
    the probe's whole session is ended, not the agent alone. An agent that answers and leaves a child holding its
    stderr (ssh's ControlPersist master) has answered."""
    marker = f"time.sleep({31 + os.getpid() % 1000 / 1000:.3f})"
    sleeper = f"{sys.executable} -c 'import time; {marker}'"
    started = time.monotonic()
    assert run_probe(["sh", "-c", f"{sleeper}; true"], timeout=0.5) == "no answer within 0.5 s"
    assert time.monotonic() - started < 10 and _sleepers(marker) == []
    try:
        started = time.monotonic()
        assert run_probe(["sh", "-c", f"{sleeper} & exit 0"], timeout=10) == ""
        assert time.monotonic() - started < 5
    finally:
        for pid in _sleepers(marker):
            os.kill(int(pid), signal.SIGKILL)


def test_hosts_are_asked_at_once_and_this_host_is_never_asked():
    asked, together = [], threading.Barrier(2, timeout=10)

    def run(command):
        asked.append(command)
        together.wait()  # both asked before either answers: at once, not one after the other
        return "" if command[1] == "b" else "no answer within 10 s"

    answers = probe_hosts(["ssh"], ["here", "b", "c", "b", "localhost"], launch_host="here.cluster.org", run=run)
    assert answers == {"b": "", "c": "no answer within 10 s"}
    assert sorted(asked) == [["ssh", "b", "true"], ["ssh", "c", "true"]]
    assert probe_hosts(["ssh"], ["here", "localhost"], launch_host="here", run=run) == {}
    assert remote_hosts(["node1", "node1.racka", "node1.rackb", "node2"], "node1.racka") == ["node1.rackb", "node2"]


def test_an_unreachable_host_that_answers_is_kept_once():
    found = diagnose(213, [], UNREACHABLE_B, 2)
    assert (found.kind, found.hosts) == ("unreachable", ("b",))
    assert hosts_to_probe(found, ["a", "b", "c"], set(), may_keep=True) == ["b"]
    assert hosts_to_probe(found, ["a", "b", "c"], set(), may_keep=False) == []  # a spare, or --host-strikes 2
    weighed, kept = weigh(found, {"b": ""}, set())
    assert (weighed.kind, weighed.hosts, kept) == ("unreachable", (), ["b"])
    assert weighed.message == f"the launcher could not reach b; b {KEPT_ONCE}"
    assert hosts_to_probe(found, ["a", "b", "c"], {"b"}, may_keep=True) == []  # kept once already: not asked again
    assert weigh(found, {"b": ""}, {"b"}) == (found, [])  # and blamed, were it asked
    assert weigh(found, {"b": "exit status 255: ssh: connect to host b port 22: Connection refused"}, set()) == \
        (found, [])  # a host that does not answer stays blamed
    two = Failure("unreachable", 137, hosts=("b", "c"), message="the daemon on b ended ...", source="launcher output")
    weighed, kept = weigh(two, {"b": "", "c": "no answer within 10 s"}, set())
    assert (weighed.hosts, kept) == (("c",), ["b"])


def test_after_a_start_past_the_timeout_the_hosts_that_do_not_answer_are_blamed_where_another_answered():
    found = diagnose(137, [], f"mpiddp launch: {OVERDUE}; ending the attempt\n", 4)
    assert (found.kind, found.hosts) == ("hang", ())
    for may_keep in (True, False):  # every host: none is named yet
        assert hosts_to_probe(found, ["a", "b", "c"], {"b"}, may_keep) == ["a", "b", "c"]
    weighed, kept = weigh(found, {"b": "no answer within 10 s", "c": ""}, set())
    assert (weighed.kind, weighed.hosts, kept) == ("unreachable", ("b",), [])
    assert weighed.message == (f"{OVERDUE}; launch's probe (`true` through the launcher's agent) found b not "
                               "answering (b: no answer within 10 s)")
    weighed, _ = weigh(found, dict.fromkeys("bc", ""), set())
    assert (weighed.kind, weighed.hosts) == ("hang", ())
    assert weighed.message == f"{OVERDUE}; every host answered launch's probe: none is blamed"
    # no host answered: the probe may not reach hosts as the launcher does (Open MPI starting its daemons through
    # Slurm, ssh options of its own): that is no evidence against any of them
    weighed, _ = weigh(found, {"b": "exit status 255: ssh: connect to host b port 22", "c": "exit status 255"}, set())
    assert (weighed.kind, weighed.hosts) == ("hang", ())
    assert weighed.message == (f"{OVERDUE}; no host answered launch's probe (b: exit status 255: ssh: connect to "
                               "host b port 22; c: exit status 255), which may not reach hosts the way the launcher "
                               "does: none is blamed")
    assert weigh(found, {}, set()) == (found, [])  # nothing was asked (no host list, or launch's host alone)


def test_other_failures_are_not_probed():
    hang = Failure("hang", 4, (1,), ("b",), "the hang watchdog ...", source="failure record")
    killed = Failure("killed", 137, (1,), ("b",), "rank 1 on b died (SIGKILL or lost)", source="launcher output")
    for found in (hang, killed):
        assert hosts_to_probe(found, ["a", "b"], set(), True) == [] and weigh(found, {"b": ""}, set()) == (found, [])


def _start_fails_on_b(tmp_path, monkeypatch, hosts, **plan):
    """A Supervisor over `hosts` (-np 2) whose attempts fail to start on b while b answers launch's probe, and
    finish without b. Returns (its exit status, the hosts of each attempt, the probes run, attempts.json's)."""
    tmp_path.mkdir(exist_ok=True)
    agent, calls = tmp_path / "agent", tmp_path / "calls"
    agent.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n[ "$1" = b ]\n')  # b answers, every other host refuses
    agent.chmod(0o755)
    sup = Supervisor(Plan("train", ["--epochs", "1"], tmp_path, 2, hosts, [], plan.pop("max_restarts", 3), "mpirun",
                          "mpirun", "openmpi", **plan), {"PRTE_MCA_plm_ssh_agent": str(agent)})
    placements = []

    def fake_attempt(number, hosts, excluded):
        placements.append([h.name for h in hosts])
        sup._daemon_hosts = [h.name for h in hosts]
        failed = "b" in placements[-1]
        attempt = Attempt(number, placements[-1], ["mpirun"], time.time(), status=213 if failed else 0,
                          excluded_hosts=list(excluded), num_ranks=2)
        sup.attempts.append(attempt)
        return attempt, UNREACHABLE_B if failed else ""

    monkeypatch.setattr(sup, "_attempt", fake_attempt)
    monkeypatch.setattr(sup, "_job_status", lambda attempt: attempt.status)  # no job ran to mark its end
    status = run_supervisor(sup)
    probes = calls.read_text().splitlines() if calls.exists() else []
    return status, placements, probes, json.loads((tmp_path / "attempts.json").read_text())["attempts"]


def test_with_no_spare_an_answering_host_is_kept_once_then_left_out(tmp_path, monkeypatch, capsys):
    """b's daemon fails to start twice, while b answers launch's probe each time, and no spare can take its place:
    the first relaunch keeps b (a start that failed once is not a host that is down: leaving it out would end the
    run), the second leaves it out, which ends the run as before."""
    status, placements, probes, (first, second) = _start_fails_on_b(tmp_path, monkeypatch, [Host("a", 1), Host("b", 1)])
    assert status == 213 and placements == [["a", "b"], ["a", "b"]]
    assert probes == ["b true"]  # asked once: kept once, never asked again
    assert (first["probed"], first["failed_hosts"], first["blamed_hosts"], first["excluded_hosts"]) == \
        ({"b": ""}, [], [], [])
    assert first["message"].endswith(f"b {KEPT_ONCE}") and first["decision"].startswith("relaunching on the same hosts")
    assert (second["probed"], second["failed_hosts"], second["excluded_hosts"]) == ({}, ["b"], ["b"])
    assert second["decision"].startswith("cannot relaunch without b")
    said = capsys.readouterr().err
    assert f"attempt 0: the job never started; asking b to answer ({tmp_path / 'agent'} HOST true, 10 s at most)" \
        in said


def test_a_host_a_spare_can_replace_or_one_with_strikes_left_is_not_probed(tmp_path, monkeypatch):
    """With a spare the failed host is left out at once, as before (the spare costs nothing; a host whose daemon
    cannot start costs no attempt more); with --host-strikes 2 the strikes retry it, and no relaunch left: nothing
    the answers could change."""
    three = [Host("a", 1), Host("b", 1), Host("c", 1)]
    status, placements, probes, _ = _start_fails_on_b(tmp_path / "spare", monkeypatch, three)
    assert (status, placements, probes) == (0, [["a", "b"], ["a", "c"]], [])
    two = [Host("a", 1), Host("b", 1)]
    status, placements, probes, _ = _start_fails_on_b(tmp_path / "strikes", monkeypatch, two, host_strikes=2)
    assert (status, placements, probes) == (213, [["a", "b"], ["a", "b"]], [])
    status, placements, probes, _ = _start_fails_on_b(tmp_path / "last", monkeypatch, two, max_restarts=0)
    assert (status, placements, probes) == (213, [["a", "b"]], [])


def test_launchs_exit_status_after_it_ended_the_launcher_is_the_causes_never_its_sigkill(tmp_path):
    sup = Supervisor(Plan("train", [], tmp_path, 2, [], [], 0, "mpirun", "mpirun", "openmpi"), {})
    attempt = Attempt(0, [], [], time.time(), status=137)
    sup.ended_launcher = True
    for cause, status in (("hang", 4), ("stopped", 3), ("user_error", 2), ("exception", 1), ("unreachable", 1)):
        attempt.cause = cause
        assert sup._exit_status(attempt) == status, cause
    sup.ended_launcher = False  # the launcher's own 137 (the OOM killer's, say) is its own
    assert sup._exit_status(attempt) == 137


def test_srun_and_a_job_that_started_are_not_probed(tmp_path):
    from mpiddp import failure

    three = [Host("a", 1), Host("b", 1), Host("c", 1)]
    for launcher, started in (("srun", False), ("mpirun", True)):
        run_dir = tmp_path / launcher
        plan = Plan("train", [], run_dir, 2, three, [], 3, launcher, launcher, "openmpi")
        sup = Supervisor(plan, {"PRTE_MCA_plm_ssh_agent": sys.executable})  # would fail the test, were it run
        sup._daemon_hosts = ["a", "b"]
        if started:
            failure.write_placement(sup.failure_file, [("a", [0]), ("b", [1])])
        attempt = Attempt(0, ["a", "b"], [], time.time(), num_ranks=2)
        found, _, _ = sup._diagnose(attempt, UNREACHABLE_B, three[:2], [])
        assert (found.kind, found.hosts, attempt.probed) == ("unreachable", ("b",), {}), found
