"""`python -m mpiddp run SCRIPT`: your own script on every rank, with torchrun's environment and mpiddp's guarantees."""

import json
import sys

import pytest

from conftest import REPO, job_env, mpich_env, run_command

pytestmark = pytest.mark.mpi
PROGRAMS = REPO / "tests" / "programs"


def ranks_saw(out_dir, world_size):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def assert_trained_together(records):
    assert all(r["weights"] == records[0]["weights"] for r in records)  # DDP kept every replica identical
    for rank, record in enumerate(records):
        env = record["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["ROLE_RANK"]) == (str(rank), str(len(records)), str(rank))
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and int(env["MASTER_PORT"]) > 0


@pytest.mark.floor  # also run against the oldest supported torch in CI
def test_a_torchrun_script_runs_unchanged_with_env_rendezvous(mpirun, tmp_path):
    job = run_command([mpirun, "-np", "3", sys.executable, "-m", "mpiddp", "run",
                       str(PROGRAMS / "torchrun_style.py"), str(tmp_path), "--their-flag"], tmp_path, timeout=120)
    assert job.returncode == 0, job.output[-3000:]
    records = ranks_saw(tmp_path, 3)
    assert_trained_together(records)
    first = records[0]
    assert first["argv"] == [str(PROGRAMS / "torchrun_style.py"), str(tmp_path), "--their-flag"]
    assert first["name"] == "__main__" and first["path0"] == str(PROGRAMS)
    assert [r["env"]["LOCAL_RANK"] for r in records] == ["0", "1", "2"]
    assert records[0]["env"]["MASTER_ADDR"] == "127.0.0.1" and records[0]["env"]["LOCAL_WORLD_SIZE"] == "3"


def test_module_form_runs_a_module_from_the_working_directory(mpirun, tmp_path):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text((PROGRAMS / "torchrun_style.py").read_text())
    out = tmp_path / "out"
    out.mkdir()
    job = run_command([mpirun, "-np", "2", sys.executable, "-m", "mpiddp", "run", "--log-level", "warning",
                       "-m", "mypkg.train", str(out)], tmp_path, timeout=120, cwd=tmp_path)
    assert job.returncode == 0, job.output[-3000:]
    records = ranks_saw(out, 2)
    assert_trained_together(records)
    assert records[0]["argv"][0] == str(package / "train.py") and records[0]["path0"] == str(tmp_path)


def test_under_mpich_too(mpich, tmp_path):
    job = run_command([str(mpich / "bin" / "mpiexec"), "-n", "2", sys.executable, "-m", "mpiddp", "run",
                       str(PROGRAMS / "torchrun_style.py"), str(tmp_path)], tmp_path, timeout=120,
                      env=mpich_env(mpich))
    assert job.returncode == 0, job.output[-3000:]
    assert_trained_together(ranks_saw(tmp_path, 2))


def test_the_examples_run_as_the_readme_shows(mpirun, tmp_path):
    digits = run_command([mpirun, "-np", "2", sys.executable, "-m", "mpiddp", "run", "run/examples/torchrun_digits.py",
                          "--epochs", "3", "--save", str(tmp_path / "digits.pt")], tmp_path, timeout=120)
    assert digits.returncode == 0, digits.output[-3000:]
    assert digits.output.count("epoch 3: loss") == 1 and (tmp_path / "digits.pt").is_file()
    for launch in (["-m", "mpiddp", "run"], []):  # under mpiddp run, and under a plain mpirun
        job = run_command([mpirun, "-np", "2", sys.executable, *launch, "run/examples/autoencoder.py", "--epochs", "3",
                           "--save", str(tmp_path / "ae.pt")], tmp_path, timeout=120)
        assert job.returncode == 0, job.output[-3000:]
        assert job.output.count("epoch 3/3: reconstruction MSE") == 1 and (tmp_path / "ae.pt").is_file()
        (tmp_path / "ae.pt").unlink()


@pytest.mark.parametrize("mode, status, message", [
    ("raise", 1, "misbehave.py failed; ending the job"),
    ("exit3", 3, "misbehave.py exited with status 3; ending the job"),
    ("argparse", 2, "misbehave.py: error: unrecognized arguments: --no-such-option"),
    ("exit0", 4, "is still running"),
])
def test_a_failing_rank_ends_the_job_quickly_with_one_report(mpirun, tmp_path, mode, status, message):
    job = run_command([mpirun, "-np", "2", sys.executable, "-m", "mpiddp", "run", "--finish-timeout", "3",
                       str(PROGRAMS / "misbehave.py"), mode], tmp_path, timeout=90)
    assert job.returncode == status, job.output[-3000:]
    assert job.output.count(message) == 1, job.output[-3000:]
    if mode == "raise":
        assert job.output.count("Traceback") == 1 and 'misbehave.py", line' in job.output
        assert "mpiddp/script/run.py" not in job.output  # the report starts in the user's code


@pytest.mark.parametrize("args, message", [
    (["nope.py"], "script 'nope.py' not found"),
    ([], "run needs a script to run"),
    (["-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
])
def test_bad_targets_are_one_line_from_rank_0(mpirun, tmp_path, args, message):
    job = run_command([mpirun, "-np", "2", sys.executable, "-m", "mpiddp", "run", *args], tmp_path, timeout=60)
    assert job.returncode == 2
    assert job.output.count(message) == 1 and "Traceback" not in job.output


@pytest.mark.parametrize("mode, status, message", [
    ("exit0", 4, "is still running 3 s after the script finished on rank(s) 1 (mpiddp.init(finish_timeout_s=3))"),
    ("exit3", 3, "misbehave.py exited with status 3; ending the job"),
    ("raise", 1, "failed; ending the job"),
    ("ok", 0, None),
])
def test_init_under_a_plain_mpirun_ends_the_job_on_every_exit_path(mpirun, tmp_path, mode, status, message):
    # rank 1 leaves (sys.exit, an exception) while rank 0 enters an all_reduce; sys.exit bypasses the exception
    # hook, and the exit handler used to wait in a blocking MPI barrier that rank 0 never entered: a hang.
    job = run_command([mpirun, "-np", "2", sys.executable, str(PROGRAMS / "misbehave.py"), mode, "api"],
                      tmp_path, timeout=90)
    assert job.returncode == status, job.output[-3000:]
    if message is not None:
        assert job.output.count(message) == 1, job.output[-3000:]
    if mode == "raise":  # the report survives torch's exception hook, which buffers stderr around ours
        assert 'misbehave.py", line' in job.output and "ValueError: bad value on rank 1" in job.output


def test_loader_workers_start_from_a_forkserver_with_the_users_threads(mpirun, tmp_path):
    env = job_env(OMP_NUM_THREADS="1", SLURM_RESTART_COUNT="2")
    job = run_command([mpirun, "-np", "2", sys.executable, "-m", "mpiddp", "run",
                       str(PROGRAMS / "loader_workers.py"), str(tmp_path)], tmp_path, timeout=120, env=env)
    assert job.returncode == 0, job.output[-3000:]
    records = ranks_saw(tmp_path, 2)
    for rank, record in enumerate(records):
        assert record["steps"] == 8 and record["start_method"] == "forkserver"
        assert record["threads"] == 1  # the user's OMP_NUM_THREADS, not mpiddp's share of the cores
        assert record["env"] == {"LOCAL_RANK": str(rank), "MPIDDP_LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
                                 "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCHELASTIC_RESTART_COUNT": "2"}
        parents = [int(path.read_text()) for path in tmp_path.glob(f"parent-{rank}-*")]
        assert len(parents) == 4 and record["pid"] not in parents  # no worker was forked from the MPI rank
