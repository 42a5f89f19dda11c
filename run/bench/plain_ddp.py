"""The baseline: a minimal hand-written DDP loop on synthetic data, launched by torchrun (env:// rendezvous).

Writes {images_per_second, first_step_done_at} to argv[1] from rank 0. Same model, batch, optimizer and
throughput formula as mpiddp's synthetic mode, so the two can be compared.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel

out_path, batch, steps, warmup, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
dist.init_process_group("gloo")
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
torch.manual_seed(0)
model = DistributedDataParallel(torchvision.models.resnet18(num_classes=1000))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
inputs, labels = torch.rand(batch, 3, size, size), torch.randint(0, 1000, (batch,))
times, first_done = [], None
for _ in range(steps):
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(inputs), labels).backward()
    optimizer.step()
    times.append(time.perf_counter() - started)
    first_done = first_done or time.time()
slowest = torch.tensor([sum(times[warmup:])])
dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
if dist.get_rank() == 0:
    images = batch * dist.get_world_size() * (steps - warmup)
    with open(out_path, "w") as out:
        json.dump({"images_per_second": images / slowest.item(), "first_step_done_at": first_done}, out)
dist.destroy_process_group()
