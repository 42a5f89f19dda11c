"""A torchrun-style loop made recoverable with mpiddp's wrappers (the loop itself untouched), for the step-level
in-job recovery tests, under `mpirun --with-ft ulfm ... python -m mpiddp run`.

argv: OUT_DIR ITERATIONS [--accumulate K] [--kill RANK:ITERATION[:MICRO]] [--width N] [--plain] [--device cuda]
      [--batchnorm] [--kill-before-forward] [--commit late] [--kill-after-step RANK:ITERATION]
      [--hang RANK:ITERATION:stop|block] [--busy ITERATION:SECONDS] [--early RANK:ITERATION]
The victim SIGKILLs itself in that iteration (and micro-batch), after its forward: its peers then wait for it in
the gradient all-reduce (or, during accumulation, in the next one); with --kill-before-forward before it, so that
with --batchnorm (a model with BatchNorm buffers, which DDP broadcasts from rank 0 before each forward) and rank 0
the victim, they wait for it in that broadcast. Each rank appends to OUT_DIR/rank<R>.jsonl
(R: its rank at start) one line per iteration, {iteration, rank, world, pid, steps, skipped, time, start} (start:
the parameters' and momentum's sum at the iteration's start), the victim
{killed: time} just before its end, and at the end
{done, iterations, steps, skipped, checksum, buffers} (checksum: the parameters' and momentum's sum, to compare
ranks; buffers: the sum of this rank's buffers).
--kill-after-step: the victim ends itself once that iteration's optimizer step is taken (late commit: before the
agreement on it), and each line's `start` is set. --plain: torch's DDP and the optimizer itself (what the wrappers
cost, run/bench/steps.py); --width: the model's.
--hang: the victim hangs in that iteration after its forward, its peers waiting for it in the gradient all-reduce:
`stop` SIGSTOPs the whole process (it notes {hung: time} first), `block` blocks its main thread (its other threads,
the hang watchdog's, run on). --busy: every rank computes on its own for that many seconds after that iteration's
step (no collective: nobody waits on anybody). --early: that rank's loop ends after that iteration (its script then
ends as usual) while the others' go on into the next one and wait for it.
"""

import argparse
import json
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

import mpiddp

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("iterations", type=int)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--kill", default="")
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--plain", action="store_true")
parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
parser.add_argument("--batchnorm", action="store_true")
parser.add_argument("--kill-before-forward", action="store_true")
parser.add_argument("--kill-after-step", default="")
parser.add_argument("--commit", default="strict")
parser.add_argument("--hang", default="")
parser.add_argument("--busy", default="")
parser.add_argument("--early", default="")
parser.add_argument("--second-model", choices=["own-optimizer", "shared-optimizer"],
                    help="a second wrapped model (a GAN's two, or one optimizer over both)")
args = parser.parse_args()

if args.device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
start_rank = dist.get_rank()
victim, at, micro_at = (list(map(int, args.kill.split(":"))) + [0])[:3] if args.kill else (-1, -1, 0)
torch.manual_seed(0)
norm = [nn.BatchNorm1d(args.width)] if args.batchnorm else []
model = nn.Sequential(nn.Linear(32, args.width), *norm, nn.ReLU(), nn.Linear(args.width, 4)).to(args.device)
if args.plain:
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    optimizer.steps = optimizer.skipped = 0
else:
    ddp = mpiddp.DistributedDataParallel(model)
    optimizer = mpiddp.Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), ddp, commit=args.commit)
after_victim, after_at = map(int, args.kill_after_step.split(":")) if args.kill_after_step else (-1, -1)
hung_rank, hung_at, hang_kind = (int(args.hang.split(":")[0]), int(args.hang.split(":")[1]),
                                 args.hang.split(":")[2]) if args.hang else (-1, -1, "")
busy_at, busy_s = (int(args.busy.split(":")[0]), float(args.busy.split(":")[1])) if args.busy else (-1, 0.0)
early_rank, early_at = map(int, args.early.split(":")) if args.early else (-1, -1)
second = second_ddp = second_optimizer = None
if args.second_model:
    second = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)).to(args.device)
    second_ddp = mpiddp.DistributedDataParallel(second)
    if args.second_model == "shared-optimizer":
        optimizer = mpiddp.Optimizer(torch.optim.SGD([*model.parameters(), *second.parameters()], lr=0.05,
                                                     momentum=0.9), ddp, commit=args.commit)
    else:
        second_optimizer = mpiddp.Optimizer(torch.optim.SGD(second_ddp.parameters(), lr=0.05), second_ddp,
                                            commit=args.commit)
generator = torch.Generator().manual_seed(start_rank)
out = open(os.path.join(args.out_dir, f"rank{start_rank}.jsonl"), "a")


def digest():
    momentum = sum(float(state["momentum_buffer"].double().sum()) for state in optimizer.state.values())
    return sum(float(p.detach().double().sum()) for p in model.parameters()) + momentum


def note(**record):
    out.write(json.dumps(record) + "\n")
    out.flush()


for iteration in range(args.iterations):
    start = digest() if args.kill_after_step else None  # a sync with the device: only where a test reads it
    optimizer.zero_grad()
    for micro in range(args.accumulate):
        inputs = torch.randn(64, 32, generator=generator).to(args.device)
        last = micro == args.accumulate - 1
        killed_here = start_rank == victim and iteration == at and micro == micro_at
        if killed_here and args.kill_before_forward:
            note(killed=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        if last:
            loss = ddp(inputs).pow(2).mean()
        else:
            with ddp.no_sync():
                loss = ddp(inputs).pow(2).mean()
        if second_ddp is not None:
            loss = loss + second_ddp(inputs).pow(2).mean()
        if killed_here:
            note(killed=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        if last and start_rank == hung_rank and iteration == hung_at:
            note(hung=time.time())
            if hang_kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            threading.Event().wait()  # block: the main thread never goes on (the process's other threads do)
        if last:
            loss.backward()
        else:
            with ddp.no_sync():
                loss.backward()
    optimizer.step()
    if second_optimizer is not None:
        second_optimizer.step()
    if args.plain:
        optimizer.steps += 1
    note(iteration=iteration, rank=dist.get_rank(), world=dist.get_world_size(), pid=os.getpid(),
         steps=optimizer.steps, skipped=optimizer.skipped, time=time.time(), start=start)
    if iteration == busy_at:  # every rank busy on its own: a script's own phase, which no hang watch may mistake
        until = time.monotonic() + busy_s
        while time.monotonic() < until:
            torch.randn(64, 64).sum()
    if start_rank == early_rank and iteration == early_at:
        break
    if start_rank == after_victim and iteration == after_at:
        note(killed=time.time())
        os.kill(os.getpid(), signal.SIGKILL)

for held in (optimizer, second_optimizer):
    if hasattr(held, "settle"):
        held.settle()
momentum = sum(float(state["momentum_buffer"].sum()) for state in optimizer.state.values())
checksum = sum(float(p.detach().double().sum()) for p in model.parameters()) + momentum
buffers = sum(float(b.detach().double().sum()) for b in model.buffers())  # a rank's own: its last forward's data
if second is not None:
    checksum += sum(float(p.detach().double().sum()) * 3 for p in second.parameters())
note(done=True, iterations=args.iterations, steps=optimizer.steps, skipped=optimizer.skipped, checksum=checksum,
     buffers=buffers)
dist.destroy_process_group()
