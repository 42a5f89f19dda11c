"""Run under `mpirun --with-ft ulfm -np 3`: the window where DDP lays its buckets out again after its first step.

usage: rebuild_window.py OUT_DIR
Every rank takes DDP's first step (a watched all-reduce through mpiddp's gradient hook). Then rank 2 dies
(SIGKILL). Rank 0, the root of DDP's broadcast of the new bucket layout, notices it first and goes straight into
the recovery without that broadcast; rank 1 starts the re-layout (mpiddp's watched BucketRebuild), as the trainer
does at the end of its first step. Without the watch rank 1 waits there for rank 0, alive and silent, until the
process group's timeout (120 s here); with it, rank 1 learns of the failure and joins the recovery. The two
survivors then wrap the model again over their new process group and train two steps. Each writes
OUT_DIR/rank<R>.json: what it went through.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from mpiddp.elastic.membership import MembersLost, Membership, check_ulfm
from mpiddp.job import compression
from mpiddp.job.mpistart import init_mpi

out_dir = Path(sys.argv[1])
world, _ = init_mpi()
rank = world.Get_rank()
if check_ulfm() is not None:
    print(f"refused: {check_ulfm()}", flush=True)
    sys.exit(0)
members = Membership(world, collective_timeout_s=120)
members.start_process_group()


class UsedInReverse(torch.nn.Module):  # layers registered in the opposite order of use: DDP lays them out again
    def __init__(self):
        super().__init__()
        self.head, self.body, self.stem = torch.nn.Linear(32, 4), torch.nn.Linear(64, 32), torch.nn.Linear(16, 64)

    def forward(self, x):
        return self.head(torch.relu(self.body(torch.relu(self.stem(x)))))


def wrapped(model):
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=0.001)
    return ddp, compression.register(ddp, "none", backend="gloo", members=members)


torch.manual_seed(0)
model = UsedInReverse()
ddp, hook = wrapped(model)
ddp(torch.randn(8, 16)).sum().backward()  # DDP's first step
members.comm.Barrier()
seen = {"rank": rank, "pid": os.getpid()}
if rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
started = time.monotonic()
if rank == 0:
    while members.failed() is None:  # the root notices first and never starts the broadcast
        time.sleep(0.001)
    seen["path"] = "noticed the failure, no rebuild"
else:
    try:
        hook.rebuild_buckets()
        seen["path"] = "the rebuild completed"
    except MembersLost:
        seen["path"] = "the rebuild gave way to the failure"
seen["seconds_to_recovery"] = time.monotonic() - started
recovered = members.recover(min_size=2)
seen["world_after"] = recovered.world_size
del ddp, hook  # what a recovery drops: the old wrapper (its rebuild thread may still wait in the old group)
ddp, hook = wrapped(model)
for step in range(2):
    ddp(torch.randn(8, 16)).sum().backward()
    hook.settle()
    if step == 0:
        hook.rebuild_buckets()  # at full size again (two): the new group's re-layout completes
seen["steps_after"] = 2
(out_dir / f"rank{rank}.json").write_text(json.dumps(seen))
members.comm.Barrier()
os._exit(0)  # as the survivors end (no MPI_Finalize after a shrink: open-mpi/ompi#11404)
