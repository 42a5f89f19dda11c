"""nanoGPT's loop, as a user makes it recoverable with mpiddp's wrappers and grows it back: the loop keeps its position
in its own module-level variables (`iter_num`, and `best_val_loss`, which only rank 0 updates), sets the learning rate
from `iter_num` each iteration, accumulates gradients, and declares both variables with mpiddp.keep. For
tests/script/test_steps_grow_e2e.py, under `mpirun --with-ft ulfm ... -x MPIDDP_SPARE_RANKS=1`.

argv: OUT_DIR MAX_ITERS [--kill RANK:ITER] [--init] [--no-keep] [--commit late] [--until-full N]
      [--after-full K] [--prelude STEPS] [--prelude-broadcast] [--kill-in-late-start RANK]
--init: `mpiddp.init()` starts the job (a plain mpirun), else torch's init_process_group under `python -m mpiddp run`.
--until-full N: after MAX_ITERS the loop goes on until the job has N ranks again (every rank decides alike: a grow
changes the size at the same step everywhere), at most 20000 iterations, and then --after-full more (a benchmark
reads the grow's first step).
Every rank passes a barrier of its own before the loop (a new rank's returns at once). --prelude STEPS: a new rank's
start waits until rank 0 has trained STEPS more steps (OUT_DIR/progress) and raises if it does not within 120 s (the
survivors train while it starts). --prelude-broadcast: every rank broadcasts from rank 0 before the loop (a new rank
cannot: it leaves, and the job goes on without it). --kill-in-late-start RANK: the rank that started as RANK SIGKILLs
itself once a new rank is in its script's start (OUT_DIR/late-start), and that start goes on only after rank 0 has
trained 3 more steps since (the survivors recovered, giving that grow up); the loop does not end before that kill.
The victim SIGKILLs itself in that iteration after its forward. Each process appends to OUT_DIR/pid<PID>.jsonl one
line per iteration {iter, world, rank, steps, skipped, time} and at the end {done, iter, world, rank, checksum,
best_val_loss, mean_checksum, changes} (checksum: the parameters' and the optimizer's moments' sum: equal on every
rank; mean_checksum: its mean over the ranks, by an all_reduce the script took by name before its loop;
changes: each change of size this process went through, with mpiddp's phases in seconds).
"""

import argparse
import json
import math
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import mpiddp

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("max_iters", type=int)
parser.add_argument("--kill", default="")
parser.add_argument("--init", action="store_true")
parser.add_argument("--no-keep", action="store_true")
parser.add_argument("--commit", default="strict")
parser.add_argument("--until-full", type=int, default=0)
parser.add_argument("--after-full", type=int, default=0)
parser.add_argument("--prelude", type=int, default=0)
parser.add_argument("--prelude-broadcast", action="store_true")
parser.add_argument("--kill-in-late-start", type=int, default=-1)
args = parser.parse_args()

if args.init:
    mpiddp.init(device="cpu")
else:
    dist.init_process_group("gloo")
start_rank, started_world = dist.get_rank(), dist.get_world_size()
progress = os.path.join(args.out_dir, "progress")  # rank 0's iteration, with --prelude
started_late = os.path.exists(progress)  # read before the barrier: rank 0 writes it only in the loop
dist.barrier()
all_reduce = dist.all_reduce  # taken by name in the start (a new rank's is the stand-in's): used after the loop
if args.prelude_broadcast:
    dist.broadcast(torch.zeros(1), 0)
late_start, killing = os.path.join(args.out_dir, "late-start"), os.path.join(args.out_dir, "killing")


def wait_for(condition, what):
    deadline = time.monotonic() + 120
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within 120 s while this new rank ran the script's start")
        time.sleep(0.02)


def trained_on(steps):
    seen = int(open(progress).read())
    wait_for(lambda: int(open(progress).read()) >= seen + steps, f"the survivors' {steps} more steps")


if started_late and args.kill_in_late_start >= 0 and not os.path.exists(late_start):
    open(late_start, "w").close()
    wait_for(lambda: os.path.exists(killing), "the second victim's kill")
    trained_on(3)
if started_late and args.prelude:
    trained_on(args.prelude)
victim, kill_at = map(int, args.kill.split(":")) if args.kill else (-1, -1)
master_process = start_rank == 0
gradient_accumulation_steps, eval_interval, learning_rate, warmup_iters = 2, 7, 1e-2, 4
iter_num = 0
best_val_loss = 1e9

torch.manual_seed(1337)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.1)
model = mpiddp.DistributedDataParallel(model)
optimizer = mpiddp.Optimizer(optimizer, model, commit=args.commit)
if not args.no_keep:
    mpiddp.keep(globals(), "iter_num", "best_val_loss")
mpiddp.on_membership_change(lambda change: globals().update(master_process=change.rank == 0))
smallest_world = started_world  # the job's smallest size this rank has seen in the loop
changes = []  # what each change of size cost, as mpiddp measured it (its phases fill in at the next step)
mpiddp.on_membership_change(changes.append)
out = open(os.path.join(args.out_dir, f"pid{os.getpid()}.jsonl"), "a")
full_at = None  # the iteration since which the job has had --until-full ranks
val_data = torch.randn(64, 32, generator=torch.Generator().manual_seed(7))


def get_lr(it):  # nanoGPT's: warmup, then cosine
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    return learning_rate * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (it - warmup_iters) / 200)))


def get_batch():  # this rank's data of this iteration: the same on a new rank that took iter_num
    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + iter_num)
    return torch.randn(16, 32, generator=generator)


def note(**record):
    out.write(json.dumps(record) + "\n")
    out.flush()


@torch.no_grad()
def checksum():
    moments = [value.double().sum() for state in optimizer.state.values() for value in state.values()
               if torch.is_tensor(value) and value.dim() > 0]
    return float(sum(p.double().sum() for p in model.parameters()) + sum(moments))


while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0 and master_process:
        with torch.no_grad():
            val = model.module(val_data).pow(2).mean().item()
        best_val_loss = min(best_val_loss, val)
    X = get_batch()
    for micro_step in range(gradient_accumulation_steps):
        model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        loss = model(X).pow(2).mean() / gradient_accumulation_steps
        if start_rank == victim and iter_num == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if start_rank == args.kill_in_late_start and not started_late and os.path.exists(late_start):
            open(killing, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    note(iter=iter_num, world=dist.get_world_size(), rank=dist.get_rank(), steps=optimizer.steps,
         skipped=optimizer.skipped, time=time.monotonic())
    if (args.prelude or args.kill_in_late_start >= 0) and master_process:
        with open(progress + ".tmp", "w") as sink:
            sink.write(str(iter_num))
        os.replace(progress + ".tmp", progress)
    iter_num += 1
    if dist.get_world_size() < args.until_full:
        full_at = None
    elif full_at is None:
        full_at = iter_num
    smallest_world = min(smallest_world, dist.get_world_size())
    # the second kill is over once this rank has seen the job two ranks down (not once the victim wrote `killing`,
    # which a survivor can read after a step the victim took part in: it left the loop, the kill then failed the
    # collective after it); the spare, started late, is taken in after both kills
    second_kill_due = args.kill_in_late_start >= 0 and not started_late and smallest_world > started_world - 2
    if iter_num >= args.max_iters and (full_at is not None and iter_num >= full_at + args.after_full
                                       and not second_kill_due or iter_num >= 20000):
        break

optimizer.settle()
summed = torch.tensor([checksum()], dtype=torch.float64)
all_reduce(summed)
note(done=True, iter=iter_num, world=dist.get_world_size(), rank=dist.get_rank(), checksum=checksum(),
     mean_checksum=summed.item() / dist.get_world_size(),
     best_val_loss=best_val_loss, steps=optimizer.steps, skipped=optimizer.skipped,
     changes=[{"grew": change.grew, "phases": change.phases} for change in changes])
dist.destroy_process_group()
