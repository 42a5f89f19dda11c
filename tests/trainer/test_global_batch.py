"""A resume on fewer ranks at the same global batch (launch --min-np), in-process: the epoch continues at its exact
sample, every step trains the same samples as without the failure, and each sample keeps its augmentation seed."""

import logging

import pytest
from torch.utils.data import DistributedSampler

from mpiddp.globalbatch import split
from mpiddp.job.collective import solo_dist
from mpiddp.trainer.config import Config
from mpiddp.trainer.data import SkippingSampler
from mpiddp.trainer.snapshot import Snapshot, rng_state
from mpiddp.trainer.state import build_state

EPOCH, SEED = 3, 7


def shard(num_samples, world_size, rank, skip=0):
    """(index, augmentation seed) of one rank's epoch, as the trainer's loader draws them."""
    sampler = SkippingSampler(DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank, shuffle=True,
                                                 seed=SEED))
    sampler.set_epoch(EPOCH)
    sampler.skip = skip
    return list(sampler)


def steps(num_samples, world_size, batch, accum, skip_batches=0):
    """Each optimizer step's samples (a set of (index, seed)) over all ranks; the loader drops a partial batch."""
    shards = [shard(num_samples, world_size, rank, skip_batches * batch) for rank in range(world_size)]
    batches = min(len(s) for s in shards) // batch
    return [{pair for s in shards for pair in s[step * accum * batch:(step + 1) * accum * batch]}
            for step in range(-(-batches // accum))]


def snapshot_at(world_size, batch, accum, batches_done):
    return Snapshot(arch="digits_cnn", model={}, optimizer={}, scheduler={}, epoch=EPOCH - 1, step=0, rng=[],
                    world_size=world_size, batches_done=batches_done, config={"batch_size": batch, "grad_accum": accum})


@pytest.mark.parametrize("num_samples, world, batch, new_world, stop_after", [
    (96, 2, 4, 1, 5),  # 2 ranks of 4 -> 1 rank of 4 x 2 accumulation
    (120, 3, 4, 2, 4),  # 3 ranks of 4 -> 2 ranks of 3 x 2: 4 per rank does not divide the 6 each rank now needs
    (97, 2, 4, 1, 5),  # an odd number of samples: the padded shard's tail ends the same way
])
def test_an_epoch_stopped_on_more_ranks_and_resumed_on_fewer_trains_each_sample_once(
        num_samples, world, batch, new_world, stop_after):
    uninterrupted = steps(num_samples, world, batch, 1)
    new_batch, new_accum = split(batch * world, new_world, batch)
    done, restarts = snapshot_at(world, batch, 1, stop_after).position_on(new_world, new_batch, new_accum)
    assert restarts == ""
    resumed = uninterrupted[:stop_after] + steps(num_samples, new_world, new_batch, new_accum, done)
    assert resumed == uninterrupted  # step by step the same samples, with the same augmentation seeds
    seen = [index for step in resumed for index, _ in step]
    assert len(seen) == len(set(seen))  # none twice
    if num_samples % (batch * world) == 0:
        assert sorted(seen) == list(range(num_samples))  # none left out


def test_another_global_batch_or_a_position_between_steps_restarts_the_epoch():
    assert snapshot_at(2, 4, 1, 5).position_on(1, 4, 1)[1].endswith("on another world size: that epoch restarts from "
                                                                      "its beginning")
    assert snapshot_at(2, 4, 1, 5).position_on(1, 4, 2) == (10, "")
    assert snapshot_at(3, 4, 1, 1).position_on(2, 3, 2) == (2, "")
    assert snapshot_at(4, 2, 1, 1).position_on(3, 1, 3)[0] == 0  # a global batch of 8 is not 9
    assert snapshot_at(2, 4, 1, 0).position_on(1, 4, 2) == (0, "")


@pytest.mark.usefixtures("solo_group")
def test_restoring_on_fewer_ranks_at_the_same_global_batch_continues_the_epoch(caplog):
    dist = solo_dist()
    cfg = Config.of(device="cpu", batch_size=32, global_batch=64).for_world(1)
    state = build_state(cfg, dist, 10, 1, batches_per_epoch=44)
    taken = snapshot_at(2, 32, 1, 6)
    taken.model, taken.optimizer = state.unwrapped.state_dict(), state.optimizer.state_dict()
    taken.scheduler, taken.rng = state.scheduler.state_dict(), [rng_state(dist.device)] * 2
    with caplog.at_level(logging.INFO):
        taken.restore_into(state, dist, seed=0, batch_size=cfg.training.batch_size, grad_accum=cfg.training.grad_accum)
    assert (state.epoch, state.batches_done) == (EPOCH - 1, 12)
    assert ("resuming a 2-rank snapshot on 1 ranks at the same global batch 64 (32 per rank x 1 ranks x 2 "
            "accumulation): epoch 3 continues after its first 384 samples") in caplog.text
    assert "the global batch is now" not in caplog.text


# --- a real job: stopped part-way through an epoch on 2 ranks, resumed on 1 at the same global batch --------------

FLAGS = ("--dataset", "cifar10", "--arch", "digits_cnn", "--batch-size", "16", "--global-batch", "32", "--epochs", "2",
         "--num-workers", "0", "--deterministic", "--seed", "3", "--no-progress", "--wandb", "disabled")


def final_weights(run_dir):
    import torch

    return torch.load(run_dir / "checkpoints" / "snapshot-epoch0002.pt", weights_only=True)["model"]


@pytest.mark.mpi
def test_stopped_mid_epoch_on_two_ranks_and_resumed_on_one_ends_where_the_straight_run_does(run_job, tmp_path):
    from datagen import write_cifar10

    # 160 images with random crops and flips: 5 steps of 32 per epoch; the stop comes after step 7, 2 batches of
    # 16 per rank into epoch 2, and one rank continues with 4 batches done and 2 micro-batches of 16 per step.
    data = ("--data-dir", str(write_cifar10(tmp_path / "data", per_batch=32, test=20)))
    straight = run_job(2, *FLAGS, *data, run_dir=tmp_path / "straight")
    assert straight.returncode == 0, straight.output[-3000:]
    run_dir = tmp_path / "shrunk"
    stopped = run_job(2, *FLAGS, *data, "--inject-fault", "signal:all:7", run_dir=run_dir)
    assert stopped.returncode == 3 and (run_dir / "checkpoints" / "snapshot-epoch0001-batch000002.pt").exists(), \
        stopped.output[-3000:]
    resumed = run_job(1, *FLAGS, *data, "--resume", run_dir=run_dir)
    assert resumed.returncode == 0, resumed.output[-3000:]
    expected, got = final_weights(tmp_path / "straight"), final_weights(run_dir)
    difference = max(float((expected[name].double() - got[name].double()).abs().max()) for name in expected)
    print(f"largest weight difference after the shrink: {difference:.2e}")
    assert "epoch 2 continues after its first 64 samples" in resumed.output
    assert (resumed.summary["config"]["batch_size"], resumed.summary["config"]["grad_accum"]) == (16, 2)
    steps = [r["step"] for r in resumed.metrics if r["kind"] == "epoch"]
    assert steps == [5, 10]
    # the same samples, crops and flips in every step: only the order of float sums differs (measured 1.5e-8;
    # restarting the epoch, as a resume at another global batch does: 1.4e-2; the crops and flips seeded by the
    # rank's position instead of the job's: 2.5e-4)
    assert difference < 1e-6, difference


def test_a_snapshot_taken_under_an_uneven_split_resumes_at_its_sample_on_an_even_world():
    """In-job recovery left 3 of 4 ranks sharing a global batch of 128 unevenly (micro-batches of at most 22, 2 a
    step): 4 micro-batches are 2 steps, 256 samples, not 4 x 22 x 3. The snapshot says so, and a relaunch on 4
    ranks of 32 (or 2 of 32 x 2) continues at sample 256."""
    taken = Snapshot(arch="digits_cnn", model={}, optimizer={}, scheduler={}, epoch=EPOCH - 1, step=0, rng=[],
                     world_size=3, batches_done=4, config={"batch_size": 22, "grad_accum": 2}, samples_done=256,
                     samples_per_step=128)
    assert taken.global_batch() == 128
    assert taken.position_on(4, 32, 1) == (2, "")
    assert taken.position_on(2, 32, 2) == (4, "")
    assert taken.position_on(3, 22, 2)[0] == 0  # 22 x 3 x 2 = 132 is another global batch: the epoch restarts
