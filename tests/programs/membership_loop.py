"""Run under `mpirun --with-ft ulfm`: N ranks sum a tensor with gloo all-reduces in a loop through Membership.

usage: membership_loop.py OUT_DIR STEPS VICTIM AT_STEP [--no-async] [--numel=N] [--poll-s=S]
Each rank writes OUT_DIR/rank<R>.jsonl (R: its rank at start): one line per completed step (pid, world size,
the sum it got, the sum it expected) and one per recovery. The VICTIM rank, at step AT_STEP, writes
OUT_DIR/victim (its pid) and then waits, without joining the all-reduce, for the test to SIGKILL it; its
peers write OUT_DIR/waiting.<R> once they wait in that all-reduce. VICTIM -1: nobody stops (the no-failure
benchmark). With --no-async the loop uses plain blocking all-reduces (the benchmark's baseline; no recovery).
--numel: the tensor's length (1024 floats by default); --poll-s: Membership's longest sleep between polls.
--backend=nccl: NCCL on GPU `rank % GPUs` (one GPU per rank: NCCL refuses two ranks of one communicator on one
device), so a recovery aborts the old NCCL communicator. --rebuild-at=K: at step K, before its all-reduce, rebuild
the process group without a failure (NCCL: abort and connect again; the only rebuild one GPU can show).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist

from mpiddp.elastic.membership import MembersLost, Membership, RecoveryFailed, check_ulfm
from mpiddp.job.mpistart import init_mpi

out_dir, steps, victim, at_step = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
blocking = "--no-async" in sys.argv[5:]
numel = next((int(arg.split("=")[1]) for arg in sys.argv[5:] if arg.startswith("--numel=")), 1024)
poll_s = next((float(arg.split("=")[1]) for arg in sys.argv[5:] if arg.startswith("--poll-s=")), None)
backend = next((arg.split("=")[1] for arg in sys.argv[5:] if arg.startswith("--backend=")), "gloo")
rebuild_at = next((int(arg.split("=")[1]) for arg in sys.argv[5:] if arg.startswith("--rebuild-at=")), -1)
world, _ = init_mpi()
start_rank = world.Get_rank()
reason = check_ulfm()
if reason is not None:
    if start_rank == 0:
        print(f"refused: {reason}", flush=True)
    sys.exit(0)
device = torch.device("cpu")
if backend == "nccl":
    from mpiddp.trainer.elastic_policy import prepare_nccl

    prepare_nccl("none")  # what the trainer does: torch's NCCL watchdog must not end a survivor
    device = torch.device("cuda", start_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
members = Membership(world, collective_timeout_s=120, backend=backend, device=device if backend == "nccl" else None,
                     **({"poll_s": poll_s} if poll_s is not None else {}))
members.start_process_group()
alive = list(range(world.Get_size()))  # start ranks of the members, in rank order
record = open(out_dir / f"rank{start_rank}.jsonl", "a", buffering=1)
started = time.time()
step = 0
while step < steps:
    if start_rank == victim and step == at_step:
        (out_dir / "victim.tmp").write_text(str(os.getpid()))
        (out_dir / "victim.tmp").rename(out_dir / "victim")
        while True:  # until the test's SIGKILL; the peers wait in the all-reduce meanwhile
            time.sleep(0.01)
    if step == rebuild_at:
        rebuild_at = -1
        members.start_process_group()  # the path a recovery takes (NCCL: the old communicator aborted first)
        record.write(json.dumps({"rebuilt": True, "step": step, "backend": tdist.get_backend()}) + "\n")
    value = torch.full((numel,), float(start_rank + 1), device=device)
    try:
        if blocking:
            tdist.all_reduce(value)
        else:
            work = tdist.all_reduce(value, async_op=True)
            if step == at_step and len(alive) == world.Get_size():  # the test kills once every peer waits here
                (out_dir / f"waiting.{start_rank}").touch()
            members.wait(work)
    except MembersLost:
        try:
            recovered = members.recover(min_size=min(2, world.Get_size() - 1))  # 2 of 3; 1 of 2 (two GPUs)
        except RecoveryFailed as exc:
            print(f"rank {start_rank}: {exc}", flush=True)
            sys.exit(5)
        failed = [alive[old] for old in recovered.failed_ranks]
        alive = [alive[old] for old in recovered.old_ranks_alive]
        record.write(json.dumps({"recovered": True, "failed": failed,
                                 "world": recovered.world_size, "rank": recovered.rank, "phases": recovered.phases,
                                 "detected_at": recovered.detected_at, "step": step}) + "\n")
        continue  # redo the interrupted step on the survivors
    expected = float(sum(rank + 1 for rank in alive))
    record.write(json.dumps({"step": step, "pid": os.getpid(), "world": tdist.get_world_size(),
                             "backend": tdist.get_backend(),
                             "sum": value[0].item(), "expected": expected, "exact": bool((value == expected).all()),
                             "at": time.time()}) + "\n")
    step += 1
record.write(json.dumps({"done": True, "seconds": time.time() - started}) + "\n")
members.comm.Barrier()  # every survivor has finished before any tears down
tdist.destroy_process_group()
members.close()
