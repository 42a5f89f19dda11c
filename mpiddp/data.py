"""Datasets and loaders. Every rank gets its shard through samplers told its rank explicitly."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from mpiddp.topology import Topology

DIGITS_TEST_FRACTION = 0.2


class EvalShardSampler(Sampler[int]):
    """Rank r takes samples r, r+W, r+2W, ...: every sample is evaluated exactly once across the job.

    DistributedSampler pads the last round with repeats so all ranks step equally; that is right for
    training but would count some test samples twice.
    """

    def __init__(self, num_samples: int, rank: int, world_size: int) -> None:
        assert 0 <= rank < world_size
        self.indices = range(rank, num_samples, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


@dataclass
class Loaders:
    train: DataLoader
    eval: DataLoader
    train_sampler: DistributedSampler
    num_train: int
    num_eval: int
    num_classes: int
    input_shape: tuple[int, ...]


def digits_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The UCI handwritten digits shipped with scikit-learn (1797 8x8 images), split 80/20 per class.

    The split depends only on `seed`, so every rank computes the same one without communicating.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0  # pixel values are 0..16
    labels = digits.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test_mask = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        chosen = rng.choice(members, size=round(len(members) * DIGITS_TEST_FRACTION), replace=False)
        test_mask[chosen] = True
    # Normalise with training statistics only.
    mean, std = images[~test_mask].mean(), images[~test_mask].std()
    tensors = torch.from_numpy((images - mean) / std).unsqueeze(1), torch.from_numpy(labels)
    train = TensorDataset(tensors[0][~test_mask], tensors[1][~test_mask])
    test = TensorDataset(tensors[0][test_mask], tensors[1][test_mask])
    return train, test


def build_loaders(
    train_set: Dataset, eval_set: Dataset, topo: Topology, batch_size: int, eval_batch_size: int, seed: int
) -> Loaders:
    train_sampler = DistributedSampler(
        train_set, num_replicas=topo.world_size, rank=topo.rank, shuffle=True, seed=seed
    )
    eval_sampler = EvalShardSampler(len(eval_set), topo.rank, topo.world_size)  # type: ignore[arg-type]
    # In-memory tensors: worker processes would only add start-up time (and fork after MPI_Init).
    train = DataLoader(train_set, batch_size=batch_size, sampler=train_sampler, num_workers=0)
    evaluation = DataLoader(eval_set, batch_size=eval_batch_size, sampler=eval_sampler, num_workers=0)
    sample, _ = train_set[0]
    labels = eval_set.tensors[1] if isinstance(eval_set, TensorDataset) else None
    num_classes = int(labels.max()) + 1 if labels is not None else 0
    return Loaders(
        train, evaluation, train_sampler, len(train_set), len(eval_set), num_classes, tuple(sample.shape)  # type: ignore[arg-type]
    )


def digits_loaders(topo: Topology, batch_size: int, eval_batch_size: int, seed: int) -> Loaders:
    train_set, test_set = digits_split(seed)
    return build_loaders(train_set, test_set, topo, batch_size, eval_batch_size, seed)
