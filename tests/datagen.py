"""Small datasets written in the real on-disk formats torchvision and mpiddp read (no downloads)."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np


def write_cifar10(root: Path, per_batch: int = 16, test: int = 20, seed: int = 0) -> Path:
    """DIR/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}, pickled dicts as in the original."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        count = test if name == "test_batch" else per_batch
        entry = {
            "batch_label": name,
            "labels": rng.integers(0, 10, count).tolist(),
            "data": rng.integers(0, 256, (count, 3072), dtype=np.uint8),
            "filenames": [f"img{i}.png" for i in range(count)],
        }
        with (folder / name).open("wb") as out:
            pickle.dump(entry, out, protocol=2)
    with (folder / "batches.meta").open("wb") as out:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, out, protocol=2)
    return root


def _idx(path: Path, array: np.ndarray) -> None:
    magic = 0x0800 + array.ndim  # unsigned byte data
    with path.open("wb") as out:
        out.write(struct.pack(">I", magic))
        out.write(struct.pack(f">{array.ndim}I", *array.shape))
        out.write(array.astype(np.uint8).tobytes())


def write_mnist(root: Path, train: int = 64, test: int = 20, seed: int = 0) -> Path:
    """DIR/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte in the IDX format."""
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, count in (("train", train), ("t10k", test)):
        _idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (count, 28, 28)))
        _idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, count))
    return root


def write_imagefolder(root: Path, classes: int = 3, train: int = 8, val: int = 4, size: int = 40) -> Path:
    """DIR/{train,val}/classN/*.png"""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root
