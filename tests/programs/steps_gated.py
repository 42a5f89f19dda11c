"""A torchrun-style loop under mpiddp's step wrappers that holds at a gate, for tests/script/test_step_spares_e2e.py:
what the test checks while the job still trains (a hot spare released at start-up has ended) is checked before any
rank can finish.

argv: OUT_DIR ITERATIONS GATE [--kill RANK:ITERATION] [--init]
--init: `mpiddp.init()` starts the job (a plain `mpirun python steps_gated.py`), else torch's init_process_group
under `python -m mpiddp run`.
Before iteration GATE every rank waits until OUT_DIR/go exists (the test makes it). The victim SIGKILLs itself in
that iteration, after its forward: its peers wait for it in the gradient all-reduce. Each rank appends to
OUT_DIR/rank<R>.jsonl (R: its rank at start) one line per iteration, {iteration, world, pid, steps, skipped}, and
at the end {done, steps, skipped}.
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import mpiddp

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("iterations", type=int)
parser.add_argument("gate", type=int)
parser.add_argument("--kill", default="")
parser.add_argument("--init", action="store_true")
args = parser.parse_args()

if args.init:
    mpiddp.init(device="cpu")
else:
    dist.init_process_group("gloo")
start_rank = dist.get_rank()
victim, at = map(int, args.kill.split(":")) if args.kill else (-1, -1)
torch.manual_seed(0)
ddp = mpiddp.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
optimizer = mpiddp.Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), ddp)
generator = torch.Generator().manual_seed(start_rank)
out = open(os.path.join(args.out_dir, f"rank{start_rank}.jsonl"), "a")


def note(**record):
    out.write(json.dumps(record) + "\n")
    out.flush()


def wait_for_the_gate():
    deadline = time.monotonic() + 180
    while not os.path.exists(os.path.join(args.out_dir, "go")):  # a condition the test sets, with a deadline
        if time.monotonic() > deadline:
            raise SystemExit("the test never opened the gate")
        time.sleep(0.05)


for iteration in range(args.iterations):
    if iteration == args.gate:
        wait_for_the_gate()
    optimizer.zero_grad()
    loss = ddp(torch.randn(64, 32, generator=generator)).pow(2).mean()
    if start_rank == victim and iteration == at:
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    optimizer.step()
    note(iteration=iteration, world=dist.get_world_size(), pid=os.getpid(), steps=optimizer.steps,
         skipped=optimizer.skipped)

note(done=True, steps=optimizer.steps, skipped=optimizer.skipped)
dist.destroy_process_group()
