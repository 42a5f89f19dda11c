"""Scripts keep the global batch on any number of ranks (mpiddp.share_global_batch, mpiddp.BatchShare): each rank's
micro-batches of a step, weighted by loss_scale, give the update the full-size job makes on the same samples, in
float64, every rank simulated and DDP's average taken by hand; the step's samples are each taken once."""

import pytest
import torch
from torch import nn

from mpiddp import BatchShare, share_global_batch, split_global_batch

FEATURES, CLASSES = 5, 3


def data(num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(num_samples, FEATURES, generator=generator, dtype=torch.float64),
            torch.randint(0, CLASSES, (num_samples,), generator=generator))


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(FEATURES, 7), nn.Tanh(), nn.Linear(7, CLASSES)).double()


def gradient(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def full_job_gradient(indices: list[int], inputs, labels) -> torch.Tensor:
    """The gradient of the mean loss over the step's samples: what the full-size even job's DDP average is."""
    net = model()
    nn.functional.cross_entropy(net(inputs[indices]), labels[indices]).backward()
    return gradient(net)


def shared_gradient(global_batch, world, max_per_rank, order, step, inputs, labels, weighted=True):
    """DDP's average over `world` ranks of each rank's accumulated, weighted micro-batch gradients."""
    per_rank, taken = [], []
    for rank in range(world):
        share = BatchShare.over(global_batch, world, rank, max_per_rank)
        assert len(share.micro_batches) == len(BatchShare.over(global_batch, world, 0, max_per_rank).micro_batches)
        assert max(share.micro_batches) <= max_per_rank and min(share.micro_batches) >= 1, share
        net = model()
        for indices in share.indices(order, step):
            taken += indices
            loss = nn.functional.cross_entropy(net(inputs[indices]), labels[indices])
            (loss * (share.loss_scale(len(indices)) if weighted else 1.0)).backward()
        per_rank.append(gradient(net))
    return torch.stack(per_rank).mean(0), taken


@pytest.mark.parametrize("global_batch, world, max_per_rank", [
    (256, 15, 16),  # 16 -> 15 ranks: 17 or 18 a rank, in 2 micro-batches
    (64, 7, 8),     # 8 -> 7: 9 or 10 a rank, in 2 micro-batches
    (64, 3, 16),    # 4 -> 3: 21 or 22 a rank, in 2 micro-batches
    (96, 5, 8),     # with more accumulation: 19 or 20 a rank, in 3 micro-batches
    (64, 2, 16),    # an even split: the same code, each micro-batch's weight 0.5
])
def test_any_number_of_ranks_makes_the_full_jobs_update_on_the_same_samples(global_batch, world, max_per_rank):
    num_samples = 3 * global_batch + 5
    inputs, labels = data(num_samples)
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(7)).tolist()
    share = BatchShare.over(global_batch, world, 0, max_per_rank)
    assert share.steps_in(num_samples) == 3  # the rest (5) is left out, on any number of ranks
    for step in (0, 2):  # an epoch's first step, and one mid-epoch
        expected = full_job_gradient(order[step * global_batch:(step + 1) * global_batch], inputs, labels)
        got, taken = shared_gradient(global_batch, world, max_per_rank, order, step, inputs, labels)
        assert sorted(taken) == sorted(order[step * global_batch:(step + 1) * global_batch])  # each once
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    if global_batch % world:  # the control: unweighted, an uneven split is not the full job's update
        unweighted, _ = shared_gradient(global_batch, world, max_per_rank, order, 2, inputs, labels, weighted=False)
        assert not torch.allclose(unweighted, expected, rtol=1e-6, atol=1e-8)


def test_in_the_job_the_share_is_this_ranks_of_the_ranks_there_are_now(solo_group):
    share = share_global_batch(64, 16)
    assert (share.rank, share.world_size, share.micro_batches) == (0, 1, (16, 16, 16, 16))
    assert share.positions == range(64) and share.loss_scale(16) == 0.25


def test_what_cannot_be_shared_is_said_in_one_line():
    with pytest.raises(ValueError, match="leaves a rank an empty micro-batch"):
        BatchShare.over(20, 7, 0, 1)  # 2 or 3 a rank, at most 1 a micro-batch: 3 micro-batches, 2 samples
    with pytest.raises(ValueError, match="smaller than the 7 ranks"):
        BatchShare.over(5, 7, 0, 4)
    with pytest.raises(ValueError, match="not one of the 3 whole steps"):
        BatchShare.over(64, 3, 0, 16).indices(list(range(200)), 3)
    with pytest.raises(ValueError, match="the rank one of the ranks"):
        BatchShare.over(64, 3, 3, 16)


def test_split_global_batch_points_to_the_uneven_share_where_no_even_split_exists(monkeypatch):
    from mpiddp.elastic import steps

    monkeypatch.setattr(steps, "_world_now", lambda: (0, 3))
    with pytest.raises(ValueError, match="does not split over 3 ranks .*mpiddp.share_global_batch shares it"):
        split_global_batch(64, 16)


@pytest.mark.parametrize("global_batch, world, max_per_rank, micro_batches", [
    (34, 2, 16, (9, 8)),  # 17 each: two micro-batches, not 17 of one sample (the largest divisor of 17 below 16)
    (64, 2, 16, (16, 16)),  # an even split that divides: as before
    (30, 2, 16, (15,)),  # fits in one
    (35, 2, 16, (9, 9)),  # rank 0 of an uneven split: 18 in two
])
def test_a_share_takes_as_few_micro_batches_as_the_most_per_rank_allows(global_batch, world, max_per_rank,
                                                                         micro_batches):
    share = BatchShare.over(global_batch, world, 0, max_per_rank)
    assert share.micro_batches == micro_batches
    assert sum(share.micro_batches) == len(share.positions)
