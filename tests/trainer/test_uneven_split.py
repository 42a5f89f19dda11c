"""Any number of survivors keeps the global batch exactly: an uneven split (some ranks take one sample more, each
gradient weighted by its share) makes the update the full-size job makes on the same samples, in-process with the
trainer's own samplers and its own train_step, every rank simulated and DDP's average taken by hand."""

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler

from mpiddp.elastic.decide import Resplit, resplit
from mpiddp.globalbatch import share, uneven_split
from mpiddp.trainer.data import SkippingSampler, UnevenSampler, even_epoch_end, uneven_micro_batches
from mpiddp.trainer.train import train_step

SEED, EPOCH, FEATURES, CLASSES = 3, 2, 6, 4


class Recorded:
    """An optimizer that keeps the gradient it is asked to step with (one rank's, before DDP's average)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.gradients = model, []

    def step(self) -> None:
        self.gradients.append(torch.cat([p.grad.flatten() for p in self.model.parameters()]).double())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)


def data(num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(num_samples, FEATURES, generator=generator, dtype=torch.float64),
            torch.randint(0, CLASSES, (num_samples,), generator=generator))


def one_step(micro_batches: list[list[int]], inputs, labels, sample_weight) -> torch.Tensor:
    """One rank's gradient of one optimizer step, through the trainer's train_step."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES)).double()
    optimizer = Recorded(model)
    state = SimpleNamespace(model=model, ddp=SimpleNamespace(no_sync=nullcontext), gradient_hook=None, commit=None,
                            scaler=torch.amp.GradScaler("cpu", enabled=False), optimizer=optimizer,
                            scheduler=SimpleNamespace(step=lambda: None), step=0)
    batches = [(inputs[indices], labels[indices]) for indices in micro_batches]
    train_step(state, batches, torch.device("cpu"), sample_weight=sample_weight)
    return optimizer.gradients[0]


def full_job_gradient(num_samples, world, batch, accumulation, step, inputs, labels):
    """DDP's average over `world` ranks of step `step` of the even full-size job (the trainer's even sampler)."""
    gradients = []
    for rank in range(world):
        sampler = SkippingSampler(DistributedSampler(range(num_samples), num_replicas=world, rank=rank, shuffle=True,
                                                     seed=SEED))
        sampler.set_epoch(EPOCH)
        indices = [index for index, _ in sampler]
        first = step * accumulation * batch
        micro = [indices[first + k * batch:first + (k + 1) * batch] for k in range(accumulation)]
        gradients.append(one_step(micro, inputs, labels, None))
    return torch.stack(gradients).mean(0), gradients


def uneven_job_gradient(num_samples, world, split: Resplit, epoch_end, step, inputs, labels):
    gradients, taken = [], []
    for rank in range(world):
        sampler = UnevenSampler(num_samples, rank, world, split.global_batch, split.grad_accum, split.batch_size,
                                epoch_end, SEED)
        sampler.set_epoch(EPOCH)
        sampler.skip = split.batches_done + step * split.grad_accum
        micro = [[index for index, _ in batch] for batch in list(sampler)[:split.grad_accum]]
        taken.append(sum(len(batch) for batch in micro))
        gradients.append(one_step(micro, inputs, labels, world / split.global_batch))
    return torch.stack(gradients).mean(0), taken


@pytest.mark.parametrize("world, batch, accumulation, survivors, steps_done", [
    (16, 4, 1, 15, 3),  # 64 over 15: 5 ranks take 5, 10 take 4
    (8, 4, 2, 7, 2),  # 64 over 7, with accumulation
    (4, 8, 1, 3, 0),  # 32 over 3 from the epoch's start
    (4, 8, 1, 3, 5),  # ... and mid-epoch
    (4, 8, 2, 3, 1),  # 64 over 3 in micro-batches of at most 8: 3 of them
])
def test_the_uneven_split_makes_the_full_jobs_update_on_the_same_samples(world, batch, accumulation, survivors,
                                                                        steps_done):
    num_samples = 800
    inputs, labels = data(num_samples)
    global_batch = world * batch * accumulation
    split = resplit(batch, accumulation, world, survivors, steps_done * accumulation, epoch_samples=num_samples)
    assert isinstance(split, Resplit) and split.uneven and split.global_batch == global_batch
    end = even_epoch_end(num_samples, world, batch)
    expected, _ = full_job_gradient(num_samples, world, batch, accumulation, steps_done, inputs, labels)
    got, taken = uneven_job_gradient(num_samples, survivors, split, end, 0, inputs, labels)
    assert sum(taken) == global_batch and max(taken) - min(taken) == 1  # the same samples, one more on some ranks
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12), (got - expected).abs().max()


def test_the_unweighted_uneven_split_would_be_wrong():
    """The check above can fail: without the weights (each rank's mean, averaged) the update differs."""
    num_samples, inputs_labels = 800, data(800)
    split = resplit(8, 1, 4, 3, 0, epoch_samples=num_samples)
    expected, _ = full_job_gradient(num_samples, 4, 8, 1, 0, *inputs_labels)
    gradients = []
    for rank in range(3):
        sampler = UnevenSampler(num_samples, rank, 3, split.global_batch, split.grad_accum, split.batch_size,
                                even_epoch_end(num_samples, 4, 8), SEED)
        sampler.set_epoch(EPOCH)
        micro = [[index for index, _ in batch] for batch in list(sampler)[:split.grad_accum]]
        gradients.append(one_step(micro, *inputs_labels, None))
    assert not torch.allclose(torch.stack(gradients).mean(0), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("num_samples, world, batch, accumulation, survivors", [
    (1438, 4, 32, 1, 3), (1438, 16, 4, 2, 15), (97, 4, 4, 1, 3), (1000, 8, 8, 3, 7), (1438, 6, 16, 1, 5),
])
def test_an_uneven_epoch_trains_the_full_jobs_positions_once_each_with_the_same_seeds(num_samples, world, batch,
                                                                                     accumulation, survivors):
    """Every rank the same number of micro-batches (the loop's groups stay in step), each position of the full
    job's epoch exactly once, at the same augmentation seed as on the full job."""
    global_batch = world * batch * accumulation
    end = even_epoch_end(num_samples, world, batch)
    assert global_batch % survivors  # uneven: an even split takes DistributedSampler's shards
    cap, accumulation_after = uneven_split(global_batch, survivors, batch)
    counts, seen = set(), {}
    for rank in range(survivors):
        batches = uneven_micro_batches(rank, survivors, global_batch, accumulation_after, cap, end)
        counts.add(len(batches))
        assert all(0 < len(positions) <= cap for positions in batches)
        sampler = UnevenSampler(num_samples, rank, survivors, global_batch, accumulation_after, cap, end, SEED)
        sampler.set_epoch(EPOCH)
        for positions, keys in zip(batches, sampler):
            for position, key in zip(positions, keys):
                assert position not in seen
                seen[position] = key
    assert len(counts) == 1 and sorted(seen) == list(range(end))
    full = {}
    for rank in range(world):
        sampler = SkippingSampler(DistributedSampler(range(num_samples), num_replicas=world, rank=rank, shuffle=True,
                                                     seed=SEED))
        sampler.set_epoch(EPOCH)
        for i, key in enumerate(sampler):
            full[rank + i * world] = key
    assert all(seen[position] == full[position] for position in seen)


def test_shares_differ_by_one_and_sum_to_the_global_batch():
    for global_batch, world in ((512, 15), (256, 7), (128, 3), (64, 63)):
        shares = [share(global_batch, world, rank) for rank in range(world)]
        assert sum(shares) == global_batch and max(shares) - min(shares) <= 1
    assert uneven_split(512, 15, 32) == (18, 2)  # 35 or 34 a rank: 2 micro-batches of at most 18


def test_the_epochs_shorter_last_step_is_the_full_jobs_too():
    """4 ranks of 8 x 2 accumulation over 800 samples: 25 micro-batches a rank, so the epoch's last step is one
    micro-batch (32 samples, not 64). Shared unevenly over 3 ranks it weighs each sample by 3 / 32, the mean over
    that step's samples, as the full job's shorter group does (weighted by 3 / 64 it would be half the update)."""
    from mpiddp.trainer.data import Loaders

    num_samples, inputs_labels = 800, data(800)
    world, batch, accumulation, survivors = 4, 8, 2, 3
    end = even_epoch_end(num_samples, world, batch)
    split = resplit(batch, accumulation, world, survivors, 24, epoch_samples=end)  # after 12 whole steps
    assert isinstance(split, Resplit) and split.uneven
    expected = []
    for rank in range(world):
        sampler = SkippingSampler(DistributedSampler(range(num_samples), num_replicas=world, rank=rank, shuffle=True,
                                                     seed=SEED))
        sampler.set_epoch(EPOCH)
        indices = [index for index, _ in sampler]
        expected.append(one_step([indices[24 * batch:25 * batch]], *inputs_labels, None))
    gradients, taken = [], 0
    for rank in range(survivors):
        sampler = UnevenSampler(num_samples, rank, survivors, split.global_batch, split.grad_accum, split.batch_size,
                                end, SEED)
        sampler.set_epoch(EPOCH)
        sampler.skip = split.batches_done
        loaders = Loaders(None, None, sampler, num_samples, 0, CLASSES, split.batch_size, world_size=survivors,
                          epoch_end=end, global_batch=split.global_batch, grad_accum=split.grad_accum)
        micro = [[index for index, _ in keys] for keys in sampler]
        taken += sum(len(batch) for batch in micro)
        gradients.append(one_step(micro, *inputs_labels, loaders.sample_weight(split.batches_done)))
    assert taken == 32
    got, want = torch.stack(gradients).mean(0), torch.stack(expected).mean(0)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (got - want).abs().max()
