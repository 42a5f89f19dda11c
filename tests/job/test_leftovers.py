"""Never hang, never leave processes behind: a rank killed with data-loader workers, a watchdog abort, and a killed
supervisor each end the job, and nothing of it is left running."""

import os
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import job_env, run_command
from datagen import write_cifar10

pytestmark = pytest.mark.mpi
MARK = "MPIDDP_TEST_JOB"  # set in the job's environment: every process of the job inherits it
SMALL = ("--dataset", "cifar10", "--arch", "digits_cnn", "--num-classes", "10", "--batch-size", "16",
         "--no-progress", "--wandb", "disabled")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_cifar10(tmp_path_factory.mktemp("cifar"), per_batch=32, test=20)


def marked_env(**extra):
    """The job's environment with a mark of its own, and that mark."""
    mark = uuid.uuid4().hex
    return job_env(**{MARK: mark}, **extra), mark


def processes_of(mark: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment carries the job's mark (zombies have none)."""
    wanted = f"{MARK}={mark}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def where_they_wait(mark: str) -> str:
    """For a job that did not end: each live process of it, its state and where each of its threads waits in the
    kernel (a launcher deadlocked on its own heap waits in futex_wait; a rank blocked on a peer, in a poll)."""
    from collections import Counter

    lines = []
    for pid, command in sorted(processes_of(mark).items()):
        threads: Counter = Counter()  # (state, wait channel) -> how many threads; the main thread's first
        for task in sorted(Path(f"/proc/{pid}/task").glob("*"), key=lambda task: int(task.name) != pid):
            try:
                state = next(line.split()[1] for line in (task / "status").read_text().splitlines()
                             if line.startswith("State:"))
                wchan = (task / "wchan").read_text().strip()
                threads[f"{state} {wchan if wchan not in ('', '0') else '-'}"] += 1  # '0': not waiting
            except (OSError, StopIteration):
                continue
        counted = ", ".join(f"{count} x {where}" if count > 1 else where for where, count in threads.items())
        lines.append(f"{pid} {command[:100]}: {counted}")
    return "\n".join(lines)


def kill_supervisor_and_wait(supervisor, mark: str) -> None:
    """SIGKILL `launch` itself; its ranks hear of it, save a snapshot and end: wait for that, then nothing of the job
    may be left running."""
    import signal

    if supervisor.poll() is None:
        supervisor.send_signal(signal.SIGKILL)
    supervisor.wait()
    deadline = time.monotonic() + 120
    while processes_of(mark) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling a condition with a deadline: the ranks save a snapshot, then the job ends
    assert_nothing_left(mark)


def assert_nothing_left(mark: str) -> None:
    """Poll (a process killed a moment ago may still be exiting) with a generous deadline, then kill what is left
    so that one failure does not leave processes for the tests after it."""
    deadline = time.monotonic() + 30
    while (left := processes_of(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling a condition with a deadline, not synchronising
    where = where_they_wait(mark) if left else ""  # before the kill: what kept them
    for pid in left:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    assert not left, f"left running after the job: {left}\n{where}"


@pytest.mark.parametrize("workers,fault", [(1, ("--inject-fault", "kill:1:3")), (4, ("--inject-fault", "kill:1:3")),
                                           (1, ("--inject-fault", "stall:1:3", "--hang-timeout", "8"))],
                         ids=["killed-1-worker", "killed-4-workers", "watchdog-1-worker"])
def test_a_rank_that_dies_with_loader_workers_ends_the_job_and_leaves_nothing(mpirun, tmp_path, data_dir, workers,
                                                                             fault):
    run_dir = tmp_path / "run"
    env, mark = marked_env()
    command = [mpirun, "-np", "2", sys.executable, "-m", "mpiddp", "--run-dir", str(run_dir), *SMALL,
               "--data-dir", str(data_dir), "--num-workers", str(workers), "--epochs", "2", *fault]
    try:
        job = run_command(command, run_dir, timeout=150, env=env)
        assert job.returncode != 0, job.output[-3000:]
    finally:
        assert_nothing_left(mark)


def test_under_launch_a_rank_killed_with_loader_workers_ends_the_attempt_and_leaves_nothing(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    env, mark = marked_env()
    command = [sys.executable, "-m", "mpiddp", "launch", "-np", "2", "--max-restarts", "0", "--no-in-job-recovery", "--", "--run-dir",
               str(run_dir), *SMALL, "--data-dir", str(data_dir), "--num-workers", "1", "--epochs", "2",
               "--inject-fault", "kill:1:3"]
    try:
        job = run_command(command, run_dir, timeout=150, env=env)
    finally:
        assert_nothing_left(mark)
    assert job.returncode != 0, job.output[-3000:]
    assert "attempt 0 failed" in job.output and "killed" in job.output, job.output[-3000:]


def test_a_killed_supervisor_stops_the_job_with_a_snapshot_and_the_record_says_why(tmp_path):
    import json
    import subprocess

    from conftest import REPO

    run_dir = tmp_path / "run"
    env, mark = marked_env()
    launch = [sys.executable, "-m", "mpiddp", "launch", "-np", "2", "--"]
    # Quiet: the launcher has nothing to write to its dead supervisor's pipes, so only being told stops it.
    flags = ("--run-dir", str(run_dir), "--no-progress", "--wandb", "disabled", "--log-every", "1000",
             "--log-level", "warning")
    with (tmp_path / "launch.log").open("w") as log:
        supervisor = subprocess.Popen([*launch, *flags, "--epochs", "100"], cwd=REPO, env=env,
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while not _trained(run_dir) and supervisor.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # polling a condition with a deadline, not synchronising
        assert _trained(run_dir), (tmp_path / "launch.log").read_text()[-3000:]
    finally:
        kill_supervisor_and_wait(supervisor, mark)
    from mpiddp import failure

    (found,) = [r for r in failure.read_all(run_dir / failure.FAILURES_DIR) if "supervisor" in r.message]
    record = {"kind": found.kind, "message": found.message, "step": found.step}
    assert record["kind"] == "stopped" and "supervisor" in record["message"], record
    assert "rerun the same launch command" in record["message"].lower()
    last = json.loads((run_dir / "attempts.json").read_text())["attempts"][-1]
    assert last["status"] == 3 and "supervisor died" in last["decision"], last
    assert last["failed_at_step"] == record["step"]
    import torch

    snapshot = torch.load(run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip(),
                          weights_only=False)
    assert snapshot["step"] == record["step"]  # every rank saved at the stop's step: the normal stop path
    epochs = snapshot["epoch"] + 2  # one more epoch than the stop reached
    resumed = run_command([*launch, *flags, "--epochs", str(epochs), "--resume"], run_dir, timeout=240, env=env)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.summary["resumed_from"] and resumed.summary["epochs"] == epochs
    assert_nothing_left(mark)


def _trained(run_dir: Path) -> bool:
    """Training made progress: metrics.jsonl has a record of a finished step."""
    from mpiddp.failure import read_metrics

    return any(record.get("kind") != "start" for record in read_metrics(run_dir))


def test_a_script_under_run_killed_with_loader_workers_ends_the_job_and_leaves_nothing(mpirun, tmp_path):
    """The same for the user's own script under `mpiddp run` (found by an outside review: only the built-in
    trainer's loaders had helpers that die with their rank)."""
    from conftest import REPO

    env, mark = marked_env()
    command = [mpirun, "-np", "2", sys.executable, "-m", "mpiddp", "run", str(REPO / "tests/programs/loader_kill.py")]
    try:
        job = run_command(command, tmp_path / "run", timeout=150, env=env)
        assert job.returncode != 0, job.output[-3000:]
    finally:
        assert_nothing_left(mark)
