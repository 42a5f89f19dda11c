"""End-to-end: real `mpirun -np N python -m mpiddp` jobs, judged by what they write to the run directory."""

import math
import os
import socket
import sys

import pytest

from conftest import REPO, job_env, run_command

pytestmark = pytest.mark.mpi
QUICK = ("--epochs", "3", "--no-progress")


def assert_trained(job, world_size, min_accuracy):
    assert job.returncode == 0, job.output[-4000:]
    summary = job.summary
    assert summary["world_size"] == world_size
    assert summary["num_hosts"] == 1
    assert summary["hosts"] == {socket.gethostname(): list(range(world_size))}
    assert summary["backend"] == "gloo" and summary["device"] == "cpu"
    assert summary["eval_accuracy"] >= min_accuracy
    epochs = [m for m in job.metrics if m["kind"] == "epoch"]
    assert len(epochs) == summary["epochs"]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"] * 0.5
    assert summary["images_per_second"] > 0
    assert len(summary["rank_step_time_s"]) == world_size
    assert 0 < summary["time_to_first_step_s"] < summary["wall_time_s"]
    # every start-up phase, each the slowest rank's; together they are the time to the first step (give or
    # take the start of the earliest process vs each rank's own)
    from mpiddp.trainer.startup import PHASES

    assert set(summary["startup_s"]) == set(PHASES)
    assert all(0 <= summary["startup_s"][p]["rank"] < world_size for p in PHASES)
    assert sum(e["seconds"] for e in summary["startup_s"].values()) == pytest.approx(summary["time_to_first_step_s"], abs=1.0)
    assert len(summary["rank_data_wait_s"]) == len(summary["rank_compute_s"]) == world_size
    assert summary["mpi_library"].startswith(("Open MPI", "MPICH"))
    return summary


@pytest.mark.floor  # also run against the oldest supported torch in CI
def test_default_job_reaches_95_percent(run_job):
    job = run_job(2, timeout=300)
    summary = assert_trained(job, 2, 0.95)
    assert summary["epochs"] == 15
    steps = [m for m in job.metrics if m["kind"] == "step"]
    assert steps and all(m["loss"] > 0 and m["images_per_second"] > 0 for m in steps)
    assert "eval acc" in job.output  # rank 0's per-epoch line
    # rank 0 alone logs at INFO, so each epoch line appears once, not once per rank
    assert job.output.count("epoch 15/15 | train loss") == 1
    if summary["mpi_library"].startswith("Open MPI") and "OMPI_MCA_btl" not in os.environ:
        # nobody chose the BTLs: mpiddp leaves out the libfabric BTL, whose close sleeps 1 s in MPI_Init
        assert summary["mpi_settings"] == "btl=^ofi"
        assert "mpiddp set btl=^ofi" in job.output


def test_a_btl_choice_of_the_user_is_left_alone(run_job):
    job = run_job(2, *QUICK, mpirun_args=("--mca", "btl", "self,tcp"))
    summary = assert_trained(job, 2, 0.85)
    assert summary["mpi_settings"] == ""


@pytest.mark.parametrize("np", [1, 3])
def test_other_world_sizes(run_job, np):
    summary = assert_trained(run_job(np, *QUICK), np, 0.85)
    # the global batch grows with the world: each rank steps through its shard of 1438 training digits
    per_rank = math.ceil(1438 / np)
    assert summary["steps"] == 3 * (per_rank // 32)  # full batches only


def test_plain_python_without_mpirun_is_one_process(tmp_path):
    run_dir = tmp_path / "single"
    job = run_command([sys.executable, "-m", "mpiddp", "--run-dir", str(run_dir), *QUICK], run_dir, timeout=120)
    assert_trained(job, 1, 0.85)


def test_default_run_dir_is_a_new_timestamped_folder(mpirun, tmp_path):
    runs = tmp_path / "runs"
    command = [mpirun, "-np", "2", sys.executable, "-m", "mpiddp", "--runs-root", str(runs), "--epochs", "1"]
    first = run_command(command, runs, timeout=120)
    second = run_command(command, runs, timeout=120)
    assert first.returncode == 0 and second.returncode == 0, first.output + second.output
    folders = sorted(runs.iterdir())
    assert len(folders) == 2
    assert all((f / "summary.json").is_file() and (f / "metrics.jsonl").is_file() for f in folders)


def test_exports_torchrun_variables_and_fair_threads(mpirun, tmp_path):
    out = tmp_path / "env"
    program = str(REPO / "tests" / "programs" / "report_env.py")
    job = run_command([mpirun, "-np", "2", sys.executable, program, str(out)], tmp_path, timeout=120)
    assert job.returncode == 0, job.output
    lines = sorted((tmp_path / f"env.{rank}").read_text() for rank in range(2))
    threads = max(1, (os.cpu_count() or 1) // 2)
    for rank, line in enumerate(lines):
        assert line == f"RANK={rank} WORLD_SIZE=2 LOCAL_RANK={rank} LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 threads={threads}"
    # the rendezvous store listens on the chosen address only (127.0.0.1 = 0100007F), not on every interface
    assert (tmp_path / "env.listen").read_text() == "0100007F"


def test_local_script_prints_and_runs_its_command(tmp_path):
    run_dir = tmp_path / "run"
    env = job_env(PYTHON=sys.executable)
    job = run_command([str(REPO / "run" / "local.sh"), "3", "--run-dir", str(run_dir), *QUICK], run_dir, 180, env=env)
    assert_trained(job, 3, 0.85)
    assert f"mpirun -np 3 --oversubscribe {sys.executable} -m mpiddp" in job.output


def test_mpich_launch_trains_too(mpich, tmp_path):
    from conftest import mpich_env

    run_dir = tmp_path / "run"
    command = [str(mpich / "bin" / "mpiexec"), "-n", "2", sys.executable, "-m", "mpiddp", "--run-dir", str(run_dir), *QUICK]
    summary = assert_trained(run_command(command, run_dir, 180, env=mpich_env(mpich)), 2, 0.85)
    assert summary["mpi_library"].startswith("MPICH")
    assert summary["mpi_settings"] == ""  # Open MPI's parameters mean nothing to MPICH


def test_no_progress_bar_frames_when_mpiruns_output_is_not_a_terminal(run_job):
    from conftest import job_env

    env = job_env()
    env.pop("CI")  # as on a cluster: only the terminal question decides
    job = run_job(2, "--epochs", "2", "--progress", "auto", "--wandb", "disabled", env=env)
    assert job.returncode == 0, job.output[-3000:]
    assert "\r" not in job.output and "it/s" not in job.output
