"""`check` under mpirun and `report` on a finished run."""

import sys

import pytest

from conftest import run_command
from mpiddp.tools.check import bus_bandwidth

pytestmark = pytest.mark.mpi


def test_bus_bandwidth_follows_nccl_tests():
    assert bus_bandwidth(1.0, 2) == 1.0
    assert bus_bandwidth(1.0, 4) == 1.5
    assert bus_bandwidth(1.0, 1) == 1.0


def test_check_reports_a_healthy_job(mpirun, tmp_path):
    command = [mpirun, "-np", "2", sys.executable, "-m", "mpiddp", "check", "--runs-root", str(tmp_path / "runs"),
               "--wandb", "offline"]
    job = run_command(command, tmp_path, timeout=120)
    assert job.returncode == 0, job.output[-3000:]
    assert job.output.count("mpiddp check") == 1  # rank 0 prints the one report
    assert "fingerprint: same on every rank" in job.output
    assert "gloo all-reduce (float32, 2 ranks)" in job.output and "busbw GB/s" in job.output
    assert "MPI rank 0 <-> rank 1: latency" in job.output
    assert "writable on every host" in job.output and "wandb: offline" in job.output
    assert "all good: 2 ranks on 1 hosts" in job.output
    # not started with MPI fault tolerance: one line says so, and it is no problem (the job fails fast instead)
    assert "in-job recovery: no: in-job recovery needs mpirun --with-ft ulfm" in job.output


def test_check_on_one_rank_still_runs_the_backends_all_reduce(mpirun, tmp_path):
    """A one-GPU user's check must exercise NCCL (its errors often show only at the first collective): on one
    rank the all-reduce still runs, said to cross no link."""
    command = [mpirun, "-np", "1", sys.executable, "-m", "mpiddp", "check", "--runs-root", str(tmp_path / "runs"),
               "--wandb", "disabled"]
    job = run_command(command, tmp_path, timeout=120)
    assert job.returncode == 0, job.output[-3000:]
    assert "gloo all-reduce (float32, 1 ranks): one rank, no link crossed" in job.output
    assert " 4194304 " in job.output and "busbw GB/s" in job.output  # the largest size was measured
    assert "MPI rank 0 <-> rank" not in job.output  # a ping-pong needs two ranks


def test_check_says_a_job_started_with_fault_tolerance_can_recover_in_the_job(mpirun, tmp_path):
    command = [mpirun, "--with-ft", "ulfm", "-np", "2", sys.executable, "-m", "mpiddp", "check", "--runs-root",
               str(tmp_path / "runs"), "--wandb", "disabled"]
    job = run_command(command, tmp_path, timeout=120)
    assert job.returncode == 0, job.output[-3000:]
    assert job.output.count("in-job recovery: yes (Open MPI v5") == 1, job.output[-3000:]


def test_check_says_a_job_with_powersgd_cannot_recover_in_the_job(mpirun, tmp_path):
    """MPI could (--with-ft ulfm), but this job's settings rule it out: check says so, as the job would."""
    command = [mpirun, "--with-ft", "ulfm", "-np", "2", sys.executable, "-m", "mpiddp", "check", "--runs-root",
               str(tmp_path / "runs"), "--wandb", "disabled", "--grad-compression", "powersgd"]
    job = run_command(command, tmp_path, timeout=120)
    assert job.returncode == 0, job.output[-3000:]
    assert job.output.count("in-job recovery: no: in-job recovery does not carry PowerSGD's per-rank error "
                            "feedback: a failure ends the job") == 1, job.output[-3000:]


def test_check_fails_with_reasons(mpirun, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    command = [mpirun, "-np", "2", sys.executable, "-m", "mpiddp", "check", "--runs-root", str(blocker / "runs"),
               "--wandb", "disabled"]
    job = run_command(command, tmp_path, timeout=120)
    assert job.returncode == 1
    assert "PROBLEMS:" in job.output and "cannot write to" in job.output


def test_report_plots_a_run_and_names_the_straggler(run_job):
    # rank 1 computes 50 ms longer per step: after the all-reduce every rank's step is as long, but its own
    # compute time shows it
    job = run_job(2, "--epochs", "2", "--no-progress", "--wandb", "disabled", "--inject-fault", "slow-compute:1:0")
    assert job.returncode == 0, job.output[-3000:]
    report = run_command([sys.executable, "-m", "mpiddp", "report", str(job.run_dir)], job.run_dir, timeout=120)
    assert report.returncode == 0, report.output
    for name in ("loss.png", "accuracy.png", "throughput.png", "rank_step_time.png"):
        assert (job.run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "digits_cnn on digits: 2 ranks on 1 hosts" in report.output
    assert "eval accuracy" in report.output and "mean data wait + compute per rank" in report.output
    assert "rank 1 is a straggler" in report.output and "the others' median: computing)" in report.output


def test_report_on_a_missing_run_is_one_line(tmp_path):
    job = run_command([sys.executable, "-m", "mpiddp", "report", str(tmp_path / "nope")], tmp_path, timeout=60)
    assert job.returncode == 2
    assert job.output.strip().startswith("mpiddp: error:") and len(job.output.strip().splitlines()) == 1
