"""An autoencoder on 8x8 digits with an MSE loss, written against mpiddp's small public API.

    mpirun -np 2 python -m mpiddp run run/examples/autoencoder.py --epochs 20     # mpiddp's guarantees
    mpirun -np 2 python run/examples/autoencoder.py --epochs 20                  # plain mpirun works too

`mpiddp.init()` bootstraps once (topology, rendezvous, device, process group) and returns a typed Dist; metrics
are reduced over MPI with `dist.reduce`, and only rank 0 logs at INFO.
"""

import argparse
import logging
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpiddp

log = logging.getLogger("autoencoder")


class AutoEncoder(nn.Module):
    def __init__(self, code_size: int = 8) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, code_size))
        self.decoder = nn.Sequential(nn.Linear(code_size, 32), nn.ReLU(), nn.Linear(32, 64))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(images))


def main() -> None:
    parser = argparse.ArgumentParser(description="Train an autoencoder on the UCI digits with DDP.")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save", default=None, help="rank 0 writes the final state_dict here")
    args = parser.parse_args()

    dist = mpiddp.init()
    mpiddp.setup_logging(dist)
    images = torch.tensor(load_digits().data / 16.0, dtype=torch.float32)
    dataset = TensorDataset(images)
    sampler = DistributedSampler(dataset, num_replicas=dist.world_size, rank=dist.rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    model = AutoEncoder().to(dist.device)
    ddp = DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        loss_sum, count = 0.0, 0
        for (batch,) in loader:
            batch = batch.to(dist.device)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(batch), batch)
            loss.backward()
            optimizer.step()
            loss_sum, count = loss_sum + loss.item() * len(batch), count + len(batch)
        total, seen = dist.reduce([loss_sum, count], "sum")  # one small MPI all-reduce
        log.info("epoch %d/%d: reconstruction MSE %.5f over %d images", epoch, args.epochs, total / seen, seen)
    if args.save:
        # Collective: rank 0 writes, every rank learns whether it worked (a UserError would stop all of them).
        dist.from_main(lambda: torch.save(model.state_dict(), Path(args.save)))


if __name__ == "__main__":
    main()
