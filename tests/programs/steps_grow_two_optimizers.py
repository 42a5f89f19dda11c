"""A GAN-shaped loop under mpiddp's step wrappers that grows back (tests/script/test_steps_grow_two_optimizers_e2e.py):
two wrapped models, each with its own mpiddp.Optimizer; the generator's optimizer is built first (the loop's clock)
but stepped second, after the discriminator's; the generator's learning rate comes from an LR scheduler kept with
mpiddp.keep (loaded in place on the new rank); rank 0 is the victim, so the new rank 0 is a survivor.

argv: OUT_DIR MAX_ITERS KILL_ITER AFTER_FULL. Each process appends to OUT_DIR/pid<PID>.jsonl one line per iteration
{iter, world, rank} and at the end {done, iter, world, checksum, last_epoch} (checksum: both models' parameters and
both optimizers' state tensors: equal on every rank where the new rank took every state)."""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

import mpiddp

out_dir, max_iters, kill_at, after_full = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo")
victim = dist.get_rank() == 0 and not os.path.exists(os.path.join(out_dir, "started"))  # a new rank is no victim
iter_num = 0
torch.manual_seed(1337)
generator = mpiddp.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
g_optimizer = mpiddp.Optimizer(torch.optim.AdamW(generator.parameters(), lr=1e-2), generator)
discriminator = mpiddp.DistributedDataParallel(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1)))
d_optimizer = mpiddp.Optimizer(torch.optim.SGD(discriminator.parameters(), lr=1e-2, momentum=0.9), discriminator)
scheduler = torch.optim.lr_scheduler.LambdaLR(g_optimizer, lambda step: 1.0 / (1 + step))
mpiddp.keep(globals(), "iter_num", "scheduler")
out = open(os.path.join(out_dir, f"pid{os.getpid()}.jsonl"), "a")
full_at = None

while True:
    noise = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * dist.get_rank() + iter_num))
    d_loss = discriminator(generator(noise).detach()).pow(2).mean()  # the discriminator's step first
    d_loss.backward()
    d_optimizer.step()
    d_optimizer.zero_grad(set_to_none=True)
    g_loss = -discriminator(generator(noise)).mean()
    if victim and iter_num == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    g_loss.backward()
    g_optimizer.step()  # the clock: a grow is taken in here
    scheduler.step()
    g_optimizer.zero_grad(set_to_none=True)
    d_optimizer.zero_grad(set_to_none=True)
    if iter_num == 0 and dist.get_rank() == 0:
        open(os.path.join(out_dir, "started"), "w").close()
    out.write(json.dumps({"iter": iter_num, "world": dist.get_world_size(), "rank": dist.get_rank()}) + "\n")
    out.flush()
    iter_num += 1
    full_at = None if dist.get_world_size() < 3 else full_at if full_at is not None else iter_num
    if iter_num >= max_iters and (full_at is not None and iter_num >= full_at + after_full or iter_num >= 20000):
        break

g_optimizer.settle()
d_optimizer.settle()
with torch.no_grad():
    tensors = [*generator.parameters(), *discriminator.parameters(),
               *(value for optimizer in (g_optimizer, d_optimizer) for state in optimizer.state.values()
                 for value in state.values() if torch.is_tensor(value) and value.dim() > 0)]
    checksum = float(sum(tensor.double().sum() for tensor in tensors))
out.write(json.dumps({"done": True, "iter": iter_num, "world": dist.get_world_size(), "checksum": checksum,
                      "last_epoch": scheduler.last_epoch}) + "\n")
out.close()
dist.destroy_process_group()
