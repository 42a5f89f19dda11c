"""Stop signals: every rank stops at the same step, saves, exits 3; --resume continues exactly."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, JobResult, job_env, rank_pid, rank_pids

pytestmark = pytest.mark.mpi
FLAGS = ("--epochs", "3", "--batch-size", "8", "--deterministic", "--no-progress", "--wandb", "disabled")
FINAL = ("--model-filename", "final.pt")  # the reference run's final model (training is the same without it)


def start(mpirun, run_dir, *flags):
    command = [mpirun, "-np", "2", sys.executable, "-m", "mpiddp", "--run-dir", str(run_dir), *FLAGS, *flags]
    return subprocess.Popen(command, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(process, text, seen):
    for line in process.stdout:
        seen.append(line)
        if text in line:
            return
    pytest.fail("job ended before: " + text + "\n" + "".join(seen)[-3000:])


def finish(process, seen, timeout=120) -> str:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("job did not stop: " + "".join(seen)[-3000:])
    return "".join(seen) + output


def final_weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "snapshot-epoch0003.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def straight(mpirun, tmp_path_factory) -> JobResult:
    """One uninterrupted run of FLAGS (and a final model file), the reference every stop-and-resume here must equal:
    the same job for each of them, so it runs once (a launch of 2 ranks is most of each test's time)."""
    run_dir = tmp_path_factory.mktemp("signals") / "straight"
    process = start(mpirun, run_dir, *FINAL)
    output = finish(process, [])
    assert process.returncode == 0, output[-3000:]
    return JobResult(0, output, 0, run_dir)


@pytest.mark.floor  # also run against the oldest supported torch in CI
@pytest.mark.parametrize("target", ["mpirun-SIGUSR1", "rank1-SIGTERM"])
def test_signal_stops_every_rank_at_one_step_and_resume_is_exact(mpirun, tmp_path, target, straight):
    run_dir = tmp_path / "stopped"
    process, seen = start(mpirun, run_dir), []
    wait_for(process, "epoch 1/3 |", seen)
    if target == "mpirun-SIGUSR1":
        process.send_signal(signal.SIGUSR1)  # Open MPI forwards SIGUSR1 to every rank
    else:
        os.kill(rank_pid(run_dir, 1), signal.SIGTERM)  # one rank only, as a preempting scheduler might
    output = finish(process, seen)
    assert process.returncode == 3, output[-3000:]
    stopped = [p.name for p in (run_dir / "checkpoints").glob("snapshot-epoch0001-batch*.pt")]
    assert len(stopped) == 1, sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert output.count("snapshot saved in") == 1  # rank 0 speaks for the job

    resumed = subprocess.run(
        [mpirun, "-np", "2", sys.executable, "-m", "mpiddp", "--run-dir", str(run_dir), *FLAGS, "--resume"],
        cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=180,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert JobResult(0, "", 0, run_dir).summary["resumed_from"].endswith(stopped[0])
    expected, got = final_weights(straight.run_dir), final_weights(run_dir)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


class SignalStorm:
    """Sends SIGTERM and then SIGUSR1 to every rank, over and over, as Slurm's scancel/preemption plus the
    batch script's forwarding do, until the job ends: whatever phase each signal lands in."""

    def __init__(self, run_dir: Path, signals=(signal.SIGTERM, signal.SIGUSR1)) -> None:
        import threading

        self.run_dir, self.signals, self.sent = run_dir, signals, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._storm, daemon=True)

    def _storm(self) -> None:
        while not self.done.is_set():
            for signum in self.signals:
                for pid in rank_pids(self.run_dir).values():
                    try:
                        os.kill(pid, signum)
                        self.sent += 1
                    except ProcessLookupError:
                        pass
                self.done.wait(0.1)  # spacing between signals, as the batch shell's forwarding has

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


@pytest.mark.parametrize("from_line", ["epoch 1/3 |", "every rank runs"])
def test_any_number_of_stop_signals_in_any_phase_give_one_snapshot_and_exit_3(mpirun, tmp_path, from_line):
    run_dir = tmp_path / "storm"
    process, seen = start(mpirun, run_dir), []
    wait_for(process, from_line, seen)
    with SignalStorm(run_dir) as storm:
        output = finish(process, seen)
    assert storm.sent >= 2
    assert process.returncode == 3, output[-3000:]
    assert "interrupted" not in output and "Traceback" not in output, output[-3000:]
    snapshots = sorted(p.name for p in (run_dir / "checkpoints").glob("snapshot-*.pt")) if (run_dir / "checkpoints").is_dir() else []
    if from_line.startswith("epoch"):
        # The epoch-1 snapshot (save_every) and exactly one stop snapshot after it.
        assert len([name for name in snapshots if name != "snapshot-epoch0001.pt"]) == 1, snapshots
        assert output.count("snapshot saved in") == 1
    else:  # stopped during start-up, before any step: nothing to save, nothing lost
        assert snapshots == [], snapshots
        assert "nothing trained since the last snapshot" in output


def test_third_ctrl_c_ends_a_rank_at_once(mpirun, tmp_path):
    run_dir = tmp_path / "interrupt"
    process, seen = start(mpirun, run_dir, "--inject-fault", "stall:1:2"), []  # rank 1 never reaches a step's end
    # Rank 1 is stuck before the Ctrl-Cs come: a stop agreed at an earlier step would end the job cleanly (exit 3),
    # and its late Ctrl-Cs would land in a teardown, where they no longer count.
    wait_for(process, "injecting fault 'stall'", seen)
    for _ in range(3):
        for pid in rank_pids(run_dir).values():
            os.kill(pid, signal.SIGINT)
        time.sleep(0.3)  # a person pressing Ctrl-C three times, not synchronisation
    output = finish(process, seen, timeout=60)
    # The rank died of its third SIGINT (the launcher may lose its last words: the message is tested in-process).
    assert process.returncode not in (0, 3), output[-3000:]


# 80 training images: 40 per rank, 5 steps of 8 per epoch. Each drill sends SIGUSR1 to every process of each
# rank's process group (the rank, its loader's forkserver and workers), as mpirun and srun deliver a stop.
# With spawn the workers are the rank's children: one killed raises at once in the rank (torch's SIGCHLD
# handler). A forkserver's workers are not, and the batches the rank still needs are usually prefetched; the
# forkserver's own signal dispositions are checked in tests/trainer/test_loader_helpers.py.
# One worker per loader: a stop that ends a worker fails the job with one as with two (torch raises for any of
# them), and each spawned worker imports torch anew.
PHASES = {
    "start-up": ("signal:all:0", "forkserver", "snapshot-epoch0000-batch000001.pt"),  # first batch loaded
    "mid-epoch": ("signal:all:2", "spawn", "snapshot-epoch0000-batch000002.pt"),
    "epoch-boundary": ("signal:all:5", "forkserver", None),  # after the epoch's last step, before its evaluation
    "evaluation": ("signal-eval:all:5", "spawn", "snapshot-epoch0001.pt"),  # the eval loader's workers running
}


@pytest.mark.parametrize("phase", PHASES)
def test_a_stop_to_the_process_group_leaves_loader_helpers_alive(run_job, tmp_path, phase):
    from datagen import write_cifar10

    drill, start_method, snapshot = PHASES[phase]
    data_dir = write_cifar10(tmp_path / "data", per_batch=16, test=20)
    job = run_job(2, "--dataset", "cifar10", "--data-dir", str(data_dir), "--arch", "digits_cnn", "--epochs", "2",
                  "--batch-size", "8", "--num-workers", "1", "--worker-start-method", start_method, "--no-progress",
                  "--wandb", "disabled", "--inject-fault", drill, timeout=120)
    assert job.returncode == 3, job.output[-3000:]
    assert "DataLoader worker" not in job.output and "BrokenPipeError" not in job.output
    saved = sorted(p.name for p in (job.run_dir / "checkpoints").glob("snapshot-*.pt"))
    assert saved and (snapshot is None or saved[-1] == snapshot), saved


def importing_numpy(pid: int) -> bool:
    """Whether the process has begun loading numpy (its first heavy import): deep in a rank's start-up."""
    try:
        return "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_sigterm_during_start_up_imports_stops_with_exit_3(mpirun, tmp_path):
    run_dir = tmp_path / "early"
    process = start(mpirun, run_dir)
    pids: dict[int, int] = {}
    deadline = time.monotonic() + 60
    while len(pids) < 2 and process.poll() is None and time.monotonic() < deadline:
        pids = rank_pids(run_dir)
    signalled = set()
    while len(signalled) < 2 and process.poll() is None and time.monotonic() < deadline:
        for rank, pid in pids.items():  # no pause: the SIGTERM must land while the rank still imports
            if rank not in signalled and importing_numpy(pid):
                os.kill(pid, signal.SIGTERM)
                signalled.add(rank)
    output = finish(process, [])
    assert signalled == {0, 1}, output[-3000:]
    assert process.returncode == 3, output[-3000:]
    assert "nothing trained since the last snapshot" in output, output[-3000:]


def python_handles_sigint(pid: int) -> bool | None:
    """Whether a Python handler still catches SIGINT in the process (None once it is gone). Python takes its
    handlers away late in its finalization, before MPI_Finalize (mpi4py's Py_AtExit) runs."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught & (1 << (signal.SIGINT - 1)))


def test_ctrl_c_during_the_teardown_of_a_stop_keeps_exit_3(mpirun, tmp_path):
    run_dir = tmp_path / "teardown"
    process, seen = start(mpirun, run_dir), []
    wait_for(process, "epoch 1/3 |", seen)
    pids = rank_pids(run_dir)
    for pid in pids.values():
        os.kill(pid, signal.SIGTERM)
    wait_for(process, "(exit status 3)", seen)  # the stop is decided, saved and logged: the ranks tear down now
    # One late Ctrl-C (or a launcher forwarding one) in the last part of a rank's teardown: once Python's
    # handler for SIGINT is gone (interpreter shutdown, MPI_Finalize), whatever the kernel does with it decides.
    waiting, signalled = dict(pids), 0
    deadline = time.monotonic() + 60
    while waiting and time.monotonic() < deadline:
        for rank, pid in list(waiting.items()):
            handled = python_handles_sigint(pid)
            if handled is False:
                try:
                    os.kill(pid, signal.SIGINT)
                    signalled += 1
                except ProcessLookupError:
                    pass
            if handled is not True:
                del waiting[rank]
    output = finish(process, seen)
    assert signalled, "both ranks had ended before the SIGINT: the case was not exercised"
    assert process.returncode == 3, output[-3000:]


def test_a_stop_during_the_last_evaluation_leaves_the_outputs_to_resume(run_job, tmp_path, straight):
    flags = (*FLAGS, *FINAL)
    expected = [r for r in straight.metrics if r["kind"] == "epoch"]
    run_dir = tmp_path / "stopped"
    # The drill signals at the first batch of epoch 3's evaluation: its training is complete, its record not written.
    stopped = run_job(2, *flags, "--inject-fault", f"signal-eval:0:{expected[-1]['step']}", run_dir=run_dir)
    assert stopped.returncode == 3, stopped.output[-3000:]
    assert not (run_dir / "summary.json").exists() and not (run_dir / "checkpoints" / "final.pt").exists()

    resumed = run_job(2, *flags, "--resume", run_dir=run_dir)
    assert resumed.returncode == 0 and "nothing to do" not in resumed.output, resumed.output[-3000:]
    got = [r for r in resumed.metrics if r["kind"] == "epoch"]
    same = ("epoch", "step", "train_loss", "eval_loss", "eval_accuracy", "lr")
    assert [{k: r[k] for k in same} for r in got] == [{k: r[k] for k in same} for r in expected]
    assert [sorted(r) for r in got] == [sorted(r) for r in expected]
    summary, reference = resumed.summary, straight.summary
    assert sorted(summary) == sorted(reference)
    assert [summary[k] for k in ("epochs", "train_loss", "eval_loss", "eval_accuracy")] == \
        [reference[k] for k in ("epochs", "train_loss", "eval_loss", "eval_accuracy")]
    weights = torch.load(run_dir / "checkpoints" / "final.pt", weights_only=True)
    reference_weights = torch.load(straight.run_dir / "checkpoints" / "final.pt", weights_only=True)
    assert sorted(weights) == sorted(reference_weights)
    assert all(torch.equal(weights[name], reference_weights[name]) for name in weights)

    again = run_job(2, *flags, "--resume", run_dir=run_dir)  # the outputs are complete now: nothing is redone
    assert again.returncode == 0 and "nothing to do" in again.output, again.output[-3000:]
    assert len([r for r in again.metrics if r["kind"] == "epoch"]) == 3
