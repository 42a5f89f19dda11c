"""The launch layer, in-process: host lists from every source, launcher command lines, the restart policy."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, run_supervisor
from mpiddp.failure import FailureRecord
from mpiddp.launch.cli import LaunchError, make_plan
from mpiddp.launch.command import build_command, choose_launcher, mpi_flavour
from mpiddp.launch.diagnose import Failure, diagnose, killed_by_signal
from mpiddp.launch.hosts import (Host, HostListError, discover, expand_nodelist, expand_tasks_per_node, from_pbs,
                                 parse_host_option, parse_hostfile, place)
from mpiddp.launch.policy import decide
from mpiddp.launch import supervisor
from mpiddp.launch.supervisor import (Attempt, Plan, Supervisor, earlier_launches, follow_job, job_exports, ranks_on,
                                      write_attempts)


def test_importing_launch_starts_no_mpi_and_no_torch_distributed():
    code = ("import sys, mpiddp.launch, mpiddp.launch.cli, mpiddp.launch.supervisor;"
            "print([m for m in ('mpi4py', 'torch.distributed') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_launch_layer_never_imports_trainer_job_torch_or_numpy(tmp_path):
    """launch learns what it needs from the job's records and the environment, never from trainer code."""
    import re

    forbidden = re.compile(r"^\s*(?:from|import)\s+(mpiddp\.trainer|mpiddp\.job|torch|numpy|mpi4py)\b", re.M)
    for path in sorted((REPO / "mpiddp" / "launch").glob("*.py")):
        assert not forbidden.findall(path.read_text()), path
    # and not at run time either: a plan with --min-np used to parse the training flags with trainer.config
    code = ("import sys; from mpiddp.launch.cli import make_plan;"
            "make_plan(['-np', '2', '--min-np', '1', '--run-dir', sys.argv[1], '--', '--epochs', '1'], {});"
            "print([m for m in sys.modules if m.startswith(('mpiddp.trainer', 'torch'))])")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert done.stdout.strip() == "[]", done.stderr


def test_hostfile_in_open_mpi_and_mpich_form():
    text = "# comment\nnodea slots=8 max_slots=8\nnodeb:4\n\nnodec  # one slot\nnodea slots=2\n"
    assert parse_hostfile(text) == [Host("nodea", 10), Host("nodeb", 4), Host("nodec", 1)]
    with pytest.raises(HostListError, match="line 1"):
        parse_hostfile("nodea slots=many\n")
    with pytest.raises(HostListError, match="no host"):
        parse_hostfile("# nothing\n")


def test_host_option():
    assert parse_host_option("a:8,b:8,c") == [Host("a", 8), Host("b", 8), Host("c", 1)]
    with pytest.raises(HostListError):
        parse_host_option("a:x")


def test_slurm_node_lists_and_tasks_per_node():
    assert expand_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert expand_nodelist("rack[1-2]-n[8-9]") == ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]
    assert expand_nodelist("solo") == ["solo"]
    assert expand_tasks_per_node("8(x2),4") == [8, 8, 4]
    env = {"SLURM_JOB_NODELIST": "node[01-03,07],gpu5", "SLURM_TASKS_PER_NODE": "8(x3),4(x2)", "SLURM_JOB_ID": "7"}
    hosts, source = discover(None, None, env)
    assert hosts == [Host("node01", 8), Host("node02", 8), Host("node03", 8), Host("node07", 4), Host("gpu5", 4)]
    assert source == "Slurm allocation 7"
    with pytest.raises(HostListError, match="5 nodes"):
        discover(None, None, {**env, "SLURM_TASKS_PER_NODE": "8(x2)"})


def test_pbs_nodefile_one_line_per_slot(tmp_path):
    assert from_pbs("n1\nn1\nn2\nn1\n") == [Host("n1", 3), Host("n2", 1)]
    nodefile = tmp_path / "nodes"
    nodefile.write_text("n1\nn2\nn2\n")
    assert discover(None, None, {"PBS_NODEFILE": str(nodefile)})[0] == [Host("n1", 1), Host("n2", 2)]


def test_the_explicit_list_wins_and_both_is_an_error(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("x:2\n")
    slurm = {"SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "1"}
    assert discover(str(hostfile), None, slurm)[0] == [Host("x", 2)]
    assert discover(None, "y:3", slurm)[0] == [Host("y", 3)]
    assert discover(None, None, {}) == ([], "this host")
    with pytest.raises(HostListError, match="not both"):
        discover(str(hostfile), "y:3", {})
    with pytest.raises(HostListError, match="cannot read"):
        discover(str(tmp_path / "missing"), None, {})


def test_placement_and_spares():
    hosts = [Host("a", 1), Host("b", 1), Host("c", 1)]
    assert place(hosts, 2) == ([Host("a", 1), Host("b", 1)], [Host("c", 1)])
    assert place([Host("a", 8), Host("b", 8)], 12) == ([Host("a", 8), Host("b", 4)], [])
    with pytest.raises(HostListError, match="needs 4 slots"):
        place(hosts, 4)


def test_which_mpi_and_which_launcher():
    assert mpi_flavour("mpirun (Open MPI) 5.0.11\n") == "openmpi"
    assert mpi_flavour("HYDRA build details:\n    Version: 4.2\n") == "mpich"
    assert choose_launcher("auto", {}, "openmpi") == "mpirun"
    assert choose_launcher("auto", {}, "mpich") == "mpiexec"
    assert choose_launcher("srun", {}, "openmpi") == "srun"


def test_command_lines():
    hosts = [Host("a", 1), Host("c", 1)]
    inner = ["--epochs", "2"]
    openmpi = build_command("mpirun", "mpirun", "openmpi", hosts, 2, inner, {"V": "1"}, ["b"], ["--mca", "x", "y"], "py")
    assert openmpi == ["mpirun", "-np", "2", "-H", "a:1,c:1", "--bind-to", "none", "--map-by", "slot", "-x", "V",
                       "--mca", "x", "y", "py", "-m", "mpiddp", "--epochs", "2"]
    # -genv adds to the environment Hydra forwards; -genvlist would forward only the variables it names
    mpich = build_command("mpiexec", "mpiexec", "mpich", hosts, 2, inner, {"V": "1", "W": "x y"}, ["b"], [], "py")
    assert mpich == ["mpiexec", "-n", "2", "-hosts", "a:1,c:1", "-bind-to", "none", "-genv", "V", "1",
                     "-genv", "W", "x y", "py", "-m", "mpiddp", "--epochs", "2"]
    srun = build_command("srun", "srun", "openmpi", hosts, 2, inner, {"V": "1"}, ["b"], [], "py")
    assert srun == ["srun", "--mpi=pmix", "--ntasks=2", "--nodes=2", "--nodelist=a,c", "--kill-on-bad-exit=1",
                    "--cpu-bind=none", "--exclude=b", "py", "-m", "mpiddp", "--epochs", "2"]
    assert "--mpi=pmi2" in build_command("srun", "srun", "mpich", hosts, 2, inner, {}, [], [], "py")
    chosen = build_command("srun", "srun", "mpich", hosts, 2, inner, {}, [], ["--mpi=cray_shasta"], "py")
    assert [arg for arg in chosen if arg.startswith("--mpi")] == ["--mpi=cray_shasta"]
    assert "-H" not in build_command("mpirun", "mpirun", "openmpi", [], 2, inner, {}, [], [], "py")


THREE = [Host("a", 1), Host("b", 1), Host("c", 1)]


def test_policy_excludes_the_failed_host_and_uses_a_spare():
    decision = decide(Failure("killed", 137, (1,), ("b",)), THREE, [], 0, 3, 2)
    assert decision.retry and decision.hosts == [Host("a", 1), Host("c", 1)] and decision.excluded == ["b"]
    assert "without b" in decision.reason


def test_policy_never_retries_user_errors_or_stops():
    for kind, status in (("user_error", 2), ("stopped", 3), ("stopped", 130)):
        decision = decide(Failure(kind, status, (0,), ("a",)), THREE, [], 0, 3, 2)
        assert not decision.retry and decision.hosts == []


def test_policy_stops_when_restarts_are_spent_or_hosts_run_out():
    spent = decide(Failure("exception", 1, (0,), ("a",)), THREE, [], 3, 3, 2)
    assert not spent.retry and "--max-restarts 3 spent" in spent.reason and spent.excluded == ["a"]
    short = decide(Failure("hang", 4, (1,), ("b",)), THREE, ["c"], 1, 3, 2)
    assert not short.retry and "needs 2 slots" in short.reason and short.excluded == ["c", "b"]


def test_policy_with_no_host_to_blame_retries_on_the_same_hosts():
    decision = decide(Failure("exit", 1), THREE, [], 0, 3, 2)
    assert decision.retry and decision.hosts == [Host("a", 1), Host("b", 1)] and decision.excluded == []
    local = decide(Failure("exception", 1, (0,), ("here",)), [], [], 0, 1, 2)
    assert local.retry and local.hosts == []
    assert not decide(Failure("exit", 0), THREE, [], 0, 3, 2).retry



def test_policy_host_strikes_keep_a_failed_host_until_its_nth_failure():
    lone = [Host("n1", 2)]
    # the default leaves a failed host out at once: with no spare that ends the run, saying what would continue it
    stop = decide(Failure("killed", 137, (1,), ("n1",)), lone, [], 0, 3, 2)
    assert not stop.retry and stop.excluded == ["n1"] and "--host-strikes 2" in stop.reason
    first = decide(Failure("killed", 137, (1,), ("n1",)), lone, [], 0, 3, 2, lone, strikes={}, host_strikes=2)
    assert first.retry and first.hosts == lone and first.excluded == [] and first.strikes == {"n1": 1}
    assert "same hosts (killed; n1: failure 1 of --host-strikes 2)" in first.reason
    second = decide(Failure("killed", 137, (1,), ("n1",)), lone, [], 1, 3, 2, lone, strikes=first.strikes, host_strikes=2)
    assert not second.retry and second.excluded == ["n1"] and "--host-strikes 2" not in second.reason
    # with a spare: the host stays until its second failure, then the spare replaces it
    kept = decide(Failure("hang", 4, (1,), ("b",)), THREE, [], 0, 3, 2, THREE[:2], strikes={"a": 1}, host_strikes=2)
    assert kept.hosts == THREE[:2] and kept.strikes == {"a": 1, "b": 1}
    gone = decide(Failure("hang", 4, (1,), ("b",)), THREE, [], 1, 3, 2, THREE[:2], strikes=kept.strikes, host_strikes=2)
    assert gone.hosts == [Host("a", 1), Host("c", 1)] and gone.excluded == ["b"] and "without b" in gone.reason


def test_the_supervisor_counts_strikes_across_attempts(tmp_path, monkeypatch):
    plan = Plan("train", ["--epochs", "1"], tmp_path, 2, THREE, [], 3, "srun", "srun", "openmpi", host_strikes=2)
    sup = Supervisor(plan, {})
    placements = []

    def fake_attempt(number, hosts, excluded):
        placements.append([h.name for h in hosts])
        attempt = Attempt(number, [h.name for h in hosts], ["srun"], time.time(), status=0 if number == 2 else 1)
        sup.attempts.append(attempt)
        return attempt, "srun: error: b: task 1: Killed\n"

    monkeypatch.setattr(sup, "_attempt", fake_attempt)
    assert run_supervisor(sup) == 0
    assert placements == [["a", "b"], ["a", "b"], ["a", "c"]]
    assert [a.excluded_hosts for a in sup.attempts] == [[], ["b"], ["b"]]


def test_host_strikes_must_be_positive(tmp_path):
    with pytest.raises(LaunchError, match="--host-strikes must be >= 1"):
        make_plan(["-np", "2", "--host-strikes", "0", "--run-dir", str(tmp_path), "--", "run", "x.py"], {})
    plan = make_plan(["-np", "2", "--host-strikes", "2", "--run-dir", str(tmp_path), "--", "run", "x.py"], {})
    assert plan.host_strikes == 2

OPENMPI_KILLED = """--------------------------------------------------------------------------
prterun noticed that process rank 1 with PID 4242 on node nodeb exited on
signal 9 (Killed).
--------------------------------------------------------------------------
"""
HYDRA_KILLED = """===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   RANK 3 PID 77 RUNNING AT gpu7
=   KILLED BY SIGNAL: 9 (Killed)
===================================================================================
"""

HYDRA5_KILLED = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 3930 RUNNING AT nodeb
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
This typically refers to a problem with your application.
"""  # MPICH 5.0.2's mpiexec, rank 1 on nodeb SIGKILLed


def test_launcher_output_names_the_killed_rank_and_host():
    assert killed_by_signal(OPENMPI_KILLED) == ((1,), ("nodeb",), 9)
    assert killed_by_signal(HYDRA_KILLED) == ((3,), ("gpu7",), 9)
    assert killed_by_signal(HYDRA5_KILLED) == ((), ("nodeb",), 9)
    aborted = HYDRA5_KILLED.split("YOUR APPLICATION TERMINATED")[0] + "[mpiexec@nodea] main: process manager error\n"
    assert killed_by_signal(aborted) == ((), ("nodeb",), 9)  # mpiexec aborted on a lost remote proxy
    assert killed_by_signal("srun: error: node2: tasks 2-3: Killed\n") == ((2, 3), ("node2",), 9)
    assert killed_by_signal("all good\n") is None
    assert killed_by_signal(OPENMPI_PEER_LOST) == ((), ("nodeb",), 9)


OPENMPI_PEER_LOST = """--------------------------------------------------------------------------
An MPI communication peer process has unexpectedly disconnected.  This
usually indicates a failure in the peer process (e.g., a crash or
otherwise exiting without calling MPI_FINALIZE first).

  Local host: nodea
  Local PID:  14005
  Peer host:  nodeb
--------------------------------------------------------------------------
"""


def test_diagnosis_prefers_a_killed_rank_over_a_consequent_exception_record():
    consequence = FailureRecord("exception", [0], ["nodea"], "gloo: connection closed by peer", step=7)
    failure = diagnose(137, consequence, OPENMPI_KILLED)
    assert (failure.kind, failure.ranks, failure.hosts, failure.step) == ("killed", (1,), ("nodeb",), 7)
    hang = FailureRecord("hang", [1], ["nodeb"], "rank 1 made no progress", step=5)
    assert diagnose(4, hang, OPENMPI_KILLED).kind == "hang"  # the watchdog knew first
    assert diagnose(2, None, "").kind == "user_error"
    assert diagnose(3, None, "").kind == "stopped"
    assert diagnose(1, None, "").kind == "exit"


def test_launch_tells_the_job_through_the_environment_and_never_rewrites_its_flags(tmp_path):
    from mpiddp import contract

    plan = Plan("train", ["--epochs", "2", "--resume"], tmp_path, 2, [], [], 3, "mpirun", "mpirun", "openmpi",
                min_np=1)
    exports = job_exports(plan, 1, "L1")
    assert exports[contract.RESTART_COUNT_ENV] == "1" and exports[contract.LAUNCH_ID_ENV] == "L1"
    assert exports[contract.RUN_DIR_ENV] == str(tmp_path.resolve())
    assert exports[contract.JOB_RECORD_ENV] == str(tmp_path.resolve() / "job.json")
    assert contract.GLOBAL_BATCH_ENV not in exports  # unknown until the job recorded it
    assert exports[contract.MIN_NP_ENV] == "1"  # in-job recovery shrinks no further than a relaunch would
    record = contract.JobRecord(str(tmp_path / "elsewhere"), str(tmp_path / "ck"), 2, 96, 16)
    followed = follow_job(plan, record)
    assert followed.run_dir == tmp_path / "elsewhere" and followed.global_batch == (96, 16)
    assert job_exports(followed, 2, "L1")[contract.GLOBAL_BATCH_ENV] == "96"
    assert follow_job(plan, None) == plan
    script = Plan("run", ["run", "s.py", "--resume"], tmp_path, 2, [], [], 3, "mpirun", "mpirun", "openmpi")
    exported = job_exports(script, 2, "L1")  # `mpiddp run` marks the job's end there; a script keeps no job record
    assert exported[contract.RUN_DIR_ENV] == str(tmp_path.resolve()) and contract.JOB_RECORD_ENV not in exported
    assert contract.MIN_NP_ENV not in job_exports(script, 2, "L1")  # no --min-np: in-job recovery's own floor


@pytest.mark.parametrize("flags", [["--run-d", "mydir"], ["--run-dir=mydir", "--resu", "x.pt"],
                                   ["--checkpoint", "ck", "--resume"], ["--runs-root", "elsewhere"]])
def test_launch_passes_the_job_flags_through_unread(tmp_path, flags):
    """The training parser takes abbreviations: launch used to miss `--run-d` and add its own --run-dir, so the
    job wrote elsewhere. Now the flags go through untouched, and the job's own parser decides."""
    plan = make_plan(["-np", "2", "--run-dir", str(tmp_path / "launch"), "--", *flags], {})
    assert plan.inner == flags and plan.global_batch is None


def test_the_jobs_own_run_dir_flag_wins_over_launchs(tmp_path):
    from types import SimpleNamespace

    from mpiddp.trainer.run import launch_run_dir
    from mpiddp.trainer.config import parse_args

    topo = SimpleNamespace(launch_run_dir=str(tmp_path / "launch"))
    given = parse_args(["--run-d", "mydir"])
    assert given.outputs.run_dir == "mydir"  # the caller takes it first: `cfg.run_dir or launch_run_dir(...)`
    assert launch_run_dir(parse_args([]).outputs, topo) == str(tmp_path / "launch")
    assert launch_run_dir(parse_args(["--runs-r", "elsewhere"]).outputs, topo) is None  # a new directory under it
    assert launch_run_dir(parse_args([]).outputs, SimpleNamespace(launch_run_dir="")) is None  # not under launch
    # a relaunch is told the directory the first attempt made under --runs-root, and keeps it (found by an outside
    # review: each attempt made a new one and started from scratch)
    followed = SimpleNamespace(launch_run_dir=str(tmp_path / "root" / "20261124-040400"))
    assert launch_run_dir(parse_args(["--runs-root", str(tmp_path / "root")]).outputs, followed) == followed.launch_run_dir


def test_a_run_dir_launch_cannot_write_in_is_one_line_before_any_attempt():
    with pytest.raises(LaunchError, match="cannot write in the run directory /proc"):
        make_plan(["-np", "1", "--run-dir", "/proc", "--", "--epochs", "1"], {})


def test_the_global_batch_of_a_shrunk_relaunch_comes_from_the_environment(monkeypatch):
    from mpiddp import contract
    from mpiddp.trainer.config import parse_args

    monkeypatch.setenv(contract.GLOBAL_BATCH_ENV, "96")
    assert parse_args(["--batch-size", "16"]).for_world(1).training.grad_accum == 6
    assert parse_args(["--global-b", "32"]).training.global_batch == 32  # the user's flag wins


def test_attempts_of_earlier_launches_in_the_run_dir_are_kept(tmp_path):
    first = [Attempt(0, ["a"], ["mpirun"], 1.0, status=1), Attempt(1, ["a"], ["mpirun"], 2.0, status=0)]
    assert write_attempts(tmp_path / "attempts.json", first)
    earlier, launch = earlier_launches(tmp_path)
    assert launch == 1 and [a["number"] for a in earlier] == [0, 1]
    again = [Attempt(0, ["a"], ["mpirun"], 3.0, status=None, launch=launch)]
    assert write_attempts(tmp_path / "attempts.json", again, earlier)
    data = json.loads((tmp_path / "attempts.json").read_text())
    assert data["restarts"] == 2 and [(a["launch"], a["number"]) for a in data["attempts"]] == [(0, 0), (0, 1), (1, 0)]
    assert earlier_launches(tmp_path)[1] == 2
    assert earlier_launches(tmp_path / "none") == ([], 0)


def test_help_needs_no_job(capsys):
    from mpiddp.main import main

    assert main(["launch", "--help"]) == 0  # dispatched before any MPI or torch import
    assert "relaunch" in capsys.readouterr().out


def test_plan_from_the_command_line(tmp_path):
    plan = make_plan(["-H", "a:1,b:1,c:1", "-np", "2", "--exclude", "a", "--launcher", "mpirun",
                      "--run-dir", str(tmp_path / "r"), "--", "--epochs", "1"], {})
    assert plan.mode == "train" and plan.num_ranks == 2 and plan.excluded == ["a"]
    assert plan.run_dir == tmp_path / "r" and plan.inner == ["--epochs", "1"] and not plan.made_run_dir
    given = make_plan(["-np", "2", "--run-dir", str(tmp_path / "r"), "--", "run", "x.py"], {})
    assert given.mode == "run" and given.run_dir == tmp_path / "r" and given.inner == ["run", "x.py"]
    for bad, message in ((["-np", "2", "--epochs"], "after `--`"), (["-np", "2", "--", "check"], "not `check`"),
                         (["-H", "a:1", "-np", "2", "--", "--epochs", "1"], "needs 2 slots"),
                         (["--", "--epochs", "1"], "give -np")):
        with pytest.raises((LaunchError, HostListError), match=message):
            make_plan(bad, {})


def test_ranks_of_a_host_follow_from_the_placement():
    assert ranks_on([Host("a", 2), Host("b", 3), Host("c", 1)], ("b",)) == (2, 3, 4)
    assert ranks_on([Host("a", 1), Host("b", 1)], ("a", "b")) == (0, 1)
    assert ranks_on([], ("a",)) == ()


def test_exception_record_outranks_the_launcher_killing_the_other_ranks():
    raised = FailureRecord("exception", [0], ["nodea"], "ValueError: bad batch", step=3)
    failure = diagnose(1, raised, "srun: error: nodeb: task 1: Terminated\n")
    assert (failure.kind, failure.ranks, failure.hosts, failure.source) == ("exception", (0,), ("nodea",),
                                                                             "failure record")
    assert diagnose(1, raised, HYDRA_KILLED).kind == "exception"  # Hydra's clean-up of the other ranks
    lost = FailureRecord("exception", [0], ["nodea"], "RuntimeError: [gloo] Connection reset by peer", step=3)
    assert diagnose(137, lost, HYDRA_KILLED).hosts == ("gpu7",)
    srun = ("srun: error: nodea: task 0: Killed\nsrun: launch/slurm: _step_signal: Terminating StepId=5.0\n"
            "slurmstepd: error: *** STEP 5.0 ON nodeb CANCELLED AT 2026-11-23T10:00:00 ***\n"
            "srun: error: nodeb: task 1: Terminated\n")
    assert killed_by_signal(srun) == ((0,), ("nodea",), 9)


def test_policy_maps_the_failed_ranks_through_the_placement():
    hosts = [Host("10.0.0.1", 2), Host("10.0.0.2", 2), Host("10.0.0.3", 2)]
    record = Failure("exception", 1, (2,), ("nodeb.cluster.example.org",))
    decision = decide(record, hosts, [], 0, 3, 4, hosts[:2])
    assert decision.excluded == ["10.0.0.2"] and decision.hosts == [hosts[0], hosts[2]]
    by_ip = decide(Failure("killed", 137, (), ("10.0.0.2",)), hosts, [], 0, 3, 4, hosts[:2])
    assert by_ip.excluded == ["10.0.0.2"]  # an address is not shortened to "10"


def test_policy_compares_host_names_by_short_name():
    decision = decide(Failure("hang", 4, (), ("b.cluster.example.org",)), THREE, [], 0, 3, 2)
    assert decision.excluded == ["b"] and decision.hosts == [Host("a", 1), Host("c", 1)]
    fqdn = [Host("a.x", 1), Host("b.x", 1), Host("c.x", 1)]
    assert decide(Failure("hang", 4, (), ("b",)), fqdn, [], 0, 3, 2).excluded == ["b.x"]
    assert ranks_on(fqdn, ("b",)) == (1,)


def _plan(tmp_path, mode="train"):
    inner = ["--epochs", "1"] if mode == "train" else ["run", "s.py"]
    return Plan(mode, inner, tmp_path, 2, [], [], 3, "mpirun", "mpirun", "openmpi")


def test_a_script_is_stopped_with_sigterm_and_training_with_sigusr1(tmp_path):
    assert Supervisor(_plan(tmp_path), {}).child_stop == signal.SIGUSR1
    assert Supervisor(_plan(tmp_path, "run"), {}).child_stop == signal.SIGTERM


def test_the_third_ctrl_c_kills_the_launcher_group(tmp_path, capfd):
    sup = Supervisor(_plan(tmp_path), {})
    code = ("import signal, sys, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN);"
            "print('ready', flush=True); time.sleep(120)")
    sup.child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                 start_new_session=True)
    try:
        assert sup.child.stdout.readline() == "ready\n"
        sup._forward(signal.SIGINT, None)
        sup._forward(signal.SIGINT, None)
        assert sup.child.poll() is None  # two Ctrl-C: a stop, still saving
        assert "Ctrl-C twice more kills the job" in capfd.readouterr().err
        sup._forward(signal.SIGINT, None)
        assert sup.child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if sup.child.poll() is None:
            sup.child.kill()
        sup.child.wait()


def test_a_stop_between_attempts_starts_nothing_and_sighup_is_ignored(tmp_path, monkeypatch):
    sup = Supervisor(_plan(tmp_path), {})
    started = []

    def fake_attempt(number, hosts, excluded):
        attempt = Attempt(number, [], ["mpirun"], time.time(), status=1)
        sup.attempts.append(attempt)
        started.append(number)
        return attempt, ""

    def stop_then_decide(*args, **kwargs):
        sup.stop_signal = signal.SIGTERM  # arrives after the attempt ended, before the next began
        return decide(*args, **kwargs)

    monkeypatch.setattr(sup, "_attempt", fake_attempt)
    monkeypatch.setattr(supervisor, "decide", stop_then_decide)
    saved = {signum: signal.getsignal(signum) for signum in (*supervisor.FORWARDED, signal.SIGHUP)}
    try:
        assert sup.run() == 3
        assert signal.getsignal(signal.SIGHUP) is supervisor._ignore_hangup
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    assert started == [0]


def test_unwritable_run_dir_and_attempts_file_are_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(LaunchError, match="cannot create the run directory"):
        make_plan(["-np", "2", "--run-dir", str(blocker / "r"), "--", "run", "x.py"], {})
    assert not write_attempts(blocker / "attempts.json", [])
    assert "warning: cannot write" in capsys.readouterr().err


# --- --min-np: with no spare left, fewer ranks at the same global batch ---------------------------------------------

TWO = [Host("a", 1), Host("b", 1)]


def test_policy_prefers_a_spare_to_shrinking():
    decision = decide(Failure("killed", 137, (1,), ("b",)), THREE, [], 0, 3, 2, min_np=1, global_batch=(64, 32))
    assert decision.retry and decision.hosts == [Host("a", 1), Host("c", 1)] and decision.num_ranks == 2
    assert "of 2 ranks" not in decision.reason


def test_policy_shrinks_to_the_slots_left_at_the_same_global_batch():
    decision = decide(Failure("killed", 137, (1,), ("b",)), TWO, [], 0, 3, 2, min_np=1, global_batch=(64, 32))
    assert decision.retry and decision.hosts == [Host("a", 1)] and decision.num_ranks == 1
    assert decision.reason == ("relaunching on 1 of 2 ranks without b (killed; no spare host, --min-np 1) at the same "
                               "global batch 64 (32 per rank x 2 accumulation)")
    # without --min-np, as before: stop
    assert not decide(Failure("killed", 137, (1,), ("b",)), TWO, [], 0, 3, 2).retry
    # a script (no global batch known to the supervisor) shrinks too
    assert decide(Failure("killed", 137, (1,), ("b",)), TWO, [], 0, 3, 2, min_np=1).num_ranks == 1
    # slots of a host with several: all that is left is used
    hosts = [Host("a", 4), Host("b", 4), Host("c", 4)]
    wide = decide(Failure("killed", 137, (5,), ()), hosts, [], 0, 3, 12, hosts, min_np=6, global_batch=(384, 32))
    assert wide.num_ranks == 8 and wide.hosts == [Host("a", 4), Host("c", 4)]
    assert "384 (24 per rank x 2 accumulation)" in wide.reason  # 48 a rank: 32 does not divide it, 24 does


def test_policy_refuses_below_min_np_and_a_global_batch_that_does_not_split():
    below = decide(Failure("killed", 137, (2,), ("c",)), THREE, [], 0, 3, 3, min_np=3)
    assert not below.retry and below.reason == "cannot relaunch without c: 2 slots left, fewer than --min-np 3"
    odd = decide(Failure("killed", 137, (2,), ("c",)), THREE, [], 0, 3, 3, min_np=2, global_batch=(75, 25))
    assert not odd.retry and odd.excluded == ["c"]
    assert odd.reason == "cannot continue on 2 ranks: the global batch 75 does not split over 2 ranks (75 is not a multiple of 2)"


def test_global_batch_split_keeps_it_exact():
    from mpiddp.globalbatch import GlobalBatchError, split

    assert split(64, 2, 32) == (32, 1) and split(64, 1, 32) == (32, 2) and split(256, 4, 32) == (32, 2)
    assert split(96, 2, 32) == (24, 2)  # 48 per rank: 32 does not divide it, 24 x 2 does
    assert split(14, 2, 32) == (7, 1)  # never more per rank than needed
    with pytest.raises(GlobalBatchError, match="the global batch 75 does not split over 2 ranks"):
        split(75, 2, 25)


def test_config_for_world_derives_accumulation_from_the_global_batch():
    from mpiddp.trainer.config import Config, ConfigError

    cfg = Config.of(batch_size=32, global_batch=64)
    assert (cfg.for_world(2).training.batch_size, cfg.for_world(2).training.grad_accum) == (32, 1)
    assert (cfg.for_world(1).training.batch_size, cfg.for_world(1).training.grad_accum) == (32, 2)
    assert Config.of(batch_size=32, grad_accum=3).for_world(5).training.grad_accum == 3  # without --global-batch: as given
    with pytest.raises(ConfigError, match="--global-batch: the global batch 64 does not split over 3 ranks"):
        cfg.for_world(3)


def test_plan_with_min_np_learns_the_global_batch_from_the_job(tmp_path):
    base = ["-H", "a:1,b:1", "-np", "2", "--min-np", "1", "--launcher", "mpirun", "--run-dir", str(tmp_path), "--"]
    plan = make_plan([*base, "train", "--batch-size", "16", "--grad-accum", "3"], {})
    assert plan.min_np == 1 and plan.global_batch is None and plan.inner == ["train", "--batch-size", "16",
                                                                            "--grad-accum", "3"]
    script = make_plan([*base, "run", "x.py"], {})
    assert script.min_np == 1 and script.global_batch is None and script.inner == ["run", "x.py"]
    for bad in ("0", "3"):
        with pytest.raises(LaunchError, match=rf"--min-np must be in \[1, -np 2\], got {bad}"):
            make_plan([*base[:5], bad, *base[6:], "--epochs", "1"], {})


def test_launcher_path_picks_the_mpi_and_its_flavour(tmp_path, mpich):
    plan = make_plan(["-np", "2", "--launcher-path", str(mpich / "bin" / "mpiexec"), "--run-dir", str(tmp_path),
                      "--", "run", "x.py"], {})
    assert (plan.launcher, plan.program, plan.flavour) == ("mpiexec", str(mpich / "bin" / "mpiexec"), "mpich")
    with pytest.raises(LaunchError, match="--launcher-path /no/mpiexec: no such file"):
        make_plan(["-np", "2", "--launcher-path", "/no/mpiexec", "--run-dir", str(tmp_path), "--", "run", "x.py"], {})


def test_policy_shrinks_to_the_most_ranks_the_global_batch_splits_over():
    hosts = [Host("a", 4), Host("b", 2), Host("c", 2)]
    # 6 slots left, but 256 does not split over 6: 4 ranks (>= --min-np 4) keep it exactly
    decision = decide(Failure("killed", 137, (6,), ()), hosts, [], 0, 3, 8, hosts, min_np=4, global_batch=(256, 32))
    assert decision.retry and decision.num_ranks == 4 and decision.hosts == [Host("a", 4)]
    assert "relaunching on 4 of 8 ranks without c" in decision.reason and "256 (32 per rank x 2 accumulation)" in decision.reason
    odd = decide(Failure("killed", 137, (2,), ("c",)), THREE, [], 0, 3, 3, min_np=1, global_batch=(75, 25))
    assert odd.retry and odd.num_ranks == 1 and "75 (25 per rank x 3 accumulation)" in odd.reason


def test_a_failure_on_every_host_blames_none_of_them():
    hosts = [Host("a", 2), Host("b", 2), Host("c", 2)]
    everywhere = decide(Failure("exception", 1, (0, 1, 2, 3), ()), hosts, [], 0, 3, 4, hosts[:2])
    assert everywhere.retry and everywhere.excluded == [] and everywhere.hosts == hosts[:2]
    assert "no host to blame" in everywhere.reason
    lone = decide(Failure("killed", 137, (0, 1), ()), [Host("n1", 2)], [], 0, 3, 2, [Host("n1", 2)])
    assert lone.excluded == ["n1"]  # the only host: it is the one that failed


def test_bad_launcher_inputs_are_one_line(tmp_path):
    base = ["-np", "2", "--run-dir", str(tmp_path)]
    with pytest.raises(LaunchError, match="--launcher-args .*No closing quotation"):
        make_plan([*base, "--launcher-args", "x 'y", "--", "run", "x.py"], {})
    not_executable = tmp_path / "mpiexec"
    not_executable.write_text("#!/bin/sh\n")
    with pytest.raises(LaunchError, match="not executable"):
        make_plan([*base, "--launcher-path", str(not_executable), "--", "run", "x.py"], {})
    with pytest.raises(HostListError, match="an entry has no host name"):
        parse_host_option("a:2,:3")


def test_a_launcher_that_cannot_be_started_is_one_line_and_no_relaunch(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)  # keep pytest's own handlers
    plan = Plan("run", ["run", "x.py"], tmp_path, 2, [], [], 3, "mpirun", str(tmp_path / "gone" / "mpirun"), "openmpi")
    supervisor = Supervisor(plan, {})
    assert supervisor.run() == 2
    assert len(supervisor.attempts) == 1 and supervisor.attempts[0].cause == "user_error"
    assert f"cannot start {tmp_path}/gone/mpirun: No such file or directory; not relaunched" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--launcher", "srun", "-np", "2"], "--launcher srun runs inside a Slurm allocation"),
    (["-H", "localhost:\u00b2"], "slot count '\u00b2' is not a number"),
    (["-np", "0"], "-np must be at least 1, got 0"),
    (["-np", "-3"], "-np must be at least 1, got -3"),
    (["-H", "a:1,b:1", "--exclude", "a,b"], "--exclude a,b leaves none of the 2 hosts from -H"),
    (["-H", "a:1,b:1", "-np", "1", "--exclude", "b,a"], "--exclude b,a leaves none of the 2 hosts"),
    (["-H", "a b:2"], "'a b' is not a host name"),
])
def test_bad_inputs_to_launch_are_one_clear_line(tmp_path, argv, message):
    with pytest.raises((LaunchError, HostListError), match=re.escape(message)):
        make_plan([*argv, "--run-dir", str(tmp_path), "--", "--epochs", "1"], {})


def test_launcher_args_may_start_with_a_dash(tmp_path):
    for given in (["--launcher-args", "--oversubscribe"], ["--launcher-args=--oversubscribe"]):
        plan = make_plan(["-np", "2", *given, "--launcher-args", "--mca btl tcp,self", "--run-dir", str(tmp_path),
                          "--", "run", "x.py"], {})
        assert plan.extra == ["--oversubscribe", "--mca", "btl", "tcp,self"]


def test_host_lists_refuse_what_is_not_a_host_or_a_number():
    with pytest.raises(HostListError, match=r"the range '3-1' runs backwards"):
        expand_nodelist("n[3-1]")
    with pytest.raises(HostListError, match="is not a number"):
        parse_hostfile("nodea slots=\u00b2\n")
    with pytest.raises(HostListError, match="cannot read the Slurm node list"):
        expand_nodelist("n[\u00b2-3]")
    with pytest.raises(HostListError, match="'no de' is not a host name"):
        from_pbs("no de\n")
    assert parse_host_option("node-1.example.org:2,10.0.0.5,gpu_7:1") == [
        Host("node-1.example.org", 2), Host("10.0.0.5", 1), Host("gpu_7", 1)]


def test_a_bad_launch_input_is_one_line_on_stderr_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mpiddp", "launch", "-H", "localhost:\u00b2", "--run-dir",
                           str(tmp_path), "--", "--epochs", "1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == ["mpiddp launch: error: -H localhost:\u00b2: slot count '\u00b2' is not a number"]
    assert not (tmp_path / "attempts.json").exists()


def test_a_launcher_whose_leftovers_live_on_ends_the_attempt_and_its_session(tmp_path, monkeypatch):
    """The launcher exits while processes it started live on holding its output (as orphaned loader workers held
    mpirun's pipes): the attempt ends anyway, and what is left of its session is killed."""
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)  # keep pytest's own handlers
    monkeypatch.setattr(supervisor, "RELAY_DRAIN_S", 1.0)
    launcher, pids = tmp_path / "mpirun", tmp_path / "pids"
    forever = [sys.executable, "-c", "import time; time.sleep(10**6)"]
    launcher.write_text(f"#!{sys.executable}\nimport subprocess, sys\n"
                        f"same = subprocess.Popen({forever!r})\n"
                        f"away = subprocess.Popen({forever!r}, start_new_session=True)\n"
                        f"open({str(pids)!r}, 'w').write(f'{{same.pid}} {{away.pid}}')\n"
                        "print('launcher done', flush=True)\nsys.exit(1)\n")
    launcher.chmod(0o755)
    plan = Plan("run", ["run", "x.py"], tmp_path, 2, [], [], 0, "mpirun", str(launcher), "openmpi")
    try:
        assert Supervisor(plan, {}).run() == 1
        same, away = (int(pid) for pid in pids.read_text().split())
        deadline = time.monotonic() + 30
        while _running(same) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling a condition with a deadline, not synchronising
        assert not _running(same), "a process of the attempt's session outlived it"
    finally:
        for pid in (int(pid) for pid in pids.read_text().split()) if pids.exists() else ():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _running(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_dead_supervisor_s_last_attempt_is_completed_once_and_the_record_says_why(tmp_path):
    from mpiddp import failure, supervision

    attempts = [Attempt(0, ["a"], ["mpirun"], 1.0, status=1), Attempt(1, ["a"], ["mpirun"], 2.0)]
    write_attempts(tmp_path / "attempts.json", attempts)
    supervision.record_supervisor_death(tmp_path, tmp_path / "failures", 1, "pid 7 on a", 42)
    (record,) = failure.read_all(tmp_path / "failures")
    assert record.kind == "stopped" and record.step == 42 and "supervisor" in record.message
    first, last = json.loads((tmp_path / "attempts.json").read_text())["attempts"]
    assert first["status"] == 1 and last["status"] == 3 and last["failed_at_step"] == 42
    assert "supervisor died" in last["decision"]
    # an attempt the supervisor completed itself is left alone
    assert not supervision.complete_last_attempt(tmp_path / "attempts.json", "again", 50)


def test_a_launch_rerun_after_its_supervisor_died_resumes_by_itself(tmp_path):
    """The dead supervisor's record says "rerun the same launch command": that command names no --resume, so the
    job reads from attempts.json that it continues a stopped run (before: it refused the snapshots, exit 2)."""
    from mpiddp import supervision

    path = tmp_path / "attempts.json"
    assert not supervision.stopped_by_supervisor_death(tmp_path)  # no attempts.json: a fresh run
    write_attempts(path, [Attempt(0, ["a"], ["mpirun"], 1.0)])
    supervision.record_supervisor_death(tmp_path, tmp_path / "failures", 0, "pid 7 on a", 42)
    assert supervision.stopped_by_supervisor_death(tmp_path)
    # the rerun's own attempt, listed as it starts (no status yet), is passed over
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "attempts": [*data["attempts"], {"status": None, "decision": ""}]}))
    assert supervision.stopped_by_supervisor_death(tmp_path)
    # once an attempt after it finished, the run goes on as usual
    path.write_text(json.dumps({**data, "attempts": [*data["attempts"], {"status": 0, "decision": "finished"}]}))
    assert not supervision.stopped_by_supervisor_death(tmp_path)


def test_records_follow_the_job_into_a_run_dir_an_earlier_launch_left_records_in(tmp_path):
    """The job's own --run-dir already holds failures/ of an earlier launch: this attempt's records still move
    there (a whole directory could not replace it, and they stayed behind unread), the stale ones go."""
    from mpiddp import failure, supervision

    before, after = tmp_path / "launch", tmp_path / "job"
    failure.write_rank(after / failure.FAILURES_DIR, 1, failure.FailureRecord("killed", [1], ["old"], "earlier", rank=1))
    failure.write_rank(before / failure.FAILURES_DIR, 0, failure.FailureRecord("exception", [0], ["a"], "now", rank=0))
    (before / "attempt0.out").write_text("out")
    supervision.move_records(before, after)
    assert [r.message for r in failure.read_all(after / failure.FAILURES_DIR)] == ["now"]
    assert (after / "attempt0.out").read_text() == "out" and not (before / failure.FAILURES_DIR).exists()


def test_a_job_whose_supervisor_died_lists_its_launch_after_the_earlier_ones_in_its_run_dir(tmp_path):
    """Launch's records wait in launch's own run dir until the attempt ends; a dead supervisor never moves them,
    so the job does, or its run dir says nothing and a rerun of the same command cannot resume."""
    from mpiddp import failure, supervision

    before, after = tmp_path / "launch", tmp_path / "job"
    before.mkdir()
    after.mkdir()
    write_attempts(after / "attempts.json", [Attempt(0, ["a"], ["mpirun"], 1.0, status=0)])
    write_attempts(before / "attempts.json", [Attempt(0, ["a"], ["mpirun"], 2.0)])
    failure.write_placement(before / failure.FAILURES_DIR, [("a", [0, 1])])
    supervision.adopt_launch_records(before, after)
    supervision.record_supervisor_death(after, after / failure.FAILURES_DIR, 0, "pid 7 on a", 42)
    data = json.loads((after / "attempts.json").read_text())
    assert [(a["launch"], a["status"]) for a in data["attempts"]] == [(0, 0), (1, 3)] and data["restarts"] == 1
    assert failure.read_placement(after / failure.FAILURES_DIR) and not (before / "attempts.json").exists()
    assert supervision.stopped_by_supervisor_death(after)


def test_a_stop_that_arrives_as_the_launcher_is_reaped_is_no_crash(tmp_path):
    """A stop signal can interrupt the wait that has just reaped the launcher, while poll() (Popen's lock held)
    still says it runs: seen under Slurm's scancel, where the supervisor crashed with ProcessLookupError (exit 1
    instead of the job's 3)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process

    class Reaped:
        pid = gone.pid

        def poll(self):
            return None

    plan = Plan("train", ["--epochs", "1"], tmp_path, 2, [], [], 0, "srun", "srun", "openmpi")
    watcher = Supervisor(plan, {})
    watcher.child = Reaped()
    watcher._forward(signal.SIGTERM, None)
    assert watcher.stop_signal == signal.SIGTERM
