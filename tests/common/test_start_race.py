"""The test harness's reading of Open MPI's start-up race (conftest): a run that met it is launched again, a run a
test made fail (an unreachable host, a rank's error) never is: a wrong reading hides a failure behind reruns or
fails a test on noise."""

import json

from conftest import launch_raced_at_start, launcher_never_started, past_start_races

RACE_213 = """------------------------------------------------------------
A daemon failed to report back after being spawned. This could
  Local host:    nodea
  Remote host:   nodeb
  Daemon exit status: 213
------------------------------------------------------------
"""  # Open MPI 5.0.11 on fake hosts under CI's load: nodeb's own daemon failed, nothing of mpiddp ran
REFUSED = RACE_213.replace("exit status: 213", "exit status: 255") + \
    "ssh: connect to host nodeb port 22: Connection refused\n"  # a test's agent refusing nodeb: a host down
LAUNCH_LINES = ("mpiddp launch: attempt 0 on nodea, nodeb, nodec: /v/bin/mpirun -np 4 ... -m mpiddp run x.py\n{}"
                "mpiddp launch: attempt 0 failed (exit status 213): unreachable per the launcher output: the "
                "launcher could not reach nodeb; --max-restarts 0 spent\n")


def test_the_race_is_read_in_a_launchers_output_and_in_launchs_but_not_a_host_down_or_a_rank_that_ran():
    assert launcher_never_started(RACE_213)
    assert launcher_never_started("The PMIx server's listener thread failed to start\n")
    assert launcher_never_started(LAUNCH_LINES.format(RACE_213))  # launch's own lines name mpiddp: no rank's
    assert launcher_never_started("mpiddp launch: the daemon on nodeb ended before the job started (the agent "
                                  "exited 0): mpirun waits for their ranks forever under the relay layout; ending "
                                  "the attempt\n")
    assert not launcher_never_started(REFUSED)  # ssh's 255: the host a test made unreachable
    assert not launcher_never_started(LAUNCH_LINES.format(REFUSED))
    assert not launcher_never_started(f"INFO mpiddp: rank 0 of 3 on nodea\n{RACE_213}")  # a rank ran
    assert not launcher_never_started("mpiddp launch: attempt 0 failed (exit status 1): exception ...\n")


def test_launchs_attempts_lost_to_the_race_are_told_by_their_own_output(tmp_path):
    attempts = [{"number": 0, "status": 213, "cause": "unreachable", "failed_hosts": ["nodeb"], "message": ""},
                {"number": 1, "status": 137, "cause": "unreachable", "failed_hosts": ["nodeb"],
                 "message": "the daemon on nodeb ended before the job started (the agent exited 0) ..."},
                {"number": 2, "status": 213, "cause": "unreachable", "failed_hosts": ["nodeb"], "message": ""},
                {"number": 3, "status": 0, "cause": None, "failed_hosts": [], "message": ""}]
    (tmp_path / "attempts.json").write_text(json.dumps({"attempts": attempts}))
    (tmp_path / "attempt0.err").write_text(RACE_213)
    (tmp_path / "attempt2.err").write_text(REFUSED)
    assert [a["number"] for a in past_start_races(tmp_path)] == [2, 3]
    assert launch_raced_at_start(tmp_path)
    (tmp_path / "attempt0.err").write_text(REFUSED)
    assert not launch_raced_at_start(tmp_path)
