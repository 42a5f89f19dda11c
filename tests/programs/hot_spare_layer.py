"""Hot spares at the MPI layer (tests/elastic/test_hot_spares.py): under `mpirun --with-ft ulfm -np 5` with
MPIDDP_SPARE_RANKS=2, three workers all-reduce; world rank 1 SIGKILLs itself at step 10; the survivors shrink
and grow back onto the first spare (mpiddp.elastic.spawning.wake_and_merge), which joins for the remaining
steps; rank 0 releases the other spare at the end. With `first-spare-dies` the first spare dies at once and the
grow takes the second. Each process writes what it saw into OUT."""
import json, os, signal, sys
from array import array
from mpiddp.elastic import spawning as m
from mpiddp.elastic.decide import GrowPlan
from mpiddp.job.mpistart import init_mpi
from mpiddp.job.spares import spare_world
from mpi4py import MPI
out = sys.argv[1]
joining = m.joining()
def reduce_one(comm):
    total = array("i", [0]); comm.Allreduce(array("i", [1]), total, op=MPI.SUM); return total[0]
if joining:
    if len(sys.argv) > 2 and sys.argv[2] == "first-spare-dies" and spare_world().waiting[0] == \
            spare_world().world.Get_rank():
        os.kill(os.getpid(), signal.SIGKILL)  # while it waits: the grow must take the other one
    try:
        comm = m.merge_with_parent()
    except m.SpareReleased:
        open(f"{out}/released.{os.getpid()}", "w").write("1"); os._exit(0)
    steps = 0
    while steps < 20:
        reduce_one(comm); steps += 1
    open(f"{out}/joined.{comm.Get_rank()}", "w").write(json.dumps([steps, comm.Get_size()]))
    comm.Barrier(); os._exit(0)
comm, _ = init_mpi()
comm.Set_errhandler(MPI.ERRORS_RETURN)
rank = comm.Get_rank()
step, grew = 0, None
while step < 30:
    if step == 10 and rank == 1 and grew is None:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        reduce_one(comm)
    except MPI.Exception:
        comm.Revoke(); comm = comm.Shrink()
        comm, grew = m.wake_and_merge(comm, GrowPlan((spare_world().hosts[0],)))
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        continue
    step += 1
open(f"{out}/worker.{rank}", "w").write(json.dumps([step, comm.Get_size(), grew]))
from mpiddp.job.spares import release_spares
release_spares()
comm.Barrier()
os._exit(0)
