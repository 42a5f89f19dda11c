"""A torchrun-style loop with mpiddp's wrappers whose rank 1 is SIGKILLed right after the loop, while the others'
scripts end without communicating: they wait for every rank in `mpiddp run`'s finish
(tests/script/test_steps_e2e.py)."""

import os
import signal

import torch
import torch.distributed as dist

from mpiddp import DistributedDataParallel, Optimizer

dist.init_process_group("gloo")
model = torch.nn.Linear(4, 1)
ddp = DistributedDataParallel(model)
optimizer = Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
for _ in range(3):
    optimizer.zero_grad()
    ddp(torch.randn(8, 4)).sum().backward()
    optimizer.step()
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
