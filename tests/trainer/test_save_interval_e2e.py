"""--save-interval under mpirun: a rank killed mid-epoch costs only the steps since the last snapshot by time,
and `--resume auto` continues from that mid-epoch snapshot to the same weights as a run never interrupted."""

import re

import pytest
import torch

pytestmark = pytest.mark.mpi
FLAGS = ("--epochs", "2", "--batch-size", "16", "--deterministic", "--seed", "5", "--no-progress",
         "--wandb", "disabled", "--log-every", "1")
KILLED_AFTER_STEP = 12  # of about 45 per epoch: well inside epoch 1


def final_weights(run_dir):
    return torch.load(run_dir / "checkpoints" / "snapshot-epoch0002.pt", weights_only=True)["model"]


def test_a_killed_run_resumes_from_its_last_snapshot_by_time_mid_epoch_and_ends_as_the_straight_run(run_job, tmp_path):
    straight = run_job(2, *FLAGS, run_dir=tmp_path / "straight")
    assert straight.returncode == 0, straight.output[-3000:]
    assert straight.summary["snapshots"]["count"] == 2  # by epoch only, without the flag

    # An interval far below a step's time: rank 0's clock asks for a snapshot at (nearly) every step.
    run_dir = tmp_path / "killed"
    timed = ("--save-interval", "0.001", "--keep-last", "2")
    killed = run_job(2, *FLAGS, *timed, "--inject-fault", f"kill:1:{KILLED_AFTER_STEP}", run_dir=run_dir)
    assert killed.returncode != 0, killed.output[-3000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    match = re.fullmatch(r"snapshot-epoch0000-batch(\d{6})\.pt", latest)
    assert match, latest  # a snapshot part-way through epoch 1, taken by time
    saved_at = int(match.group(1))
    assert 0 < saved_at < KILLED_AFTER_STEP
    assert re.search(rf"saved \S+{latest} in \d+\.\d\d s \(\d+\.\d MB\)", killed.output), killed.output[-3000:]
    assert len(list((run_dir / "checkpoints").glob("snapshot-*.pt"))) <= 2  # time saves rotate like epoch saves

    resumed = run_job(2, *FLAGS, *timed, "--resume", "auto", run_dir=run_dir)
    assert resumed.returncode == 0, resumed.output[-3000:]
    summary = resumed.summary
    assert summary["resumed_from"].endswith(latest)
    starts = [m for m in resumed.metrics if m["kind"] == "start"]
    assert starts[-1]["step"] == saved_at  # one batch per step: nothing trained after the snapshot is redone twice
    snapshots = summary["snapshots"]
    assert set(snapshots) == {"count", "total_s", "max_s", "mean_s", "bytes_last"}
    assert snapshots["count"] >= 2 and 0 < snapshots["max_s"] <= snapshots["total_s"] and snapshots["bytes_last"] > 0
    assert snapshots["bytes_last"] == (run_dir / "checkpoints" / "snapshot-epoch0002.pt").stat().st_size

    expected, got = final_weights(tmp_path / "straight"), final_weights(run_dir)
    assert max(float((expected[name].double() - got[name].double()).abs().max()) for name in expected) == 0.0
