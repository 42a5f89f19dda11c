"""A torchrun-style script under `python -m mpiddp run`: gloo all-reduces over a DataLoader with a worker; rank 1
SIGKILLs itself at batch 3 (as the OOM killer does), while its loader helpers are running."""

import os
import signal
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset


def main():
    dist.init_process_group("gloo")
    loader = DataLoader(TensorDataset(torch.arange(1000.0)), batch_size=4, num_workers=1)
    for index, (batch,) in enumerate(loader):
        dist.all_reduce(torch.ones(1))
        if index == 3 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)  # a step's work
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
