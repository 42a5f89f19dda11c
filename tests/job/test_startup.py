"""The start-up breakdown: phase durations on one rank, the slowest rank per phase; and the end of a finished
rank, without the interpreter's teardown."""

import os
import subprocess
import sys

import pytest

from conftest import REPO, job_env, run_command
from mpiddp.trainer.startup import PHASES, StartupClock, slowest_per_phase


def test_each_phase_runs_from_the_end_of_the_previous_one_reached():
    clock = StartupClock(started_at=100.0)
    clock.mark("interpreter_and_imports", at=101.5)
    clock.mark("mpi_and_topology", at=102.0)
    clock.mark("data", at=104.0)  # phases in between not reached (or not marked) are left out
    assert clock.durations() == {"interpreter_and_imports": 1.5, "mpi_and_topology": 0.5, "data": 2.0}


def test_the_summary_keeps_the_slowest_rank_of_each_phase_every_rank_reached():
    per_rank = [{"interpreter_and_imports": 2.0, "data": 1.0}, {"interpreter_and_imports": 3.0, "data": 0.5},
                {"interpreter_and_imports": 1.0}]
    assert slowest_per_phase(per_rank) == {"interpreter_and_imports": {"seconds": 3.0, "rank": 1}}
    assert list(slowest_per_phase([{p: 1.0 for p in reversed(PHASES)}])) == list(PHASES)  # in phase order


def test_a_rank_that_joined_the_running_job_is_left_out_of_its_start_up():
    """After a grow the joined rank's own start (7-14 s, the grow's cost) is not the job's: its None is skipped
    and the other ranks keep their numbers."""
    per_rank = [{"interpreter_and_imports": 2.0, "first_step": 1.0}, None, {"interpreter_and_imports": 3.0,
                                                                           "first_step": 0.5}]
    assert slowest_per_phase(per_rank) == {"interpreter_and_imports": {"seconds": 3.0, "rank": 2},
                                           "first_step": {"seconds": 1.0, "rank": 0}}
    assert slowest_per_phase([None]) == {}


# --- a finished rank ends without the interpreter's teardown (mpiddp.job.mpistart.exit_without_teardown) ------

EXIT_PROGRAM = """
import atexit, sys, threading
from mpiddp.job.mpistart import exit_without_teardown

class Teardown:
    def __del__(self):
        print("teardown ran", flush=True)

kept = Teardown()  # a module global: only the interpreter's teardown finalises it
done = []
worker = threading.Thread(target=lambda: threading.Event().wait(0.2) or done.append(True))  # not a daemon
atexit.register(lambda: print("exit handler ran; the thread had finished:", bool(done)))
sys.stdout.write("unflushed output. ")
worker.start()
exit_without_teardown(7)
"""


def test_a_finished_rank_runs_the_exit_handlers_and_skips_the_teardown(tmp_path):
    done = subprocess.run([sys.executable, "-c", EXIT_PROGRAM], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 7, done.stderr
    # as Python's own exit: other threads first, then the exit handlers, then the output flushed
    assert done.stdout == "unflushed output. exit handler ran; the thread had finished: True\n"
    assert "teardown ran" not in done.stdout


MPI_EXIT_PROGRAM = """
import sys
from mpiddp.job.mpistart import exit_without_teardown, init_mpi

comm, _ = init_mpi()
comm.barrier()
exit_without_teardown(int(sys.argv[1]))
"""


@pytest.mark.mpi
@pytest.mark.parametrize("status", [0, 3])
def test_a_rank_that_ends_without_the_teardown_still_finalises_mpi(mpirun, tmp_path, status):
    # Open MPI's launcher reports a rank that exits without MPI_Finalize as failed ("exiting improperly")
    program = tmp_path / "ends.py"
    program.write_text(MPI_EXIT_PROGRAM)
    job = run_command([mpirun, "-np", "2", sys.executable, str(program), str(status)], tmp_path, timeout=120,
                      env=job_env(PYTHONPATH=str(REPO)))
    assert job.returncode == status, job.output[-3000:]
    assert "improperly" not in job.output and "finalize" not in job.output.lower(), job.output[-3000:]


SITE_MARKS = """
import atexit, os

MARKS = os.environ["MPIDDP_TEST_MARKS"]

def mark(what, open=open, join=os.path.join, getpid=os.getpid):  # bound now: the teardown clears builtins
    with open(join(MARKS, f"{what}-{getpid()}"), "w"):
        pass

class Teardown:
    def __del__(self):
        mark("teardown")

kept = Teardown()  # finalised only by the interpreter's teardown
atexit.register(mark, "exit-handler")
"""


@pytest.mark.mpi
def test_a_training_rank_runs_its_exit_handlers_and_skips_the_teardown(run_job, tmp_path):
    site, marks = tmp_path / "site", tmp_path / "marks"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(SITE_MARKS)  # every python of the job loads it first
    env = job_env(PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
                  MPIDDP_TEST_MARKS=str(marks))
    job = run_job(2, "--epochs", "1", "--no-progress", env=env, timeout=120)
    assert job.returncode == 0, job.output[-3000:]
    assert job.summary["world_size"] == 2
    made = sorted(path.name.split("-")[0] for path in marks.iterdir())
    assert made == ["exit", "exit"], made  # both ranks ran the exit handlers; neither tore the interpreter down


def test_rank_0_warns_when_launchs_run_dir_is_not_on_its_host(tmp_path):
    """Launch lists the attempt in its run dir before starting it; a rank 0 that cannot see that listing writes its
    records where launch never reads them (a run dir not shared with this host): said in one line, not silently."""
    from mpiddp.job.bootstrap import launch_blind

    assert launch_blind("", "nodeb") == ""  # not under launch
    said = launch_blind(str(tmp_path / "run"), "nodeb")
    assert said == (f"mpiddp: launch's run dir {tmp_path / 'run'} is not on nodeb, rank 0's host: launch cannot read "
                    "this job's records (its start, its failures, its end), and ends it after its --startup-timeout; "
                    "give launch a --run-dir on a filesystem every host shares")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "attempts.json").write_text("{}")
    assert launch_blind(str(tmp_path / "run"), "nodeb") == ""
