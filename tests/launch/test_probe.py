"""launch's probe after a start that failed (mpiddp.launch.probe), in-process: what it runs, how its answers weigh,
and the supervisor keeping an answering host once and leaving it out when its start fails again."""

import json
import sys
import threading
import time

from conftest import run_supervisor
from mpiddp.launch.diagnose import STARTUP_OVERDUE, Failure, diagnose
from mpiddp.launch.hosts import Host
from mpiddp.launch.probe import PARDONED, hosts_to_probe, probe_command, probe_hosts, run_probe, weigh
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
    started = time.monotonic()
    assert run_probe(["sleep", "30"], timeout=0.3) == "no answer within 0.3 s"  # a host that never answers
    assert time.monotonic() - started < 10
    assert run_probe([str(tmp_path / "no-such-agent"), "b", "true"]).startswith("cannot run ")


def test_hosts_are_asked_at_once_and_this_host_is_never_asked():
    asked, together = [], threading.Barrier(2, timeout=10)

    def run(command):
        asked.append(command)
        together.wait()  # both asked before either answers: at once, not one after the other
        return "" if command[1] == "b" else "no answer within 10 s"

    answers = probe_hosts(["ssh"], ["here", "b", "c", "b", "localhost"], launch_host="here.cluster.org", run=run)
    assert answers == {"here": "", "b": "", "c": "no answer within 10 s", "localhost": ""}
    assert sorted(asked) == [["ssh", "b", "true"], ["ssh", "c", "true"]]


def test_an_unreachable_host_that_answers_is_kept_once():
    found = diagnose(213, [], UNREACHABLE_B, 2)
    assert (found.kind, found.hosts) == ("unreachable", ("b",))
    assert hosts_to_probe(found, ["a", "b", "c"], set()) == ["b"]
    weighed, kept = weigh(found, {"b": ""}, set())
    assert (weighed.kind, weighed.hosts, kept) == ("unreachable", (), ["b"])
    assert weighed.message == f"the launcher could not reach b; b {PARDONED}"
    assert hosts_to_probe(found, ["a", "b", "c"], {"b"}) == []  # kept once already: not asked again
    assert weigh(found, {"b": ""}, {"b"}) == (found, [])  # and blamed, were it asked
    assert weigh(found, {"b": "exit status 255: ssh: connect to host b port 22: Connection refused"}, set()) == \
        (found, [])  # a host that does not answer stays blamed
    two = Failure("unreachable", 137, hosts=("b", "c"), message="the daemon on b ended ...", source="launcher output")
    weighed, kept = weigh(two, {"b": "", "c": "no answer within 10 s"}, set())
    assert (weighed.hosts, kept) == (("c",), ["b"])


def test_after_a_start_past_the_timeout_the_hosts_that_do_not_answer_are_blamed():
    found = diagnose(137, [], f"mpiddp launch: {OVERDUE}; ending the attempt\n", 4)
    assert (found.kind, found.hosts) == ("hang", ())
    assert hosts_to_probe(found, ["a", "b", "c"], {"b"}) == ["a", "b", "c"]  # every host: none is named yet
    weighed, kept = weigh(found, {"a": "", "b": "no answer within 10 s", "c": ""}, set())
    assert (weighed.kind, weighed.hosts, kept) == ("unreachable", ("b",), [])
    assert weighed.message == (f"{OVERDUE}; launch's probe (`true` through the launcher's agent) found b not "
                               "answering (b: no answer within 10 s)")
    weighed, _ = weigh(found, dict.fromkeys("abc", ""), set())
    assert (weighed.kind, weighed.hosts) == ("hang", ())
    assert weighed.message == f"{OVERDUE}; every host answered launch's probe: none is blamed"
    assert weigh(found, {}, set()) == (found, [])  # no host list: nothing was asked


def test_other_failures_are_not_probed():
    hang = Failure("hang", 4, (1,), ("b",), "the hang watchdog ...", source="failure record")
    killed = Failure("killed", 137, (1,), ("b",), "rank 1 on b died (SIGKILL or lost)", source="launcher output")
    for found in (hang, killed):
        assert hosts_to_probe(found, ["a", "b"], set()) == [] and weigh(found, {"b": ""}, set()) == (found, [])


def test_the_supervisor_keeps_an_answering_host_once_then_leaves_it_out(tmp_path, monkeypatch, capsys):
    """b's daemon fails to start twice, while b answers launch's probe each time: the first relaunch keeps b (a
    start that failed once is not a host that is down), the second leaves it out for the spare c."""
    agent, calls = tmp_path / "agent", tmp_path / "calls"
    agent.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n[ "$1" = b ]\n')  # b answers, every other host refuses
    agent.chmod(0o755)
    three = [Host("a", 1), Host("b", 1), Host("c", 1)]
    plan = Plan("train", ["--epochs", "1"], tmp_path, 2, three, [], 3, "mpirun", "mpirun", "openmpi")
    sup = Supervisor(plan, {"PRTE_MCA_plm_ssh_agent": str(agent)})
    placements = []

    def fake_attempt(number, hosts, excluded):
        placements.append([h.name for h in hosts])
        sup._daemon_hosts = [h.name for h in hosts]
        failed = "b" in placements[-1]
        attempt = Attempt(number, placements[-1], ["mpirun"], time.time(), status=213 if failed else 0)
        sup.attempts.append(attempt)
        return attempt, UNREACHABLE_B if failed else ""

    monkeypatch.setattr(sup, "_attempt", fake_attempt)
    monkeypatch.setattr(sup, "_job_status", lambda attempt: attempt.status)  # no job ran to mark its end
    assert run_supervisor(sup) == 0
    assert placements == [["a", "b"], ["a", "b"], ["a", "c"]]
    assert calls.read_text() == "b true\n"  # asked once: kept once, never asked again
    first, second, _ = json.loads((tmp_path / "attempts.json").read_text())["attempts"]
    assert (first["probed"], first["failed_hosts"], first["blamed_hosts"], first["excluded_hosts"]) == \
        ({"b": ""}, [], [], [])
    assert first["message"].endswith(f"b {PARDONED}") and first["decision"].startswith("relaunching on the same hosts")
    assert (second["probed"], second["failed_hosts"], second["excluded_hosts"]) == ({}, ["b"], ["b"])
    assert "relaunching without b (unreachable)" in second["decision"]
    said = capsys.readouterr().err
    assert f"attempt 0: the job never started; asking b to answer ({agent} HOST true, 10 s at most)" in said


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
