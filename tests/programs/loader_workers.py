"""A torchrun-style script whose DataLoader has workers started the default way: trains two epochs with DDP and
writes OUT_DIR/rank<R>.json with what it saw; each worker writes the process id of its parent."""

import json
import multiprocessing
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VARIABLES = ("LOCAL_RANK", "MPIDDP_LOCAL_RANK", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
             "TORCHELASTIC_RESTART_COUNT")


class Ramp(Dataset):
    """Defined in the script: workers started by forkserver or spawn import it from the script."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        x = torch.full((4,), index / 64)
        return x, x.sum()


def note_parent(worker_id: int) -> None:
    with open(os.path.join(sys.argv[1], f"parent-{os.environ['RANK']}-{worker_id}-{os.getpid()}"), "w") as out:
        out.write(str(os.getppid()))


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    data = Ramp()
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler, num_workers=2, worker_init_fn=note_parent)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            (model(x).squeeze(1) - y).pow(2).mean().backward()
            optimizer.step()
            steps += 1
    record = {
        "pid": os.getpid(),
        "steps": steps,
        "start_method": multiprocessing.get_start_method(),
        "threads": torch.get_num_threads(),
        "env": {name: os.environ.get(name) for name in VARIABLES},
    }
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as out:
        json.dump(record, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
