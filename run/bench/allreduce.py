"""Under mpirun: all-reduce bandwidth of MPI (mpi4py, numpy buffers) and of torch.distributed (gloo/NCCL) by size.

argv: OUT_JSON [cpu|cuda]. Uses mpiddp's own bootstrap, so the gloo/NCCL numbers are what training sees. On
cuda it measures NCCL on GPU buffers at 16-64 MiB as well (the sizes nccl-tests quotes bus bandwidth at). On
cpu it also measures MPI as training with --grad-transport mpi sees it: a bucket of fp32 gradients through
mpiddp's hook (divide, MPI_Allreduce, completed future), plain and bf16 (compress, user-defined sum,
decompress); bus bandwidth counted in fp32 gradient bytes, so bf16's halved traffic shows as a gain.
Rank 0 writes JSON rows to OUT_JSON.
"""

import json
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from mpiddp.job.bootstrap import connect, distributed
from mpiddp.job.compression import GradientHook
from mpiddp.job.failfast import FailFast
from mpiddp.tools.check import ALLREDUCE_SIZES, allreduce_bandwidth, bus_bandwidth
from mpiddp.trainer.config import Config

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


def hook_allreduce(comm, dist, nbytes: int, compression: str, repeats: int = 5) -> float:
    """Seconds per bucket of `nbytes` fp32 gradients through mpiddp's hook with --grad-transport mpi."""
    hook = GradientHook(compression, [], lambda: None, mpi=dist)
    bucket = torch.ones(max(1, nbytes // 4))
    for _ in range(2):
        hook._through_mpi(bucket).wait()
    times = []
    for _ in range(repeats):
        comm.Barrier()
        started = time.perf_counter()
        hook._through_mpi(bucket).wait()
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
            row = {
                "bytes": nbytes,
                f"{dist.backend}_busbw_GBps": torch_row["busbw_GBps"],
                "mpi_busbw_GBps": bus_bandwidth(nbytes / seconds, topo.world_size) / 1e9,
            }
            if DEVICE == "cpu":
                for name, kind in (("mpi_hook", "none"), ("mpi_hook_bf16", "bf16")):
                    hook_s = hook_allreduce(comm, dist, nbytes, kind)
                    row[f"{name}_busbw_GBps"] = bus_bandwidth(nbytes / hook_s, topo.world_size) / 1e9
            rows.append(row)
        if topo.is_main:
            with open(sys.argv[1], "w") as out:
                json.dump({"mpi_library": topo.mpi_library, "world_size": topo.world_size, "rows": rows}, out)
