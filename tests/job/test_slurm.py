"""A real Slurm (one node, Debian's 22.05): run/slurm.sbatch in both launch modes, stop signals, requeue."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, job_env
from slurmcluster import SlurmCluster, impossible_reason, missing_parts

pytestmark = pytest.mark.mpi
SBATCH = str(REPO / "run" / "slurm.sbatch")
SMALL = ("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10")  # overrides the script's header
FAST = ("--no-progress", "--wandb", "disabled")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = impossible_reason()
    if reason:
        pytest.skip(reason)
    missing = missing_parts()
    if missing:  # root, and Slurm installed or CI: the tier must run, not vanish in a skip
        pytest.fail(f"the Slurm tier should run here (root, Slurm installed or CI=true) but: {missing}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.up()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        cluster.down()
        pytest.fail(f"cannot start a test Slurm here, where it should start (root, Slurm installed or CI=true): "
                    f"{exc}")
    try:
        yield cluster
    finally:
        cluster.down()


def batch_env(launcher: str, **extra: str) -> dict[str, str]:
    env = job_env(LAUNCHER=launcher, **extra)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the venv's python and mpirun
    env.pop("CI", None)
    return env


def output(workdir: Path, job_id: int) -> str:
    path = workdir / f"mpiddp-{job_id}.out"
    return path.read_text() if path.is_file() else ""


def exit_code(info: dict[str, str]) -> int:
    return int(info["ExitCode"].split(":")[0])


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_sbatch_trains_on_a_cpu_partition(slurm, tmp_path, launcher):
    job_id = slurm.submit(*SMALL, "--job-name", f"cpu-{launcher}", SBATCH, "--epochs", "2", *FAST,
                          env=batch_env(launcher), cwd=tmp_path)
    info = slurm.wait_for(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), within_s=240)
    log = output(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED", log[-4000:]
    summary = json.loads((tmp_path / "runs" / f"cpu-{launcher}" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs"] == 2
    assert log.count("--resume: no snapshot in") == 1  # the first submission of an always-resuming job
    assert "\r" not in log  # no progress-bar frames in the batch log


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_scancel_signal_saves_the_same_step_and_requeue_continues(slurm, tmp_path, launcher):
    name = f"stop-{launcher}"
    job_id = slurm.submit(*SMALL, "--job-name", name, SBATCH, "--epochs", "400", *FAST,
                          env=batch_env(launcher), cwd=tmp_path)
    metrics = tmp_path / "runs" / name / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.is_file() and '"kind": "step"' in metrics.read_text()):  # training has started
        assert time.monotonic() < deadline, output(tmp_path, job_id)[-4000:]
        time.sleep(0.5)
    signalled = time.monotonic()
    assert slurm.run("scancel", "--batch", "--signal=USR1", str(job_id)).returncode == 0
    info = slurm.wait_for(job_id, ("COMPLETED", "FAILED", "CANCELLED"), within_s=120)
    stopped_in = time.monotonic() - signalled
    log = output(tmp_path, job_id)
    assert exit_code(info) == 3, log[-4000:]
    assert "snapshot saved in" in log and stopped_in < 60
    (tmp_path / f"stop-{launcher}.seconds").write_text(f"{stopped_in:.1f}\n")  # for the record
    # The stop snapshot: mid-epoch (-batchNNNNNN) or, when the signal landed during evaluation, the epoch's.
    checkpoints = tmp_path / "runs" / name / "checkpoints"
    snapshots = [(checkpoints / "latest").read_text().strip()]
    assert (checkpoints / snapshots[0]).is_file(), snapshots

    assert slurm.run("scontrol", "requeue", str(job_id)).returncode == 0
    info = slurm.wait_for(job_id, ("RUNNING",), within_s=120)  # after cred_expire (see slurmcluster.py)
    assert info["Restarts"] == "1"
    deadline = time.monotonic() + 120
    while "resumed from" not in output(tmp_path, job_id):
        assert time.monotonic() < deadline, output(tmp_path, job_id)[-4000:]
        time.sleep(0.5)
    assert f"{name}/checkpoints/{snapshots[0]}: epoch" in output(tmp_path, job_id)
    slurm.run("scancel", str(job_id))


def test_a_failing_rank_under_srun_ends_the_job_with_one_report(slurm, tmp_path):
    job_id = slurm.submit(*SMALL, "--job-name", "crash", SBATCH, "--epochs", "3", "--inject-fault", "raise:1:3",
                          *FAST, env=batch_env("srun"), cwd=tmp_path)
    info = slurm.wait_for(job_id, ("COMPLETED", "FAILED", "CANCELLED"), within_s=180)
    log = output(tmp_path, job_id)
    assert info["JobState"] == "FAILED" and exit_code(info) != 0, log[-4000:]
    assert log.count("injected fault on rank 1 at step 3") >= 1 and log.count("Traceback") == 1


def wait_for_training(workdir: Path, name: str, job_id: int) -> None:
    metrics = workdir / "runs" / name / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.is_file() and '"kind": "step"' in metrics.read_text()):  # training has started
        assert time.monotonic() < deadline, output(workdir, job_id)[-4000:]
        time.sleep(0.5)  # polling a file another process writes


def stop_snapshot(workdir: Path, name: str) -> str:
    checkpoints = workdir / "runs" / name / "checkpoints"
    latest = (checkpoints / "latest").read_text().strip()
    assert (checkpoints / latest).is_file(), latest
    return latest


def test_plain_scancel_saves_the_same_step_and_ends_the_job(slurm, tmp_path):
    """scancel signals every rank *and* the batch shell (which forwards SIGUSR1): one snapshot, exit 3, no requeue."""
    name = "scancel"
    job_id = slurm.submit(*SMALL, "--job-name", name, SBATCH, "--epochs", "400", *FAST,
                          env=batch_env("srun"), cwd=tmp_path)
    wait_for_training(tmp_path, name, job_id)
    assert slurm.run("scancel", str(job_id)).returncode == 0
    info = slurm.wait_for(job_id, ("COMPLETED", "FAILED", "CANCELLED"), within_s=120)
    log = output(tmp_path, job_id)
    assert info["JobState"] == "CANCELLED" and exit_code(info) == 3, log[-4000:]
    assert log.count("snapshot saved in") == 1 and "interrupted" not in log, log[-4000:]
    assert "not requeued" in log and info["Restarts"] == "0"
    stop_snapshot(tmp_path, name)


def test_preemption_saves_requeues_itself_and_continues_from_the_stop_snapshot(slurm, tmp_path):
    """A real preemption: a job in the high partition takes the node; the low one saves within its grace time,
    ends, requeues itself (Slurm would not: it ended by itself), and continues from its stop snapshot."""
    name = "preempted"
    job_id = slurm.submit(*SMALL, "--partition", "low", "--job-name", name, SBATCH, "--epochs", "400", *FAST,
                          env=batch_env("srun"), cwd=tmp_path)
    wait_for_training(tmp_path, name, job_id)
    urgent = slurm.submit("--partition", "high", "--ntasks=1", "--cpus-per-task=1", "--output", "urgent.out",
                          "--wrap", "true", cwd=tmp_path)
    slurm.wait_for(urgent, ("COMPLETED",), within_s=180)
    deadline = time.monotonic() + 180
    while "resumed from" not in output(tmp_path, job_id):
        assert time.monotonic() < deadline, output(tmp_path, job_id)[-4000:] + str(slurm.job(job_id))
        time.sleep(0.5)  # polling the scheduler's restart of the job
    log = output(tmp_path, job_id)
    assert "preempted; requeueing job" in log and log.count("snapshot saved in") == 1, log[-4000:]
    assert slurm.job(job_id)["Restarts"] == "1"
    # The requeued job starts from the last snapshot of its first life: the one saved on the stop.
    first_life = log[:log.index("preempted; requeueing job")]
    saved_before = re.findall(r"saved (\S+\.pt)", first_life)
    assert saved_before and re.search(r"resumed from (\S+\.pt): epoch", log).group(1) == saved_before[-1], log[-4000:]
    slurm.run("scancel", str(job_id))


def attempts(workdir: Path, name: str) -> dict:
    return json.loads((workdir / "runs" / name / "attempts.json").read_text())


def slurm_rank_pid(run_dir: str, rank: int) -> int | None:
    """The pid of task `rank` of the srun step training into `run_dir` (srun's own command line matches too, and
    it and the batch shell carry SLURM_PROCID=0: the rank is told by the SLURM_PROCID its task was given)."""
    found = subprocess.run(["pgrep", "-f", f"mpiddp --run-dir {run_dir}"], capture_output=True, text=True).stdout
    for pid in found.split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_PROCID={rank}".encode() in environ and b"srun" not in cmdline[0] and b"SLURM_STEP_ID=0" in environ:
            return int(pid)
    return None


def kill_rank_after_a_snapshot(workdir: Path, name: str, job_id: int, rank: int) -> None:
    """SIGKILL (as the OOM killer would) task `rank` of the job's first srun step once a snapshot exists.
    (--inject-fault kill never fires here: run/slurm.sbatch always passes --resume.)"""
    latest = workdir / "runs" / name / "checkpoints" / "latest"
    deadline = time.monotonic() + 180
    pid = None
    while pid is None:
        assert time.monotonic() < deadline, output(workdir, job_id)[-4000:]
        time.sleep(0.2)  # polling files and processes another program makes
        pid = slurm_rank_pid(f"runs/{name}", rank) if latest.is_file() else None
    os.kill(pid, signal.SIGKILL)


def test_a_killed_rank_inside_sbatch_is_relaunched_with_srun(slurm, tmp_path):
    """launch in the batch shell: rank 1 dies by SIGKILL after a snapshot; srun reports it, and launch relaunches
    with srun and --resume. The one node has no spare, so HOST_STRIKES=2 lets it be tried again."""
    name = "healed"
    # 10 epochs of a fraction of a second each: the kill, well under a second after the first snapshot, lands
    # long before the end (9 epochs: test_drill's 2b saw a busy CI machine 2 epochs late), and the relaunch has
    # 9 epochs to train
    job_id = slurm.submit(*SMALL, "--job-name", name, SBATCH, "--epochs", "10", *FAST,
                          env=batch_env("srun", HOST_STRIKES="2"), cwd=tmp_path)
    kill_rank_after_a_snapshot(tmp_path, name, job_id, 1)
    info = slurm.wait_for(job_id, ("COMPLETED", "FAILED", "CANCELLED"), within_s=300)
    log = output(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and exit_code(info) == 0, log[-5000:]
    record = attempts(tmp_path, name)
    assert record["restarts"] == 1 and record["excluded_hosts"] == [], record
    first, second = record["attempts"]
    node = first["hosts"][0]
    assert (first["cause"], first["failed_ranks"], first["failed_hosts"]) == ("killed", [1], [node]), first
    assert first["cause_source"] == "launcher output" and f"srun: error: {node}: task 1: Killed" in log
    assert f"{node}: failure 1 of --host-strikes 2" in first["decision"]
    assert second["status"] == 0 and second["command"][0].endswith("srun") and "--resume" in second["command"]
    summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
    assert "snapshot-epoch" in summary["resumed_from"] and summary["epochs"] == 10


def test_a_killed_rank_on_the_only_node_ends_the_job_by_default(slurm, tmp_path):
    """Without a spare node and with the default --host-strikes 1 there is nowhere to relaunch: one attempt,
    the job fails, and the decision says how to retry the node."""
    name = "lone"
    job_id = slurm.submit(*SMALL, "--job-name", name, SBATCH, "--epochs", "60", *FAST, env=batch_env("srun"),
                          cwd=tmp_path)
    kill_rank_after_a_snapshot(tmp_path, name, job_id, 1)
    info = slurm.wait_for(job_id, ("COMPLETED", "FAILED", "CANCELLED"), within_s=240)
    log = output(tmp_path, job_id)
    assert info["JobState"] == "FAILED" and exit_code(info) != 0, log[-5000:]
    (only,) = attempts(tmp_path, name)["attempts"]
    assert only["cause"] == "killed" and "cannot relaunch without" in only["decision"], only
    assert "--host-strikes 2" in only["decision"]
