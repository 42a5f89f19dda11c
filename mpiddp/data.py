"""Datasets and loaders. Every rank gets its shard through samplers told its rank explicitly."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from mpiddp.errors import UserError
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


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images N x 8 x 8 in 0..16, labels N) of the UCI handwritten digits that scikit-learn ships.

    Reads scikit-learn's data file directly: importing sklearn costs about 1.5 s per rank at start-up.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the digits dataset needs scikit-learn: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        table = np.loadtxt(path, delimiter=",", dtype=np.float32)
        return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # a future layout of the package: take the slow road

    digits = load_digits()
    return digits.images.astype(np.float32), digits.target.astype(np.int64)


def digits_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The UCI handwritten digits (1797 8x8 images), split 80/20 per class.

    The split depends only on `seed`, so every rank computes the same one without communicating.
    """
    raw_images, labels = load_digits_arrays()
    images = raw_images / 16.0
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
