"""In-job recovery around the job, in-process: which launcher gets Open MPI's fault tolerance (and why not, in one
line), what launch records of it per attempt, `check`'s line, and how `report` tells the recoveries."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from mpiddp import recoveries
from mpiddp.launch import supervisor as supervisor_module
from mpiddp.launch.cli import LaunchError, make_plan
from mpiddp.launch.command import (
    FT_ARGS,
    NODE_LOSS_ARGS,
    build_command,
    decide_in_job_recovery,
    node_loss_args,
    open_mpi_major,
)
from mpiddp.launch.hosts import Host
from mpiddp.launch.supervisor import Supervisor
from mpiddp.tools.report import attempt_lines, recovery_lines

OPEN_MPI_5 = "mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n"
WITH_FT = "options:mpi_ext:affinity, cuda, ftmpi\noptions:ft_support:yes\noptions:ft_mpi_support:yes\n"
WITHOUT_FT = "options:ft_support:no\noptions:ft_mpi_support:no\n"
HYDRA = "HYDRA build details:\n    Version: 4.2.1\n"

RECOVERY = {"cause": "killed", "ranks_lost": [1], "hosts_lost": ["nodeb"], "step": 30, "steps_lost": 1,
            "world_before": 3, "world_after": 2,
            # summary.json sorts its keys: the phases are told in the order they happen all the same
            "phases": {"agree_and_shrink": 0.11, "ddp": 0.02, "detect": 0.03, "first_step": 0.21,
                       "process_group": 0.05}}


def test_open_mpi_5_built_with_ulfm_gets_with_ft_ulfm():
    on = decide_in_job_recovery(True, "mpirun", "openmpi", OPEN_MPI_5, WITH_FT, [])
    assert on.on and on.add_args == FT_ARGS == ("--with-ft", "ulfm")
    assert on.why.startswith("in-job recovery is on: Open MPI 5 with ULFM") and "--no-in-job-recovery" in on.why
    # Open MPI's mpiexec is its mpirun
    assert decide_in_job_recovery(True, "mpiexec", "openmpi", OPEN_MPI_5, WITH_FT, []).add_args == FT_ARGS


@pytest.mark.parametrize("launcher, flavour, version, info, says", [
    ("mpiexec", "mpich", HYDRA, None, "in-job recovery is off: MPICH has no ULFM fault tolerance"),
    ("srun", "openmpi", OPEN_MPI_5, WITH_FT, "in-job recovery is off: srun direct launch cannot recover in the job"),
    ("srun", "mpich", HYDRA, None, "srun direct launch cannot recover"),
    ("mpirun", "openmpi", "mpirun (Open MPI) 4.1.6\n", WITH_FT, "Open MPI 4 has no ULFM fault tolerance"),
    ("mpirun", "openmpi", "", WITH_FT, "its --version names no Open MPI"),
    ("mpirun", "openmpi", OPEN_MPI_5, None, "no ompi_info beside the launcher"),
    ("mpirun", "openmpi", OPEN_MPI_5, WITHOUT_FT, "built without ULFM fault tolerance (ompi_info: FT MPI support: no)"),
])
def test_where_in_job_recovery_cannot_work_it_is_off_saying_why_in_one_line(launcher, flavour, version, info, says):
    off = decide_in_job_recovery(True, launcher, flavour, version, info, [])
    assert not off.on and off.add_args == () and says in off.why, off.why
    assert "\n" not in off.why and off.why.endswith("launch relaunches it" if launcher != "srun" else
                                                    "(use --launcher mpirun to recover in the job)")


def test_the_flag_turns_it_off_and_the_users_own_with_ft_is_kept():
    off = decide_in_job_recovery(False, "mpirun", "openmpi", OPEN_MPI_5, WITH_FT, [])
    assert not off.on and off.add_args == () and "(--no-in-job-recovery)" in off.why
    given = decide_in_job_recovery(True, "mpirun", "openmpi", OPEN_MPI_5, None, ["--with-ft", "ulfm"])
    assert given.on and given.add_args == ()  # already on the command line: not twice
    assert not decide_in_job_recovery(True, "mpirun", "openmpi", OPEN_MPI_5, WITH_FT, ["--with-ft=none"]).on
    assert open_mpi_major("mpirun (Open MPI) 5.0.11") == 5 and open_mpi_major("HYDRA") is None


def test_the_fault_tolerance_arguments_go_on_open_mpis_command_line():
    command = build_command("mpirun", "mpirun", "openmpi", [Host("a", 1)], 1, ["--epochs", "1"], {"V": "1"}, [],
                            ["--mca", "x", "y"], "py", ft_args=FT_ARGS)
    assert command == ["mpirun", "-np", "1", "-H", "a:1", "--bind-to", "none", "--map-by", "slot", "--with-ft", "ulfm",
                       "-x", "V", "--mca", "x", "y", "py", "-m", "mpiddp", "--epochs", "1"]


def test_open_mpi_5_is_asked_to_notice_a_silent_host_in_seconds_unless_the_user_tuned_it():
    assert node_loss_args("mpirun", "openmpi", OPEN_MPI_5, []) == NODE_LOSS_ARGS
    assert "oob_tcp_keepalive_time" in NODE_LOSS_ARGS and NODE_LOSS_ARGS[0] == "--prtemca"
    assert node_loss_args("mpirun", "openmpi", OPEN_MPI_5, ["--prtemca", "oob_tcp_keepalive_time", "60"]) == ()
    assert node_loss_args("mpirun", "openmpi", "mpirun (Open MPI) 4.1.6\n", []) == ()  # no --prtemca there
    assert node_loss_args("mpiexec", "mpich", HYDRA, []) == ()
    assert node_loss_args("srun", "openmpi", OPEN_MPI_5, []) == ()


def fake_open_mpi(folder, ft_line, calls, finishes=True, status=0, lingers=False, recovery=RECOVERY, job_dir=None,
                  failed_ranks=()):
    """A launcher that says it is Open MPI 5 and, beside it, an ompi_info that counts its calls. Run as the
    launcher it writes a summary.json with one recovery into RUN_DIR (with `job_dir`, into that directory, which
    its job record names, as training's own --run-dir does; with `finishes`, the job's mark that it finished too;
    a failure record for each of `failed_ranks`, all alike) and exits `status` (with `lingers`, never: it sleeps;
    or after that many seconds)."""
    folder.mkdir()
    info = folder / "ompi_info"
    info.write_text(f"#!/bin/sh\necho called >> {calls}\necho 'options:ft_mpi_support:{ft_line}'\n")
    launcher = folder / "mpirun"
    launcher.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "def record(rank):\n"
        "    os.makedirs(os.environ['MPIDDP_FAILURE_FILE'], exist_ok=True)\n"
        "    path = os.path.join(os.environ['MPIDDP_FAILURE_FILE'], f'rank-{rank}.json')\n"
        "    open(path, 'w').write(json.dumps({'kind': 'exception', 'ranks': [rank], 'hosts': [f'node{rank}'],\n"
        "                                      'message': 'RuntimeError: boom', 'rank': rank, 'status': 1}))\n"
        "if sys.argv[1:] == ['--version']:\n    print('mpirun (Open MPI) 5.0.3')\n    sys.exit(0)\n"
        + ("run_dir = os.environ['MPIDDP_RUN_DIR']\n" if job_dir is None else
           f"run_dir = {str(job_dir)!r}\nos.makedirs(run_dir, exist_ok=True)\n"
           f"open(os.environ['MPIDDP_JOB_RECORD'], 'w').write(json.dumps({{'run_dir': run_dir, 'checkpoint_dir': "
           "run_dir, 'world_size': 2, 'global_batch': 64, 'max_per_rank_batch': 32}))\n")
        + f"open(os.path.join(run_dir, 'summary.json'), 'w').write(json.dumps({{'recoveries': [{recovery!r}]}}))\n"
        + ("open(os.path.join(run_dir, 'finished'), 'w').write('1')\n" if finishes else "")
        + "".join(f"record({rank})\n" for rank in failed_ranks)
        + (f"import time\ntime.sleep({10**6 if lingers is True else lingers})\n" if lingers else "")
        + f"sys.exit({status})\n")
    for program in (info, launcher):
        program.chmod(0o755)
    return launcher


def test_launch_decides_once_from_the_launchers_ompi_info_and_records_it_per_attempt(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)  # keep pytest's own handlers
    calls, run_dir = tmp_path / "calls", tmp_path / "run"
    launcher = fake_open_mpi(tmp_path / "bin", "yes", calls)
    plan = make_plan(["-np", "2", "--launcher-path", str(launcher), "--run-dir", str(run_dir), "--", "--epochs", "1"],
                     {})
    assert plan.in_job_recovery.on and plan.in_job_recovery.add_args == FT_ARGS
    assert Supervisor(plan, {"PATH": "/usr/bin:/bin"}).run() == 0
    assert calls.read_text().count("called") == 1  # once per launch, not once per attempt
    (attempt,) = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    assert attempt["in_job_recovery"] is True and attempt["in_job_recovery_off"] == ""
    assert attempt["command"][:3] == [str(launcher), "-np", "2"] and "--with-ft" in attempt["command"]
    assert attempt["recoveries"] == [RECOVERY]
    err = capsys.readouterr().err
    assert "mpiddp launch: in-job recovery is on: Open MPI 5 with ULFM" in err
    assert "attempt 0: exit status 0; finished after 1 in-job recovery (rank 1 on nodeb lost, down 0.42 s)" in err


def test_an_open_mpi_without_ulfm_or_the_flag_records_why_it_is_off(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    launcher = fake_open_mpi(tmp_path / "bin", "no", tmp_path / "calls")
    for flags, why in (([], "built without ULFM"), (["--no-in-job-recovery"], "(--no-in-job-recovery)")):
        run_dir = tmp_path / f"run{len(flags)}"
        plan = make_plan(["-np", "2", "--launcher-path", str(launcher), *flags, "--run-dir", str(run_dir), "--",
                          "--epochs", "1"], {})
        assert Supervisor(plan, {"PATH": "/usr/bin:/bin"}).run() == 0
        (attempt,) = json.loads((run_dir / "attempts.json").read_text())["attempts"]
        assert attempt["in_job_recovery"] is False and why in attempt["in_job_recovery_off"]
        assert "--with-ft" not in attempt["command"]
        assert "mpiddp launch: in-job recovery is off" in capsys.readouterr().err
    with pytest.raises(LaunchError, match="--no-in-job-recovery and --launcher-args --with-ft ulfm contradict"):
        make_plan(["-np", "2", "--launcher-path", str(launcher), "--no-in-job-recovery", "--launcher-args",
                   "--with-ft ulfm", "--run-dir", str(tmp_path), "--", "--epochs", "1"], {})


def test_launch_with_the_open_mpi_beside_this_python_turns_it_on(tmp_path, mpirun):
    plan = make_plan(["-np", "2", "--launcher", "mpirun", "--run-dir", str(tmp_path), "--", "--epochs", "1"], {})
    assert plan.in_job_recovery.on, plan.in_job_recovery.why  # the pip Open MPI 5.0.11 has ULFM


def test_launch_with_mpich_leaves_it_off_naming_mpich(tmp_path, mpich):
    plan = make_plan(["-np", "2", "--launcher-path", str(mpich / "bin" / "mpiexec"), "--run-dir", str(tmp_path),
                      "--", "run", "x.py"], {})
    assert not plan.in_job_recovery.on and "MPICH has no ULFM" in plan.in_job_recovery.why


def test_launch_under_srun_leaves_it_off_saying_why_in_one_line(tmp_path, capsys):
    plan = make_plan(["-H", "a:1,b:1", "-np", "2", "--launcher", "srun", "--run-dir", str(tmp_path), "--",
                      "--epochs", "1"], {})
    assert plan.launcher == "srun" and not plan.in_job_recovery.on
    said = [line for line in capsys.readouterr().err.splitlines() if "in-job recovery" in line]
    assert said == ["mpiddp launch: in-job recovery is off: srun direct launch cannot recover in the job (Open MPI's "
                    "fault tolerance needs mpirun's runtime to tell the survivors who failed, and srun ends the whole "
                    "step when a task dies); a failure ends the job and launch relaunches it (use --launcher mpirun "
                    "to recover in the job)"]


def test_help_names_the_flag(capsys):
    from mpiddp.main import main

    assert main(["launch", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--no-in-job-recovery" in out and "passes --with-ft ulfm to Open MPI 5's mpirun" in out


def test_report_tells_each_recovery_in_one_line_with_its_phases_in_order():
    lines = recovery_lines({"recoveries": [RECOVERY, {**RECOVERY, "ranks_lost": [0, 2], "hosts_lost": [],
                                                     "world_before": 2, "world_after": 1, "step": None,
                                                     "steps_lost": 0}]})
    assert lines == [
        "in-job recoveries: 2, down 0.84 s in all",
        "  recovery 0: killed at step 30: rank 1 on nodeb lost, 3 -> 2 ranks, 1 step lost, down 0.42 s (detect 0.03, "
        "agree and shrink 0.11, process group 0.05, DDP 0.02, first step 0.21)",
        "  recovery 1: killed: ranks 0, 2 lost, 2 -> 1 ranks, 0 steps lost, down 0.42 s (detect 0.03, agree and "
        "shrink 0.11, process group 0.05, DDP 0.02, first step 0.21)"]
    assert recovery_lines({"recoveries": []}) == recovery_lines({}) == recovery_lines(None) == []
    assert recoveries.describe({"cause": "hang"}) == "hang: a rank lost"  # what is not recorded is left out


def test_reports_attempt_line_mentions_the_recoveries_inside_it():
    attempts = {"restarts": 0, "attempts": [{"number": 0, "hosts": ["nodea", "nodeb"], "num_ranks": 2, "status": 0,
                                             "cause": None, "recoveries": [RECOVERY]}]}
    assert attempt_lines(attempts)[1] == ("  attempt 0 on nodea, nodeb (2 ranks): finished after 1 in-job recovery "
                                          "(rank 1 on nodeb lost, down 0.42 s)")
    attempts["attempts"][0]["recoveries"] = []
    assert attempt_lines(attempts)[1] == "  attempt 0 on nodea, nodeb (2 ranks): finished"


def test_a_summary_older_than_the_attempt_is_not_its_recoveries(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"recoveries": [RECOVERY]}))
    assert recoveries.read_recoveries(tmp_path, 0.0) == [RECOVERY]
    assert recoveries.read_recoveries(tmp_path, (tmp_path / "summary.json").stat().st_mtime + 1) == []
    (tmp_path / "summary.json").write_text("{not json")
    assert recoveries.read_recoveries(tmp_path) == []


@pytest.mark.parametrize("library, env, has_api, can_regroup, says", [
    ("Open MPI v5.0.11, package: ...", {"OMPI_MCA_mpi_ft_enable": "1"}, True, True, None),
    ("Open MPI v5.0.11, package: ...", {}, True, True, "needs mpirun --with-ft ulfm"),
    ("Open MPI v4.1.6, package: ...", {"OMPI_MCA_mpi_ft_enable": "1"}, True, True, "needs Open MPI 5 or newer"),
    ("MPICH Version:      5.0.2\n", {}, True, True, "this job runs MPICH Version:      5.0.2"),
    ("Open MPI v5.0.11, package: ...", {"OMPI_MCA_mpi_ft_enable": "1"}, False, True, "needs mpi4py 4 or newer"),
    ("Open MPI v5.0.11, package: ...", {"OMPI_MCA_mpi_ft_enable": "1"}, True, False, "cannot rebuild torch 2.4.0's"),
])
def test_checks_verdict_on_in_job_recovery(library, env, has_api, can_regroup, says):
    from mpiddp.elastic.decide import in_job_recovery_refusal

    refusal = in_job_recovery_refusal(library, env, has_api, "2.4.0", can_regroup)
    assert refusal is None if says is None else says in refusal and "\n" not in refusal, refusal


def test_checks_line_in_this_process(monkeypatch):
    from mpiddp.tools.check import in_job_recovery_line

    line = in_job_recovery_line({"OMPI_MCA_mpi_ft_enable": "1"})
    assert line.startswith("in-job recovery: yes (Open MPI v5") and "torch " in line, line
    assert in_job_recovery_line({}).startswith("in-job recovery: no: in-job recovery needs mpirun --with-ft ulfm")


def test_a_zero_from_a_fault_tolerant_mpirun_with_failure_records_is_a_failure():
    from mpiddp.failure import FailureRecord
    from mpiddp.launch.supervisor import status_under_fault_tolerance

    crashed = FailureRecord("killed", [1], ["nodeb"], "rank 1 on nodeb died", rank=0, status=1)
    assert status_under_fault_tolerance(0, []) == 0  # finished (its survivors may have recovered in the job)
    assert status_under_fault_tolerance(0, [crashed]) == 1  # mpirun --with-ft ulfm said 0 after an abort
    assert status_under_fault_tolerance(0, [FailureRecord("hang", [1], [], "hang")]) == 1
    assert status_under_fault_tolerance(3, [crashed]) == 3


def test_a_survivor_names_the_ranks_mpi_reports_failed_so_their_host_is_blamed():
    """mpirun --with-ft ulfm prints nothing of a rank that died: the survivor's record, from what MPI told it."""
    from mpiddp.job.collective import Dist, SoloTransport
    from mpiddp.job.failfast import FailFast
    from mpiddp.job.topology import RankRecord, build_topology
    from mpiddp.launch.diagnose import diagnose, lost_peer

    class KnowsTheDead(SoloTransport):
        def __init__(self, failed):
            self.rank, self.size, self.failed = 0, 3, failed

        def failed_ranks(self):
            return self.failed

    records = [RankRecord(r, f"node{'abc'[r]}", r, 0, 1) for r in range(3)]  # one rank per host
    guard = FailFast()
    guard.dist = Dist(build_topology(0, records), KnowsTheDead((1,)))
    record = guard.record(RuntimeError("MPI_ERR_PROC_FAILED: Process Failure"), 1)
    assert (record.kind, record.ranks, record.hosts, record.rank) == ("killed", [1], ["nodeb"], 0)
    assert not lost_peer(record)  # it names the culprit: not a witness's record
    found = diagnose(0, [record], "", 3, {0: "nodea", 1: "nodeb", 2: "nodec"})
    assert (found.kind, found.ranks, found.hosts) == ("killed", (1,), ("nodeb",))
    guard.dist = Dist(build_topology(0, records), KnowsTheDead(()))  # MPI knows of no failure: a witness as before
    assert guard.record(RuntimeError("Connection reset by peer"), 1).ranks == [0]


def test_a_zero_from_a_fault_tolerant_mpirun_without_the_jobs_finished_mark_is_a_failure(tmp_path, monkeypatch,
                                                                                          capsys):
    """mpirun --with-ft ulfm exits 0 when every rank was killed (no rank left to record anything): launch takes a
    0 only with the mark a training job leaves when it ended as it should, and relaunches otherwise."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    run_dir = tmp_path / "run"
    launcher = fake_open_mpi(tmp_path / "bin", "yes", tmp_path / "calls", finishes=False)
    plan = make_plan(["-np", "2", "--launcher-path", str(launcher), "--max-restarts", "1", "--run-dir", str(run_dir),
                      "--", "--epochs", "1"], {})
    assert Supervisor(plan, {"PATH": "/usr/bin:/bin"}).run() != 0
    attempts = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    assert len(attempts) == 2 and all(a["status"] != 0 and a["decision"] != "finished" for a in attempts), attempts


def test_a_fault_tolerant_mpirun_that_fails_after_the_jobs_finished_mark_is_a_finished_job(tmp_path, monkeypatch,
                                                                                            capsys):
    """Open MPI 5.0.11's mpirun can crash (SIGSEGV, "free(): invalid pointer") after a job that grew back has
    finished: every rank wrote its results and rank 0 the mark. Launch takes the job's mark over the launcher's
    status, says so, and does not relaunch a finished job."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    run_dir = tmp_path / "run"
    launcher = fake_open_mpi(tmp_path / "bin", "yes", tmp_path / "calls", status=139)
    plan = make_plan(["-np", "2", "--launcher-path", str(launcher), "--run-dir", str(run_dir), "--", "--epochs", "1"],
                     {})
    assert Supervisor(plan, {"PATH": "/usr/bin:/bin"}).run() == 0
    (attempt,) = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    assert (attempt["status"], attempt["decision"]) == (0, "finished"), attempt
    assert "the launcher exited 139 after the job marked its end" in capsys.readouterr().err


def test_a_launcher_that_lingers_after_the_jobs_finished_mark_is_ended_and_the_job_finished(tmp_path, monkeypatch,
                                                                                             capsys):
    """A launcher (or a rank it waits for) that never exits after the job marked its end must not hold a run that
    nobody watches: launch ends it FINISHED_LINGER_S later, says so, and takes the job as finished."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    monkeypatch.setattr(supervisor_module, "FINISHED_LINGER_S", 0.5)
    run_dir = tmp_path / "run"
    launcher = fake_open_mpi(tmp_path / "bin", "yes", tmp_path / "calls", lingers=True,
                             recovery={**RECOVERY, "cause": "hang", "hosts_lost": []})
    plan = make_plan(["-np", "2", "--launcher-path", str(launcher), "--run-dir", str(run_dir), "--", "--epochs", "1"],
                     {})
    assert Supervisor(plan, {"PATH": "/usr/bin:/bin"}).run() == 0
    (attempt,) = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    assert (attempt["status"], attempt["decision"]) == (0, "finished"), attempt
    said = capsys.readouterr().err
    assert "the launcher still runs 0.5 s after the job marked its end: ending it" in said, said
    assert "the launcher exited 137 after the job marked its end" in said, said


@pytest.mark.parametrize("recorded", [(0, 1), (0,)], ids=["every rank", "one rank of two"])
def test_a_launcher_that_lingers_after_every_rank_recorded_its_failure_is_ended(tmp_path, monkeypatch, capsys,
                                                                                 recorded):
    """Every rank of the job (its world after its in-job recovery: two) wrote its failure record, which a rank does
    as its process ends, and the launcher runs on (Open MPI's runtime stuck in the abort): launch ends it
    FINISHED_LINGER_S later, says so, and decides from the records. Where a rank of the world wrote none (it may
    still be saving), the launcher is waited for."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    monkeypatch.setattr(supervisor_module, "FINISHED_LINGER_S", 0.5)
    run_dir = tmp_path / "run"
    launcher = fake_open_mpi(tmp_path / "bin", "yes", tmp_path / "calls", finishes=False, status=1,
                             lingers=True if len(recorded) == 2 else 3.5, failed_ranks=recorded)
    plan = make_plan(["-np", "3", "--launcher-path", str(launcher), "--run-dir", str(run_dir), "--max-restarts", "0",
                      "--", "--epochs", "1"], {})
    assert Supervisor(plan, {"PATH": "/usr/bin:/bin"}).run() == 1  # the job's crash; never 137, launch's SIGKILL
    (attempt,) = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    said = capsys.readouterr().err
    ended = "the launcher still runs 0.5 s after every rank recorded its failure and ended: ending it"
    if len(recorded) == 2:
        assert ended in said and attempt["status"] == 137, said
        assert (attempt["cause"], attempt["ranks_recorded"], attempt["blamed_hosts"]) == ("exception", 2, []), attempt
    else:
        assert ended not in said and attempt["status"] == 1, said


def test_a_launcher_without_the_mark_is_waited_for(tmp_path, monkeypatch):
    """Without the job's mark (a job still training), launch never ends the launcher on its own."""
    monkeypatch.setattr(supervisor_module, "FINISHED_LINGER_S", 0.0)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"], start_new_session=True)
    try:
        assert supervisor_module._wait_unless_lingering(child, lambda: "") == (0, "", False)
    finally:
        child.kill()
        child.wait()


def test_a_job_that_never_starts_is_ended_after_the_startup_timeout_and_relaunched(tmp_path, monkeypatch, capsys):
    """A launcher whose ranks never all come through MPI's start-up (no placement: a daemon or a rank stuck there)
    would hold launch forever: each attempt is ended --startup-timeout s after it started, saying so in one line,
    as a hang that blames no host."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    run_dir = tmp_path / "run"
    launcher = fake_open_mpi(tmp_path / "bin", "yes", tmp_path / "calls", finishes=False, lingers=True)
    plan = make_plan(["-np", "2", "--launcher-path", str(launcher), "--run-dir", str(run_dir), "--max-restarts", "1",
                      "--startup-timeout", "1", "--", "--epochs", "1"], {})
    assert plan.startup_timeout_s == 1.0
    assert Supervisor(plan, {"PATH": "/usr/bin:/bin"}).run() == 4  # a hang's status, not launch's own SIGKILL's
    first, second = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    overdue = ("not every rank came through MPI's start-up within --startup-timeout 1 s (the job recorded no "
               f"placement in {run_dir / 'failures'}: a host's daemon or a rank stuck there, e.g. on a hung "
               "filesystem or a blocked port; or that directory is not shared with rank 0's host)")
    for attempt in (first, second):
        assert (attempt["status"], attempt["cause"], attempt["message"]) == (137, "hang", overdue), attempt
        assert attempt["failed_hosts"] == attempt["blamed_hosts"] == [], attempt
    assert first["decision"].startswith("relaunching") and "--max-restarts 1 spent" in second["decision"]
    assert capsys.readouterr().err.count(f"mpiddp launch: {overdue}; ending the attempt\n") == 2


def test_a_job_is_taken_as_not_started_only_until_its_placement_and_for_the_relay_layout_hosts_that_ended(
        tmp_path, monkeypatch):
    """Launch's evidence that the job never started: no placement yet (rank 0 writes it once every rank came
    through MPI's start-up), with a host whose daemon's connection came up and ended LOST_HOST_LINGER_S ago (under
    the relay layout only: its relay carries on and mpirun waits forever), or --startup-timeout passed."""
    from mpiddp import failure
    from mpiddp.launch.diagnose import diagnose
    from mpiddp.launch.supervisor import Attempt

    clock = iter(range(100, 200))
    monkeypatch.setattr(supervisor_module.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(supervisor_module, "LOST_HOST_LINGER_S", 1.5)
    run_dir = tmp_path / "run"
    launcher = fake_open_mpi(tmp_path / "bin", "yes", tmp_path / "calls")
    plan = make_plan(["-np", "2", "--launcher-path", str(launcher), "--run-dir", str(run_dir), "--", "--epochs", "1"],
                     {})
    sup = Supervisor(plan, {"PATH": "/usr/bin:/bin"})
    attempt = Attempt(0, ["nodea", "nodeb"], [], time.time())
    assert sup._not_started(attempt, relays=True) == ""
    (run_dir / "mpiddp-agent-ended").write_text("nodeb 0\nnodec 127 prted: not found\n")
    assert sup._not_started(attempt, relays=False) == ""  # without the relays PRRTE itself notices it
    assert [sup._not_started(attempt, relays=True) for _ in range(2)] == ["", ""]  # seen; 1 s after it
    ended = ("the daemon on nodeb ended before the job started (the agent exited 0); the daemon on nodec ended "
             "before the job started (the agent exited 127: prted: not found): mpirun waits for their ranks forever "
             "under the relay layout")
    assert sup._not_started(attempt, relays=True) == ended  # 2 s after it: past LOST_HOST_LINGER_S
    found = diagnose(137, [], f"launcher output\nmpiddp launch: {ended}; ending the attempt\n", 2)
    assert (found.kind, found.hosts, found.ranks) == ("unreachable", ("nodeb", "nodec"), ())  # both, not the first
    assert found.message == ("the daemon on nodeb ended before the job started (the agent exited 0); the daemon on "
                             "nodec ended before the job started (the agent exited 127: prted: not found) (the host "
                             "went down, or Open MPI's start-up failed there)")
    sup._started_at -= plan.startup_timeout_s + 1  # as if the attempt had started that long ago
    (run_dir / "mpiddp-agent-ended").unlink()
    overdue = sup._not_started(attempt, relays=False)
    assert overdue.startswith("not every rank came through MPI's start-up within "
                              f"--startup-timeout {plan.startup_timeout_s:g} s (the job recorded no placement in "
                              f"{sup.failure_file}: ")
    lost_peer = failure.FailureRecord("exception", [0], ["nodea"], "RuntimeError: Connection closed by peer", rank=0)
    found = diagnose(137, [lost_peer], f"mpiddp launch: {overdue}; ending the attempt\n", 2)
    assert (found.kind, found.hosts, found.message, found.recorded) == ("hang", (), overdue, 1), found
    failure.write_placement(sup.failure_file, [("nodea", [0]), ("nodeb", [1])])
    (run_dir / "mpiddp-agent-ended").write_text("nodeb 0\n")
    assert sup._not_started(attempt, relays=True) == ""  # the job started: a host lost now is its records' to tell
    failure.clear(sup.failure_file)  # a read that fails later (NFS) does not make a running job a start-up hang
    assert [sup._not_started(attempt, relays=True) for _ in range(3)] == ["", "", ""]


def test_a_script_under_run_keeps_the_relaunch_path(tmp_path):
    launcher = fake_open_mpi(tmp_path / "bin", "yes", tmp_path / "calls")
    plan = make_plan(["-np", "2", "--launcher-path", str(launcher), "--run-dir", str(tmp_path / "run"), "--", "run",
                      "train.py"], {})
    assert not plan.in_job_recovery.on and "mpiddp run" in plan.in_job_recovery.why
    assert plan.in_job_recovery.add_args == ()


def test_a_host_lost_in_the_job_counts_as_a_failure_of_that_host():
    from mpiddp.launch.policy import strike_lost_in_job

    hosts = [Host(name, 1) for name in ("nodea", "nodeb.cluster", "nodec", "noded")]
    assert strike_lost_in_job([RECOVERY], hosts, [], {}) == (["nodeb.cluster"], {"nodeb.cluster": 1})
    assert strike_lost_in_job([RECOVERY], hosts, [], {}, host_strikes=2) == ([], {"nodeb.cluster": 1})
    assert strike_lost_in_job([RECOVERY], hosts, ["nodeb.cluster"], {}) == ([], {})  # already left out
    assert strike_lost_in_job([], hosts, [], {"nodea": 1}) == ([], {"nodea": 1})


def test_a_host_lost_in_the_job_is_found_by_its_slots_whatever_the_job_calls_it():
    """The job says `myhost` (socket.gethostname()) where the host list says localhost: the lost ranks, numbered
    back to the attempt's own ranks through each recovery, name the host by the attempt's slot order."""
    from mpiddp.launch.policy import ranks_lost_at_start, strike_lost_in_job

    first = {**RECOVERY, "ranks_lost": [1], "hosts_lost": ["myhost"], "world_before": 4, "world_after": 3}
    second = {**RECOVERY, "ranks_lost": [1], "hosts_lost": ["otherhost"], "world_before": 3, "world_after": 2}
    assert ranks_lost_at_start([first, second]) == (1, 2)  # the second's rank 1 was the attempt's rank 2
    assert ranks_lost_at_start([first, {**second, "world_before": 4}]) is None  # does not chain
    placed = [Host("localhost", 2), Host("10.0.0.2", 2)]
    assert strike_lost_in_job([first], placed, [], {}, placed=placed)[0] == ["localhost"]
    assert strike_lost_in_job([first, second], placed, [], {}, placed=placed)[0] == ["localhost", "10.0.0.2"]
    assert strike_lost_in_job([first], placed, [], {})[0] == []  # no slot order: by name, and none matches


def test_a_recovery_then_a_failure_that_ends_the_job_is_on_record_and_both_hosts_are_left_out(tmp_path, monkeypatch,
                                                                                                capsys):
    """The job recovers from nodeb's loss in the job, then a failure on nodec ends it before summary.json: the
    recovery, which the new rank 0 recorded in the failures directory as it happened, is in attempts.json, and the
    relaunch leaves out nodeb as well as nodec."""
    from mpiddp.failure import FailureRecord

    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "ompi_info").write_text("#!/bin/sh\necho 'options:ft_mpi_support:yes'\n")
    failed = FailureRecord("killed", [1], ["nodec"], "MPI_ERR_PROC_FAILED: ranks 1 failed", step=12, rank=0, status=1)
    launcher = folder / "mpirun"
    launcher.write_text(
        f"#!{sys.executable}\nimport json, os, sys\nfrom pathlib import Path\n"
        "from mpiddp import recoveries\nfrom mpiddp.failure import FailureRecord, write_placement, write_rank\n"
        "if sys.argv[1:] == ['--version']:\n    print('mpirun (Open MPI) 5.0.3')\n    sys.exit(0)\n"
        "run_dir, failures = Path(os.environ['MPIDDP_RUN_DIR']), Path(os.environ['MPIDDP_FAILURE_FILE'])\n"
        "if os.environ['MPIDDP_RESTART_COUNT'] != '0':\n"
        "    (run_dir / 'summary.json').write_text('{}')\n    (run_dir / 'finished').write_text('1')\n    sys.exit(0)\n"
        f"recoveries.record(failures, {RECOVERY!r})\n"
        "write_placement(failures, [('nodea', [0]), ('nodec', [1])])  # the survivors' world\n"
        f"write_rank(failures, 0, FailureRecord(**{vars(failed)!r}))\n"
        "sys.exit(1)\n")
    for program in (folder / "ompi_info", launcher):
        program.chmod(0o755)
    run_dir = tmp_path / "run"
    plan = make_plan(["-H", "nodea:1,nodeb:1,nodec:1,noded:1,nodee:1", "-np", "3", "--launcher-path", str(launcher),
                      "--run-dir", str(run_dir), "--", "--epochs", "1"], {})
    assert Supervisor(plan, {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}).run() == 0, capsys.readouterr().err
    first, second = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    assert first["recoveries"] == [RECOVERY], first
    assert set(first["excluded_hosts"]) == {"nodeb", "nodec"}, first
    assert second["hosts"] == ["nodea", "noded", "nodee"], second
    assert "without nodeb too (lost in the job earlier" in capsys.readouterr().err


def test_a_recovery_recorded_as_it_happens_is_read_back_and_cleared_with_the_attempts_records(tmp_path):
    from mpiddp import failure

    recoveries.record(tmp_path / "failures", RECOVERY)
    with (tmp_path / "failures" / failure.RECOVERIES_FILE).open("a") as out:
        out.write('{"cause": "killed", "ranks_lo')  # torn by the job's end
    assert recoveries.recorded(tmp_path / "failures") == [RECOVERY]
    assert recoveries.of_attempt(tmp_path, tmp_path / "failures", 0.0) == [RECOVERY]  # no summary.json
    (tmp_path / "summary.json").write_text(json.dumps({"recoveries": [{**RECOVERY, "step": 31}]}))
    assert recoveries.of_attempt(tmp_path, tmp_path / "failures", 0.0)[0]["step"] == 31  # the summary's, complete
    failure.clear(tmp_path / "failures")  # a new attempt: an earlier one's recoveries do not describe it
    assert recoveries.recorded(tmp_path / "failures") == []


def test_the_survivors_placement_replaces_the_one_written_at_start(tmp_path):
    """Under launch, rank 0 writes the placement at start; after a recovery a later failure's records number the
    survivors' ranks, so the new rank 0's placement must replace it (written once, it stayed the start's, and
    the later failure was blamed on the host lost before)."""
    from mpiddp.failure import read_placement, replace_placement, write_placement

    write_placement(tmp_path, [("nodea", [0]), ("nodeb", [1]), ("nodec", [2])])
    assert replace_placement(tmp_path, [("nodea", [0]), ("nodec", [1])])
    assert read_placement(tmp_path) == {0: "nodea", 1: "nodec"}


@pytest.mark.parametrize("flags,hosts,spares", [
    ([], "nodea:1,nodeb:1,nodec:2", "2"),
    (["--no-in-job-recovery"], "nodea:1,nodeb:1", None),
])
def test_the_spare_hosts_run_hot_spares_where_the_job_can_grow_back(tmp_path, monkeypatch, flags, hosts, spares):
    """With in-job recovery on, each slot of the spare host runs a hot spare: mpirun gets the host and -np two ranks
    more (--map-by slot fills the hosts in use first), and the job learns the count from MPIDDP_SPARE_RANKS (the
    last ranks of COMM_WORLD wait: mpiddp.job.spares); without in-job recovery the spare waits for a relaunch."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)  # keep pytest's own handlers
    calls, run_dir = tmp_path / "calls", tmp_path / "run"
    launcher = fake_open_mpi(tmp_path / "bin", "yes", calls)
    plan = make_plan(["-np", "2", "-H", "nodea:1,nodeb:1,nodec:2", *flags, "--launcher-path", str(launcher),
                      "--run-dir", str(run_dir), "--", "--epochs", "1"], {})
    # a value left in launch's own shell: launch alone decides the hot spares
    supervisor = Supervisor(plan, {"PATH": "/usr/bin:/bin", "MPIDDP_SPARE_RANKS": "5"})
    seen = {}
    real_build, real_start = supervisor_module.build_command, supervisor._start
    monkeypatch.setattr(supervisor_module, "build_command",
                        lambda *args, **kwargs: seen.setdefault("exports", dict(args[6])) and real_build(*args, **kwargs))
    supervisor._start = lambda command, env, number: seen.setdefault("env", env) and real_start(command, env, number)
    supervisor.run()
    (attempt,) = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    command = attempt["command"]
    assert placed_hosts(command) == hosts and attempt["num_ranks"] == 2, command
    assert seen["env"].get("MPIDDP_SPARE_RANKS") == spares
    assert command[command.index("-np") + 1] == ("4" if spares else "2"), command
    assert seen["exports"].get("MPIDDP_SPARE_RANKS") == spares and "MPIDDP_SPARE_HOSTS" not in seen["exports"]
    # the relay layout's word to the job: it may cut a silent host off (its daemon's loss no longer ends the job)
    assert seen["exports"].get("MPIDDP_HOST_RELAYS") == (None if flags else "1")
    assert ("--hostfile" in command) == (not flags)  # the relay layout: on by default with in-job recovery


def placed_hosts(command):
    """`-H`'s hosts, or the relay layout's hostfile's hosts with slots (the launch host and relays have none)."""
    if "-H" in command:
        return command[command.index("-H") + 1]
    lines = Path(command[command.index("--hostfile") + 1]).read_text().split("\n")
    entries = [line.split() for line in lines if line and not line.endswith("slots=0")]
    return ",".join(f"{name}:{slots.split('=')[1]}" for name, slots in entries)


@pytest.mark.parametrize("recovery_time", ["after the record", "not recorded"])
def test_a_recovery_that_the_failure_records_contradict_leaves_the_healthy_host_in(tmp_path, monkeypatch, capsys,
                                                                                    recovery_time):
    """Issue 33's run: rank 1 (nodeb) stopped; rank 0's watchdog recorded the hang (naming rank 1) and ended the
    job; mpirun's teardown resumed rank 1, which "recovered" from rank 0 and recorded nodea as lost. The records
    contradict that recovery (it came after the end was decided; the rank it lost recorded its own end): launch
    keeps nodea, says why, and relaunches on nodea and the spare nodec."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "ompi_info").write_text("#!/bin/sh\necho 'options:ft_mpi_support:yes'\n")
    woken = {**RECOVERY, "cause": "process_failed", "ranks_lost": [0], "hosts_lost": ["nodea"], "world_before": 2,
             "world_after": 1}
    launcher = folder / "mpirun"
    launcher.write_text(
        f"#!{sys.executable}\nimport json, os, sys, time\nfrom pathlib import Path\n"
        "from mpiddp import recoveries\nfrom mpiddp.failure import FailureRecord, write_placement, write_rank\n"
        "if sys.argv[1:] == ['--version']:\n    print('mpirun (Open MPI) 5.0.3')\n    sys.exit(0)\n"
        "run_dir, failures = Path(os.environ['MPIDDP_RUN_DIR']), Path(os.environ['MPIDDP_FAILURE_FILE'])\n"
        "if os.environ['MPIDDP_RESTART_COUNT'] != '0':\n"
        "    (run_dir / 'summary.json').write_text('{}')\n    (run_dir / 'finished').write_text('1')\n    sys.exit(0)\n"
        "write_placement(failures, [('nodea', [0]), ('nodeb', [1])])\n"
        "hang = FailureRecord('hang', [1], ['nodeb'], 'no progress for 8 s (--hang-timeout) on rank(s) 1', step=60,"
        " rank=0, status=4)\n"
        "write_rank(failures, 0, hang)\n"
        f"woken = {woken!r}\n"
        + ("woken['time'] = hang.time + 0.5\n" if recovery_time == "after the record" else "")
        + "recoveries.record(failures, woken)\nsys.exit(4)\n")
    for program in (folder / "ompi_info", launcher):
        program.chmod(0o755)
    run_dir = tmp_path / "run"
    plan = make_plan(["-H", "nodea:1,nodeb:1,nodec:1", "-np", "2", "--launcher-path", str(launcher),
                      "--run-dir", str(run_dir), "--", "--epochs", "1"], {})
    assert Supervisor(plan, {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}).run() == 0, capsys.readouterr().err
    first, second = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    assert (first["cause"], first["excluded_hosts"]) == ("hang", ["nodeb"]), first
    assert second["hosts"] == ["nodea", "nodec"], second
    said = capsys.readouterr().err
    assert "not held against any host: the in-job recovery that lost nodea" in said, said
    assert "without nodea" not in said, said


@pytest.mark.parametrize("host_list, np, spare, lost_daemon, hold", [
    ("nodea:1,nodeb:1,nodec:1", 2, "nodec", "nodec", None),  # the launcher names the host spawned onto
    ("nodea:1,nodeb:1,nodec:1,noded:1", 3, "noded", "nodec", None),  # or a survivor's host (4 of 10 benchmark runs)
    ("nodea:1,nodeb:1,nodec:1,noded:1", 3, "noded", None, None),  # or none: "double free or corruption", exit 134
    # the grow was given up at a survivor's failure: its mark holds a while (failure.hold_spawning), then not
    ("nodea:1,nodeb:1,nodec:1,noded:1", 3, "noded", "nodec", 60.0),
    ("nodea:1,nodeb:1,nodec:1,noded:1", 3, "noded", "nodec", -1.0),
])
def test_a_launcher_that_fails_during_the_jobs_spawn_is_not_evidence_against_any_host(
        tmp_path, monkeypatch, capsys, host_list, np, spare, lost_daemon, hold):
    """nodeb's rank lost and recovered from in the job; while the survivors spawned onto the spare, Open MPI
    5.0.11's prterun failed ("PMIX ERROR ... pmix_server_dyn.c", then "lost communication with a remote daemon
    ... on node X", X the spare or a survivor's host). The job's spawn mark says a spawn was under way: X is
    kept and the run relaunches without nodeb alone (before: "cannot relaunch without nodeb, X"); the crash is
    counted. A mark whose hold ran out before the launcher failed is no such evidence: X is blamed."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "ompi_info").write_text("#!/bin/sh\necho 'options:ft_mpi_support:yes'\n")
    lost = {**RECOVERY, "ranks_lost": [1], "hosts_lost": ["nodeb"], "world_before": np, "world_after": np - 1}
    before = [(f"node{letter}", [rank]) for rank, letter in enumerate("abcd"[:np])]
    after = [(host, [rank]) for rank, (host, _) in enumerate(h for h in before if h[0] != "nodeb")]
    launcher = folder / "mpirun"
    launcher.write_text(
        f"#!{sys.executable}\nimport json, os, sys, time\nfrom pathlib import Path\n"
        "from mpiddp import recoveries\nfrom mpiddp.failure import write_placement\n"
        "if sys.argv[1:] == ['--version']:\n    print('mpirun (Open MPI) 5.0.3')\n    sys.exit(0)\n"
        "run_dir, failures = Path(os.environ['MPIDDP_RUN_DIR']), Path(os.environ['MPIDDP_FAILURE_FILE'])\n"
        "if os.environ['MPIDDP_RESTART_COUNT'] != '0':\n"
        "    (run_dir / 'summary.json').write_text('{}')\n    (run_dir / 'finished').write_text('1')\n    sys.exit(0)\n"
        f"write_placement(failures, {before!r})\n"
        f"recoveries.record(failures, {{**{lost!r}, 'time': time.time()}})\n"
        f"write_placement(failures, {after!r})\n"
        f"(failures / 'spawning.json').write_text(json.dumps({{'hosts': [{spare!r}], 'time': time.time()"
        + ("" if hold is None else f", 'until': time.time() + {hold!r}") + "}))\n"
        "print('[nodea:01234] PMIX ERROR: UNREACHABLE in file server/pmix_server_dyn.c at line 1113')\n"
        + ("print('double free or corruption (!prev)', file=sys.stderr)\nsys.exit(134)\n" if lost_daemon is None else
           "print('PRTE has lost communication with a remote daemon.\\n\\n  HNP daemon   : [prterun-nodea-1@0,0] on "
           f"node nodea\\n  Remote daemon: [prterun-nodea-1@0,2] on node {lost_daemon}\\n\\nThis is usually due to "
           "either a failure of the TCP network\\nconnection to the node, or possibly an internal failure of\\nthe "
           "daemon itself. We cannot recover from this failure, and\\ntherefore will terminate the job.', "
           "file=sys.stderr)\nsys.exit(1)\n"))
    for program in (folder / "ompi_info", launcher):
        program.chmod(0o755)
    run_dir = tmp_path / "run"
    plan = make_plan(["-H", host_list, "-np", str(np), "--launcher-path", str(launcher),
                      "--run-dir", str(run_dir), "--", "--epochs", "1"], {})
    outcome = Supervisor(plan, {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}).run()
    if hold is not None and hold < 0:
        first = json.loads((run_dir / "attempts.json").read_text())["attempts"][0]
        assert first["blamed_hosts"] == [lost_daemon] and first["launcher_crash"] == "", first
        return
    assert outcome == 0, capsys.readouterr().err
    first, second = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    assert first["excluded_hosts"] == ["nodeb"] and first["blamed_hosts"] == [], first
    assert first["launcher_crash"] == f"during the job's spawn onto {spare}", first
    assert second["hosts"] == [h for h in ("nodea", "nodec", "noded")[:np]], second
    said = capsys.readouterr().err
    if lost_daemon is not None:
        assert f"a launcher's failure during a spawn is not held against {lost_daemon}" in said, said


@pytest.mark.parametrize("status, lost_a_before_the_end", [(134, 0.0), (1, 0.0), (134, 30.0)],
                         ids=["crash-took-nodea", "exit-1", "nodea-lost-earlier"])
def test_a_launcher_that_crashes_after_the_jobs_spawn_ended_is_not_evidence_against_the_hosts_it_took_down(
        tmp_path, monkeypatch, capsys, status, lost_a_before_the_end):
    """Seen in CI: nodeb's rank lost, the job grew back onto noded (the spawn ended: the new rank joined), then
    Open MPI 5.0.11's prterun aborted ("corrupted size vs. prev_size", exit 134): the rank on its host, nodea,
    ended with it and the rank on noded recorded an in-job recovery from rank 0's loss. That recovery is the
    launcher's doing: nodea is kept and the run relaunches without nodeb alone (before: "cannot relaunch without
    nodea, nodeb"). A launcher that merely exits 1 after a spawn is no crash, and a loss 30 s before the crash
    (after the spawn) is a loss of its own: in both, the recovery stands."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "ompi_info").write_text("#!/bin/sh\necho 'options:ft_mpi_support:yes'\n")
    lost_b = {**RECOVERY, "cause": "process_failed", "ranks_lost": [1], "hosts_lost": ["nodeb"]}
    grew = {"cause": "grew", "ranks_added": [2], "hosts_added": ["noded"], "world_before": 2, "world_after": 3}
    lost_a = {**RECOVERY, "cause": "process_failed", "ranks_lost": [0], "hosts_lost": ["nodea"]}
    launcher = folder / "mpirun"
    launcher.write_text(
        f"#!{sys.executable}\nimport json, os, sys, time\nfrom pathlib import Path\n"
        "from mpiddp import failure, recoveries\n"
        "if sys.argv[1:] == ['--version']:\n    print('mpirun (Open MPI) 5.0.3')\n    sys.exit(0)\n"
        "run_dir, failures = Path(os.environ['MPIDDP_RUN_DIR']), Path(os.environ['MPIDDP_FAILURE_FILE'])\n"
        "if os.environ['MPIDDP_RESTART_COUNT'] != '0':\n"
        "    (run_dir / 'summary.json').write_text('{}')\n    (run_dir / 'finished').write_text('1')\n    sys.exit(0)\n"
        "now = time.time()\n"
        "failure.write_placement(failures, [('nodea', [0]), ('nodeb', [1]), ('nodec', [2])])\n"
        f"recoveries.record(failures, {{**{lost_b!r}, 'time': now - 120}})\n"
        "(failures / failure.SPAWNING_FILE).write_text(json.dumps({'hosts': ['noded'], 'time': now - 60}))\n"
        "failure.spawned(failures)\n"
        f"recoveries.record(failures, {{**{grew!r}, 'time': now - 59}})\n"
        "failure.replace_placement(failures, [('nodea', [0]), ('nodec', [1]), ('noded', [2])])\n"
        f"recoveries.record(failures, {{**{lost_a!r}, 'time': now - {lost_a_before_the_end!r}}})\n"
        "print('corrupted size vs. prev_size', file=sys.stderr)\n"
        f"sys.exit({status})\n")
    for program in (folder / "ompi_info", launcher):
        program.chmod(0o755)
    run_dir = tmp_path / "run"
    plan = make_plan(["-H", "nodea:1,nodeb:1,nodec:1,noded:1", "-np", "3", "--launcher-path", str(launcher),
                      "--run-dir", str(run_dir), "--max-restarts", "1", "--", "--epochs", "1"], {})
    outcome = Supervisor(plan, {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}).run()
    said = capsys.readouterr().err
    first = json.loads((run_dir / "attempts.json").read_text())["attempts"][0]
    crash = "after the job's spawn onto noded (exit status 134)"
    if status == 1 or lost_a_before_the_end:
        assert first["launcher_crash"] == ("" if status == 1 else crash), first
        assert "cannot relaunch without nodea, nodeb" in said, said
        return
    assert outcome == 0, said
    first, second = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    assert first["launcher_crash"] == crash, first
    assert (first["excluded_hosts"], first["blamed_hosts"]) == (["nodeb"], []), first
    assert second["hosts"] == ["nodea", "nodec", "noded"], second
    assert f"not held against any host: the in-job recovery that lost nodea came as the launcher failed {crash}" \
        in said, said


@pytest.mark.parametrize("job_names_its_run_dir", [False, True])
def test_a_launcher_that_waits_for_a_host_the_job_lost_is_ended_soon_after_the_mark(tmp_path, monkeypatch, capsys,
                                                                                     job_names_its_run_dir):
    """Open MPI's mpirun waits forever for the ranks of a host that crashed (the relay layout survives it): launch
    learns the lost host from the job's records, ends the launcher LOST_HOST_LINGER_S after the mark, and takes
    the job as finished, not as a launcher crash. Also when training's own --run-dir names where it writes (its
    mark is there, while the attempt runs: once, it was never seen and mpirun was never ended)."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    monkeypatch.setattr(supervisor_module, "LOST_HOST_LINGER_S", 0.2)
    monkeypatch.setattr(supervisor_module, "end_daemons", lambda *args, **kwargs: None)  # nodeb, nodec: not real
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    launcher = fake_open_mpi(tmp_path / "bin", "yes", tmp_path / "calls", lingers=True,
                             job_dir=run_dir if job_names_its_run_dir else None)
    own = [] if job_names_its_run_dir else ["--run-dir", str(run_dir)]
    plan = make_plan(["-np", "2", "-H", "nodea:1,nodeb:1,nodec:1", "--launcher-path", str(launcher), *own, "--",
                      "--epochs", "1"], {})
    assert plan.relay_layout.on
    assert Supervisor(plan, {"PATH": "/usr/bin:/bin"}).run() == 0
    (attempt,) = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    assert (attempt["status"], attempt["decision"], attempt["launcher_crash"]) == (0, "finished", ""), attempt
    said = capsys.readouterr().err
    assert "the job marked its end after losing nodeb in the job (its records)" in said, said
    assert "the launcher exited" not in said, said
    if job_names_its_run_dir:  # launch's own run dir, the relay layout's files in it too, went with its records
        assert list((tmp_path / "runs").iterdir()) == []


@pytest.mark.parametrize("finishes, status", [(False, 0), (True, 139)])
def test_a_script_under_fault_tolerance_is_finished_only_with_its_finished_mark(tmp_path, monkeypatch, capsys,
                                                                                finishes, status):
    """`launch ... run` with --with-ft ulfm: `mpiddp run` marks the end once every rank finished the script, as
    training does. Without the mark a 0 is no proof (mpirun --with-ft ulfm exits 0 when every rank was killed: a
    relaunch); with it, a launcher that crashed afterwards (Open MPI 5.0.11's, after a grow) is a finished job."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    run_dir = tmp_path / "run"
    launcher = fake_open_mpi(tmp_path / "bin", "yes", tmp_path / "calls", finishes=finishes, status=status)
    plan = make_plan(["-np", "2", "--launcher-path", str(launcher), "--launcher-args", "--with-ft ulfm",
                      "--max-restarts", "1", "--run-dir", str(run_dir), "--", "run", "x.py"], {})
    assert plan.mode == "run" and plan.in_job_recovery.on
    outcome = Supervisor(plan, {"PATH": "/usr/bin:/bin"}).run()
    attempts = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    if finishes:
        assert outcome == 0 and [(a["status"], a["decision"]) for a in attempts] == [(0, "finished")], attempts
    else:
        assert outcome != 0 and len(attempts) == 2 and all(a["decision"] != "finished" for a in attempts), attempts


def test_a_scripts_launcher_is_never_ended_for_lingering_after_its_finished_mark(tmp_path, monkeypatch, capsys):
    """A script's own exit handlers (wandb.finish, an upload) run after `mpiddp run` marked the end: launch waits
    for the launcher as it always did, unlike training's, which it ends FINISHED_LINGER_S after the mark."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    monkeypatch.setattr(supervisor_module, "FINISHED_LINGER_S", 0.1)
    run_dir = tmp_path / "run"
    launcher = fake_open_mpi(tmp_path / "bin", "yes", tmp_path / "calls", lingers=3.5)  # launch polls each 1 s
    plan = make_plan(["-np", "2", "--launcher-path", str(launcher), "--launcher-args", "--with-ft ulfm",
                      "--run-dir", str(run_dir), "--", "run", "x.py"], {})
    assert Supervisor(plan, {"PATH": "/usr/bin:/bin"}).run() == 0
    (attempt,) = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    assert (attempt["status"], attempt["decision"], attempt["launcher_crash"]) == (0, "finished", ""), attempt
    assert "after the job marked its end: ending it" not in capsys.readouterr().err
