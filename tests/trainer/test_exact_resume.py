"""Exact resume with a realistic model and loader: dropout (mobilenet_v2), on-disk CIFAR-10 with random
augmentation, loader workers; a stop part-way through an epoch, then --resume, ends bit-identical, on 2 ranks and
on 3 (where the order of the all-reduce's sums shows)."""

import pytest
import torch

from datagen import write_cifar10

pytestmark = pytest.mark.mpi
FLAGS = ("--dataset", "cifar10", "--arch", "mobilenet_v2", "--num-classes", "10", "--batch-size", "16",
         "--epochs", "2", "--num-workers", "2", "--deterministic", "--seed", "3", "--no-progress", "--wandb", "disabled")


def final_weights(run_dir):
    return torch.load(run_dir / "checkpoints" / "snapshot-epoch0002.pt", weights_only=True)["model"]


def test_stop_mid_epoch_and_resume_equals_the_straight_run_bit_for_bit(run_job, tmp_path):
    # 160 training images: 80 per rank, 5 steps of 16 per epoch; the stop comes after step 7, in epoch 2, where
    # the workers are persistent, the loader's iterator has run before and dropout has drawn for 7 steps.
    data = ("--data-dir", str(write_cifar10(tmp_path / "data", per_batch=32, test=20)))
    straight = run_job(2, *FLAGS, *data, run_dir=tmp_path / "straight")
    assert straight.returncode == 0, straight.output[-3000:]

    run_dir = tmp_path / "stopped"
    stopped = run_job(2, *FLAGS, *data, "--inject-fault", "signal:all:7", run_dir=run_dir)
    assert stopped.returncode == 3, stopped.output[-3000:]
    assert (run_dir / "checkpoints" / "snapshot-epoch0001-batch000002.pt").exists()
    resumed = run_job(2, *FLAGS, *data, "--resume", run_dir=run_dir)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.summary["resumed_from"].endswith("snapshot-epoch0001-batch000002.pt")

    expected, got = final_weights(tmp_path / "straight"), final_weights(run_dir)
    difference = max(float((expected[name].double() - got[name].double()).abs().max()) for name in expected)
    assert difference == 0.0


def test_with_3_ranks_too_a_resume_equals_the_straight_run_bit_for_bit(run_job, tmp_path):
    """With 3 ranks gloo's ring all-reduce sums each gradient element in an order set by its place in DDP's bucket:
    DDP lays the buckets out again after a job's first step, so the resumed job's first step (step 5) used to
    all-reduce in the first layout where the straight run used the second, and the weights differed by 1e-8 to 9e-8
    (2 ranks cannot show it: a + b = b + a). --deterministic keeps the first layout in every job."""
    data = ("--data-dir", str(write_cifar10(tmp_path / "data", per_batch=32, test=20)))
    flags = (*FLAGS, *data, "--grad-transport", "gloo")  # MPI's all-reduce here sums in a fixed order
    straight = run_job(3, *flags, run_dir=tmp_path / "straight")
    assert straight.returncode == 0, straight.output[-3000:]

    # 160 images on 3 ranks: 53 each, 3 steps of 16 an epoch; the stop comes after step 5, in epoch 2
    run_dir = tmp_path / "stopped"
    stopped = run_job(3, *flags, "--inject-fault", "signal:all:5", run_dir=run_dir)
    assert stopped.returncode == 3, stopped.output[-3000:]
    resumed = run_job(3, *flags, "--resume", run_dir=run_dir)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.summary["resumed_from"].endswith("snapshot-epoch0001-batch000002.pt")
    assert resumed.summary["grad_transport"]["chosen"] == "gloo"
    assert "find_unused_parameters" not in straight.output + resumed.output  # torch's C++ warnings are quiet

    expected, got = final_weights(tmp_path / "straight"), final_weights(run_dir)
    difference = max(float((expected[name].double() - got[name].double()).abs().max()) for name in expected)
    assert difference == 0.0
