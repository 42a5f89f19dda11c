"""Under mpirun: all-reduce bandwidth of MPI (mpi4py, numpy buffers) and of torch.distributed (gloo/NCCL) by size.

argv: OUT_JSON [cpu|cuda]. Uses mpiddp's own bootstrap, so the gloo/NCCL numbers are what training sees. On
cuda it measures NCCL on GPU buffers at 16-64 MiB as well (the sizes nccl-tests quotes bus bandwidth at).
Rank 0 writes JSON rows to OUT_JSON.
"""

import json
import sys
import time

import numpy as np
from mpi4py import MPI

from mpiddp.bootstrap import connect, distributed
from mpiddp.check import ALLREDUCE_SIZES, allreduce_bandwidth, bus_bandwidth
from mpiddp.config import Config
from mpiddp.failfast import FailFast

DEVICE = sys.argv[2] if len(sys.argv) > 2 else "cpu"
MIB = 1024 * 1024
SIZES = (*ALLREDUCE_SIZES, 16 * MIB) + ((32 * MIB, 64 * MIB) if DEVICE == "cuda" else ())


def mpi_allreduce(comm, nbytes: int, repeats: int = 5) -> float:
    send = np.ones(nbytes // 4, dtype=np.float32)
    receive = np.empty_like(send)
    for _ in range(2):
        comm.Allreduce(send, receive, op=MPI.SUM)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        comm.Allreduce(send, receive, op=MPI.SUM)
        times.append(time.perf_counter() - started)
    return comm.allreduce(float(np.median(times)), op=MPI.MAX)


with FailFast() as guard:
    job = connect(guard)
    topo = job.topology
    comm = MPI.COMM_WORLD  # the benchmark measures MPI's own all-reduce too, so it talks to MPI directly
    with distributed(Config(device=DEVICE), job, guard) as dist:
        rows = []
        for nbytes in SIZES:
            torch_row = allreduce_bandwidth(dist, nbytes)
            seconds = mpi_allreduce(comm, nbytes)
            rows.append({
                "bytes": nbytes,
                f"{dist.backend}_busbw_GBps": torch_row["busbw_GBps"],
                "mpi_busbw_GBps": bus_bandwidth(nbytes / seconds, topo.world_size) / 1e9,
            })
        if topo.is_main:
            with open(sys.argv[1], "w") as out:
                json.dump({"mpi_library": topo.mpi_library, "world_size": topo.world_size, "rows": rows}, out)
