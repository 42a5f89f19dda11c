"""Datasets and loaders. Every rank gets its shard through samplers told its rank explicitly; workers never touch MPI."""

from __future__ import annotations

import importlib.util
import itertools
import logging
import multiprocessing
import multiprocessing.forkserver
import pickle
import random
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset, get_worker_info

from mpiddp.errors import UserError
from mpiddp.globalbatch import balanced
from mpiddp.job.collective import Dist
from mpiddp.job.helper_signals import (die_with_parent, ignore_stop_signals, mark_helper_parent, prepare_forkserver,
                                       stop_signals_blocked)
from mpiddp.trainer.config import ON_DISK_DATASETS, Config, DataSettings

log = logging.getLogger(__name__)

DIGITS_TEST_FRACTION = 0.2
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# What a loader worker imports to unpickle its dataset (this module's classes, torchvision's transforms): the
# forkserver imports them once for all the rank's workers (mpiddp.job.helper_signals.prepare_forkserver).
WORKER_MODULES = ("mpiddp.trainer.data", "torchvision")


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


MASK64 = 2**64 - 1


def _mix64(value: int) -> int:
    """splitmix64's finaliser: neighbouring inputs give unrelated 64-bit outputs (cheap: one per sample)."""
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """The seed of one training sample's augmentation: a function of where it sits in the epoch's order (the
    whole job's, not one rank's), nothing else: the same on any number of ranks, so a resume on fewer keeps it."""
    return _mix64(_epoch_seed(seed, epoch) ^ position)


def _epoch_seed(seed: int, epoch: int) -> int:
    return _mix64(_mix64(seed & MASK64) ^ epoch)


class SkippingSampler(Sampler[tuple[int, int]]):
    """DistributedSampler that can start an epoch part-way, where a stopped run left off.

    Yields (index, seed): the seed derives from (seed, epoch, position in the job's epoch: rank r's i-th sample
    sits at r + i x W of the permutation), so a sample's augmentation is the same whichever worker loads it, whether
    or not the run was stopped before it, and on however many ranks it resumed.
    """

    def __init__(self, base: DistributedSampler) -> None:
        self.base = base
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.base.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        base = self.base
        epoch_seed = _epoch_seed(base.seed, base.epoch)
        for position, index in itertools.islice(enumerate(base), self.skip, None):
            yield index, _mix64(epoch_seed ^ (base.rank + position * base.num_replicas))  # sample_seed(...)

    def __len__(self) -> int:
        return max(0, len(self.base) - self.skip)  # a skip past the shard: the epoch's end (in-job recovery)


def even_epoch_end(num_samples: int, world_size: int, batch_size: int) -> int:
    """The positions of the epoch's order an evenly split epoch trains: each rank's shard (padded to
    ceil(N / W) with repeats) in batches of `batch_size`, a trailing partial batch dropped where the shard holds a
    whole one (build_loaders' drop_last)."""
    per_rank = -(-num_samples // world_size)
    return world_size * (per_rank // batch_size * batch_size if per_rank >= batch_size else per_rank)


def uneven_micro_batches(rank: int, world_size: int, global_batch: int, accumulation: int, most: int,
                         epoch_end: int) -> list[range]:
    """This rank's micro-batches of an epoch under an uneven split (decide.Resplit.uneven), as positions of the
    epoch's order: each optimizer step takes the next `global_batch` positions (the epoch's last, up to
    `epoch_end`, may take fewer), rank r of W the step's positions r, r + W, ... (globalbatch.share), cut into
    `accumulation` micro-batches of balanced sizes, at most `most` each. Every rank gets the same number of
    micro-batches in each step: the loop's groups stay in step across ranks."""
    batches: list[range] = []
    for start in range(0, epoch_end, global_batch):
        length = min(global_batch, epoch_end - start)
        if length < world_size:  # a rank would train on nothing in this step: no rank trains it
            break
        largest_share = -(-length // world_size)
        parts = accumulation if length == global_batch else min(accumulation, -(-largest_share // most))
        parts = max(1, min(parts, length // world_size))  # no rank's micro-batch empty
        mine = range(start + rank, start + length, world_size)
        first = 0
        for size in balanced(len(mine), parts):
            batches.append(mine[first:first + size])
            first += size
    return batches


class UnevenSampler(Sampler[list[tuple[int, int]]]):
    """The batch sampler of an uneven split: this rank's micro-batches (uneven_micro_batches) of one permutation
    per epoch, the one DistributedSampler draws (its seed + epoch; positions past the samples repeat the start, as its
    padding does), keyed (index, seed) as SkippingSampler's: the same samples at the same positions, with the same
    augmentation seeds, on any number of ranks. `skip`: micro-batches of the epoch already trained."""

    def __init__(self, num_samples: int, rank: int, world_size: int, global_batch: int, accumulation: int, most: int,
                 epoch_end: int, seed: int) -> None:
        self.num_samples, self.seed, self.epoch, self.skip = num_samples, seed, 0, 0
        self.batches = uneven_micro_batches(rank, world_size, global_batch, accumulation, most, epoch_end)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.num_samples, generator=generator).tolist()
        epoch_seed = _epoch_seed(self.seed, self.epoch)
        for positions in self.batches[self.skip:]:
            yield [(order[position % self.num_samples], _mix64(epoch_seed ^ position)) for position in positions]

    def __len__(self) -> int:
        return max(0, len(self.batches) - self.skip)


def _seed_generators(seed: int) -> None:
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


@contextmanager
def _generators_kept() -> Iterator[None]:
    """Put torch's, Python's and numpy's global generators back afterwards: in the rank itself they also drive
    dropout and whatever the user draws, which a sample's augmentation must not move."""
    torch_state, python_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        np.random.set_state(numpy_state)


class PositionSeeded(Dataset):
    """Training samples keyed (index, seed) by SkippingSampler; with `reseed`, each sample's random augmentation
    draws from its own seed. Loader workers hold generator state that no snapshot saves, and which worker loads
    a batch shifts when a stopped epoch resumes; seeding per sample makes both irrelevant."""

    def __init__(self, dataset: Dataset, reseed: bool) -> None:
        self.dataset, self.reseed = dataset, reseed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        if not self.reseed:
            return self.dataset[index]
        if get_worker_info() is not None:  # a worker's generators serve nothing else
            _seed_generators(seed)
            return self.dataset[index]
        with _generators_kept():
            _seed_generators(seed)
            return self.dataset[index]


class HelperSafeLoader(DataLoader):
    """A DataLoader whose helper processes (the forkserver and the workers) ignore stop signals.

    mpirun forwards SIGUSR1 to each rank's process group and srun signals every process of the step; the
    default action would kill the helpers, and the next batch or worker start would fail instead of the rank
    saving a snapshot. Helpers start with the signals blocked (inherited through fork and exec, so no window
    before they set SIG_IGN); in the rank the block lasts only while they start, and a signal that arrives
    meanwhile stays pending, then is handled.
    """

    def __iter__(self) -> Any:
        with stop_signals_blocked():
            return super().__iter__()


def _worker_init(worker_id: int) -> None:
    ignore_stop_signals()
    die_with_parent()  # a killed rank (or its forkserver) takes its workers with it


class SyntheticBatches:
    """The same random batch, made once on the device, `steps` times (micro-batches) per epoch: measures compute,
    not I/O. `sizes`: each micro-batch's size under an uneven split (its first rows), else the whole batch."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor, steps: int, sizes: list[int] | None = None) -> None:
        self.inputs, self.labels, self.steps, self.sizes = inputs, labels, steps, sizes
        self.skip = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(self.skip, self.steps):
            if self.sizes is None:
                yield self.inputs, self.labels
            else:
                yield self.inputs[:self.sizes[index]], self.labels[:self.sizes[index]]

    def __len__(self) -> int:
        return max(0, self.steps - self.skip)


@dataclass
class Datasets:
    """What the loaders are built from; `train` is None for synthetic data."""

    train: Dataset | None
    eval: Dataset | None
    num_classes: int
    channels: int


@dataclass
class Loaders:
    train: Any  # DataLoader or SyntheticBatches
    eval: DataLoader | None
    train_sampler: SkippingSampler | UnevenSampler | None
    num_train: int
    num_eval: int
    num_classes: int
    batch_size: int
    world_size: int = 1
    epoch_end: int = 0  # the positions of the epoch's order an epoch trains (synthetic: micro-batches x b x W)
    global_batch: int = 0  # non-zero: an uneven split (decide.Resplit.uneven), each rank's share of a step differs
    grad_accum: int = 1

    @property
    def epoch_samples(self) -> int | None:
        """The samples of one epoch of the whole job; None for synthetic batches (counted per rank)."""
        return self.num_train if self.train_sampler is not None else None

    @property
    def samples_per_step(self) -> int:
        """The global batch: samples of the epoch's order one optimizer step trains (an epoch's last may train fewer)."""
        return self.global_batch or self.batch_size * self.world_size * self.grad_accum

    def sample_weight(self, batches_done: int) -> float | None:
        """Under an uneven split, what a micro-batch's mean loss is scaled by per sample in the step that starts
        after `batches_done` micro-batches (W / the step's samples: the global batch, fewer in the epoch's last
        step), so that DDP's average over the ranks is the gradient of the mean loss over the step's samples, as
        the even split's is; None when even (each of a step's equal micro-batches weighs 1 / their number)."""
        if not self.global_batch:
            return None
        start = self.position(batches_done)
        return self.world_size / min(self.global_batch, self.epoch_end - start)

    def position(self, batches_done: int) -> int:
        """The samples of the epoch's order the job has trained after `batches_done` micro-batches on each rank."""
        if not self.global_batch:
            return batches_done * self.batch_size * self.world_size
        total = len(self.train_sampler.batches) if isinstance(self.train_sampler, UnevenSampler) else self.train.steps
        if batches_done >= total:  # the epoch's last step may be shorter than a global batch
            return self.epoch_end
        return batches_done // self.grad_accum * self.global_batch

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Reshuffle: every rank draws the same permutation for `epoch` and takes its own shard of it,
        starting after `skip_batches` batches (those a stopped run already trained on)."""
        if isinstance(self.train_sampler, UnevenSampler):
            self.train_sampler.set_epoch(epoch)
            self.train_sampler.skip = skip_batches
        elif self.train_sampler is not None:
            self.train_sampler.set_epoch(epoch)
            self.train_sampler.skip = skip_batches * self.batch_size
        else:
            self.train.skip = skip_batches


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


def digits_split(seed: int = 0, channels: int = 1) -> tuple[TensorDataset, TensorDataset]:
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
    inputs = torch.from_numpy((images - mean) / std).unsqueeze(1).repeat(1, channels, 1, 1)
    targets = torch.from_numpy(labels)
    return TensorDataset(inputs[~test_mask], targets[~test_mask]), TensorDataset(inputs[test_mask], targets[test_mask])


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """CIFAR-10's batches are pickles; allow only what they contain (dicts, lists, bytes, numpy arrays)."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 carry bytes
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


class Cifar10(Dataset):
    """CIFAR-10 in torchvision's on-disk layout (DIR/cifar-10-batches-py/data_batch_1..5, test_batch)."""

    TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
    TEST_FILES = ("test_batch",)

    def __init__(self, root: str, train: bool, transform: Any) -> None:
        folder = Path(root) / "cifar-10-batches-py"
        images, labels = [], []
        for name in self.TRAIN_FILES if train else self.TEST_FILES:
            path = folder / name
            if not path.is_file():
                raise UserError(
                    f"{path} is missing: --dataset cifar10 expects torchvision's layout "
                    f"(DIR/cifar-10-batches-py/data_batch_1..5 and test_batch); add --download to fetch it"
                )
            try:
                with path.open("rb") as handle:
                    entry = _NumpyOnlyUnpickler(handle, encoding="latin1").load()
                data = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
                batch_labels = list(entry["labels"])
            except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as exc:
                raise UserError(f"{path} is not a CIFAR-10 batch file ({type(exc).__name__}: {exc})") from None
            if len(batch_labels) != len(data):
                raise UserError(f"{path} has {len(data)} images but {len(batch_labels)} labels")
            images.append(data)
            labels.extend(batch_labels)
        self.images = np.concatenate(images).transpose(0, 2, 3, 1)  # NHWC, as PIL wants
        self.labels = labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        from PIL import Image

        return self.transform(Image.fromarray(self.images[index])), self.labels[index]


def _transforms(data: DataSettings, channels: int) -> tuple[Any, Any]:
    from torchvision import transforms as T

    if data.dataset == "cifar10":
        size = data.image_size or 32
        resize = [T.Resize(size)] if size != 32 else []
        normalize = T.Normalize(CIFAR10_MEAN, CIFAR10_STD)
        train = T.Compose([*resize, T.RandomCrop(size, padding=size // 8), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
        return train, T.Compose([*resize, T.ToTensor(), normalize])
    if data.dataset == "mnist":
        size = data.image_size or 28
        steps = [T.Resize(size)] if size != 28 else []
        if channels == 3:
            steps.append(T.Grayscale(num_output_channels=3))
        pipeline = T.Compose([*steps, T.ToTensor(), T.Normalize((MNIST_MEAN,) * channels, (MNIST_STD,) * channels)])
        return pipeline, pipeline
    size = data.image_size or 224
    normalize = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    evaluation = T.Compose([T.Resize(round(size / 0.875)), T.CenterCrop(size), T.ToTensor(), normalize])
    return train, evaluation


def download_dataset(data: DataSettings) -> None:
    """torchvision's download of CIFAR-10 or MNIST into --data-dir (both splits)."""
    import torchvision

    dataset_class = torchvision.datasets.CIFAR10 if data.dataset == "cifar10" else torchvision.datasets.MNIST
    for train in (True, False):
        dataset_class(root=data.data_dir, train=train, download=True)


def _download_or_explain(download: Callable[[DataSettings], None], data: DataSettings) -> None:
    try:
        download(data)
    except Exception as exc:  # urllib, torchvision and the filesystem raise many kinds
        raise UserError(f"--download of {data.dataset} into {data.data_dir} failed ({type(exc).__name__}: {exc}); "
                        f"check the network, or put the files there yourself and drop --download") from None


def fetch(data: DataSettings, dist: Dist, download: Callable[[DataSettings], None] = download_dataset) -> None:
    """Collective: with --download, fetch the dataset once per filesystem: never two writers on one archive.

    Global rank 0 downloads and leaves a marker in --data-dir. A host whose local rank 0 then sees the marker
    shares that filesystem and reads rank 0's copy; a host that does not, downloads its own copy.
    """
    if not data.download:
        return
    data_dir = Path(data.data_dir or ".")
    marker = data_dir / f".mpiddp-download-{dist.from_main(lambda: secrets.token_hex(8))}"
    if dist.is_main:
        data_dir.mkdir(parents=True, exist_ok=True)
        _download_or_explain(download, data)
        marker.touch()
    dist.barrier()  # the others look for the marker only once rank 0 is done
    shared = marker.exists()
    if dist.topology.local_rank == 0 and not shared:
        data_dir.mkdir(parents=True, exist_ok=True)
        _download_or_explain(download, data)
    hosts_sharing = dist.allgather(shared if dist.topology.local_rank == 0 else None)
    if dist.is_main:
        marker.unlink(missing_ok=True)
        local = [name for (name, ranks) in dist.topology.hosts if not hosts_sharing[ranks[0]]]
        log.info("--download: fetched once for every host sharing %s%s", data_dir,
                 f"; separately on {', '.join(local)}" if local else "")


def load_datasets(cfg: Config, model_channels_for: Any) -> Datasets:
    """Open the configured dataset on this rank; a UserError names what is missing or malformed.

    `model_channels_for(data_channels)` says how many channels the model wants.
    """
    if cfg.data.dataset == "digits":
        channels = model_channels_for(1)
        train, test = digits_split(cfg.training.seed, channels)
        return Datasets(train, test, 10, channels)
    if cfg.data.dataset == "synthetic":
        return Datasets(None, None, cfg.data.num_classes, model_channels_for(3))
    data_dir = Path(cfg.data.data_dir or "")
    if not data_dir.is_dir():
        raise UserError(f"--data-dir {str(data_dir)!r} is not a directory")
    if cfg.data.dataset == "cifar10":
        channels = model_channels_for(3)
        train_tf, eval_tf = _transforms(cfg.data, channels)
        return Datasets(Cifar10(str(data_dir), True, train_tf), Cifar10(str(data_dir), False, eval_tf), 10, channels)
    if cfg.data.dataset == "mnist":
        import torchvision

        channels = model_channels_for(1)
        train_tf, eval_tf = _transforms(cfg.data, channels)
        try:
            train = torchvision.datasets.MNIST(str(data_dir), train=True, transform=train_tf)
            test = torchvision.datasets.MNIST(str(data_dir), train=False, transform=eval_tf)
        except RuntimeError as exc:
            raise UserError(
                f"no MNIST under {data_dir} ({exc}): expected torchvision's layout "
                f"DIR/MNIST/raw/train-images-idx3-ubyte etc.; add --download to fetch it"
            ) from None
        return Datasets(train, test, 10, channels)
    import torchvision

    channels = model_channels_for(3)
    train_tf, eval_tf = _transforms(cfg.data, channels)
    folders = {}
    for split in ("train", "val"):
        if not (data_dir / split).is_dir():
            raise UserError(f"--dataset imagefolder needs {data_dir / split}/ with one folder of images per class")
        try:
            folders[split] = torchvision.datasets.ImageFolder(str(data_dir / split), train_tf if split == "train" else eval_tf)
        except (FileNotFoundError, RuntimeError) as exc:
            raise UserError(f"{data_dir / split}: {exc}") from None
    if folders["train"].classes != folders["val"].classes:
        raise UserError(f"{data_dir}/train and {data_dir}/val have different class folders")
    return Datasets(folders["train"], folders["val"], len(folders["train"].classes), channels)


def stop_workers(loaders: Loaders) -> None:
    """End the persistent worker processes of `loaders` now. They ignore SIGTERM (HelperSafeLoader), so a rank that
    ends through Python's exit handlers with them alive would wait in multiprocessing's join forever; and a new
    split's loaders replace these."""
    for loader in (loaders.train, loaders.eval):
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def synthetic_loaders(cfg: Config, datasets: Datasets, dist: Dist, global_batch: int, epoch_end: int) -> Loaders:
    """build_loaders' for synthetic data: one random batch on the device, its first rows under an uneven split."""
    topo, device = dist.topology, dist.device
    batch_size, accumulation, world = cfg.training.batch_size, cfg.training.grad_accum, topo.world_size
    split = {"world_size": world, "global_batch": global_batch, "grad_accum": accumulation}
    size = cfg.data.image_size or 32
    generator = torch.Generator(device=device).manual_seed(cfg.training.seed + topo.rank)
    inputs = torch.rand((batch_size, datasets.channels, size, size), generator=generator, device=device)
    if cfg.training.channels_last:  # laid out once, so the step's conversion is a no-op
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, datasets.num_classes, (batch_size,), generator=generator, device=device)
    if global_batch:
        sizes = [len(batch) for batch in uneven_micro_batches(topo.rank, world, global_batch, accumulation,
                                                               batch_size, epoch_end)]
        return Loaders(SyntheticBatches(inputs, labels, len(sizes), sizes), None, None, sum(sizes), 0,
                       datasets.num_classes, batch_size, epoch_end=epoch_end, **split)
    # --steps-per-epoch counts optimizer steps: a split with more accumulation (--min-np, in-job recovery)
    # takes as many steps an epoch, each of more micro-batches
    micro_batches = cfg.data.steps_per_epoch * accumulation
    return Loaders(SyntheticBatches(inputs, labels, micro_batches), None, None, micro_batches * batch_size, 0,
                   datasets.num_classes, batch_size, epoch_end=micro_batches * batch_size * world, **split)


def build_loaders(cfg: Config, datasets: Datasets, dist: Dist, *, global_batch: int = 0, epoch_end: int = 0) -> Loaders:
    """This rank's loaders: its shard of the training set (reshuffled per epoch) and of the eval set.
    `global_batch` non-zero: an uneven split of it (decide.Resplit.uneven; cfg's batch size is the most a rank takes
    in one micro-batch, its accumulation the micro-batches of a step), over an epoch of `epoch_end` positions (the
    full-size job's, so that an epoch keeps its steps on any number of ranks)."""
    topo, device = dist.topology, dist.device
    batch_size, accumulation, world = cfg.training.batch_size, cfg.training.grad_accum, topo.world_size
    if datasets.train is None:
        return synthetic_loaders(cfg, datasets, dist, global_batch, epoch_end)
    assert datasets.eval is not None
    on_disk = cfg.data.dataset in ON_DISK_DATASETS
    workers = cfg.data.num_workers if on_disk else 0  # in-memory tensors: workers would only add start-up time
    loader_options: dict[str, Any] = {
        "num_workers": workers, "pin_memory": device.type == "cuda",
        # iter() draws the workers' base seed from this generator, not from the global one that drives dropout.
        "generator": torch.Generator().manual_seed(cfg.training.seed + topo.rank),
    }
    if workers > 0:
        mark_helper_parent()
        if cfg.data.worker_start_method == "forkserver":
            prepare_forkserver(also=WORKER_MODULES)
        loader_options.update(
            persistent_workers=True,
            prefetch_factor=4,
            # Workers must never inherit an initialised MPI: fork is unsafe with InfiniBand and friends.
            multiprocessing_context=cfg.data.worker_start_method,
            worker_init_fn=_worker_init,
        )
    # On-disk datasets augment at random: each sample from its own seed (in-memory ones do not augment).
    samples = PositionSeeded(datasets.train, reseed=on_disk)
    train_sampler: SkippingSampler | UnevenSampler
    if global_batch:
        train_sampler = UnevenSampler(len(datasets.train), topo.rank, world, global_batch, accumulation,  # type: ignore[arg-type]
                                      batch_size, epoch_end, cfg.training.seed)
        train = HelperSafeLoader(samples, batch_sampler=train_sampler, **loader_options)
    else:
        train_sampler = SkippingSampler(DistributedSampler(
            datasets.train, num_replicas=world, rank=topo.rank, shuffle=True, seed=cfg.training.seed  # type: ignore[arg-type]
        ))
        # A trailing batch of one would break BatchNorm; drop it when the shard holds at least one full batch.
        train = HelperSafeLoader(samples, batch_size=batch_size, sampler=train_sampler,
                                 drop_last=len(train_sampler) >= batch_size, **loader_options)
        epoch_end = even_epoch_end(len(datasets.train), world, batch_size)  # type: ignore[arg-type]
    evaluation = HelperSafeLoader(
        datasets.eval, batch_size=cfg.training.eval_batch_size,
        sampler=EvalShardSampler(len(datasets.eval), topo.rank, topo.world_size), **loader_options,  # type: ignore[arg-type]
    )
    return Loaders(
        train, evaluation, train_sampler, len(datasets.train), len(datasets.eval), datasets.num_classes, batch_size,  # type: ignore[arg-type]
        epoch_end=epoch_end, world_size=world, global_batch=global_batch, grad_accum=accumulation,
    )
