"""run/examples/torchrun_digits.py made recoverable in the job: its loop untouched, 4 lines changed (the diff is in
docs/run-script.md). When a rank dies, the survivors skip that step alike and go on at the reduced size:

    mpirun --with-ft ulfm -np 3 python -m mpiddp run run/examples/recoverable_digits.py --epochs 5
    torchrun --nproc-per-node 2 run/examples/recoverable_digits.py --epochs 5     # runs too, without recovery
"""

import argparse
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from mpiddp import DistributedDataParallel, Optimizer  # was: from torch.nn.parallel import ...
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser(description="Classify 8x8 handwritten digits with DDP.")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--save", default=None, help="rank 0 writes the final state_dict here")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target)
    train, test = TensorDataset(images[:1500], labels[:1500]), TensorDataset(images[1500:], labels[1500:])
    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = Optimizer(torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9), ddp)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = loss_fn(ddp(inputs.to(device)), targets.to(device))
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            correct = (model(test.tensors[0].to(device)).argmax(1) == test.tensors[1].to(device)).sum()
        if dist.get_rank() == 0:  # the live rank: rank 0 may have failed
            print(f"epoch {epoch}: loss {loss.item():.4f}, test accuracy {correct.item() / len(test):.3f}", flush=True)
    if args.save and dist.get_rank() == 0:
        torch.save(model.state_dict(), args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
