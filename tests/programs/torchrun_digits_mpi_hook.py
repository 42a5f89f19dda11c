"""run/examples/torchrun_digits.py with one change: MPI carries DDP's gradient all-reduce, through
`mpiddp.comm_hook()`. Run under `python -m mpiddp run`; each rank writes OUT_DIR/<compression>/rank<R>.json (accuracy, weights,
buckets the hook carried).

argv: OUT_DIR [--epochs N] [--compression KIND[,KIND...]] with KIND none|fp16|bf16|off (off: no hook, gloo carries
the gradients). Several kinds train one after the other in the same job, each a fresh model from the same seed
(one job's start-up for all: a test compares them).
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpiddp


def train(loader: DataLoader, sampler: DistributedSampler, test: TensorDataset, epochs: int,
          compression: str) -> dict:
    """One fresh model from seed 0, trained with `compression` (off: no hook)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp = DistributedDataParallel(model)
    buckets = []
    if compression != "off":
        state, hook = mpiddp.comm_hook(compression=compression)  # the one line that moves gradients to MPI
        ddp.register_comm_hook(state, hook)
        state.on_ready = lambda: buckets.append(1)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(inputs), targets).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = float((model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean())
    return {"accuracy": accuracy, "buckets": len(buckets),
            "weights": [float(x) for x in torch.cat([p.detach().flatten() for p in model.parameters()])]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--compression", default="none")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target)
    train_set, test = TensorDataset(images[:1500], labels[:1500]), TensorDataset(images[1500:], labels[1500:])
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    for compression in args.compression.split(","):
        record = train(loader, sampler, test, args.epochs, compression)
        os.makedirs(os.path.join(args.out_dir, compression), exist_ok=True)
        with open(os.path.join(args.out_dir, compression, f"rank{rank}.json"), "w") as out:
            json.dump(record, out)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
