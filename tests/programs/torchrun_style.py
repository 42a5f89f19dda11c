"""A script written for torchrun that knows nothing of mpiddp: reads only torchrun's variables, calls
init_process_group with the default env:// rendezvous, trains a few steps, and writes OUT_DIR/rank<R>.json
with what it saw and its final weights."""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")

out_dir = sys.argv[1]
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = nn.Linear(8, 2)
ddp = DistributedDataParallel(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
generator = torch.Generator().manual_seed(rank)  # each rank its own data
for _ in range(5):
    optimizer.zero_grad()
    ddp(torch.randn(16, 8, generator=generator)).pow(2).mean().backward()
    optimizer.step()
record = {
    "env": {name: os.environ.get(name) for name in VARIABLES},
    "argv": sys.argv,
    "name": __name__,
    "path0": sys.path[0],
    "hostname": socket.gethostname(),
    "weights": [float(x) for x in torch.cat([p.detach().flatten() for p in model.parameters()])],
}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
    json.dump(record, out)
dist.destroy_process_group()
