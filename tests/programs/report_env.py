"""Run under mpirun: each rank writes the torchrun-style variables mpiddp exported and its thread count."""

import os
import sys

import torch

from mpiddp.bootstrap import FailFast, distributed
from mpiddp.config import Config
from mpiddp.topology import discover, init_mpi

with FailFast() as guard:
    comm = guard.comm = init_mpi()
    topo = discover(comm)
    with distributed(Config(device="cpu"), topo, comm):
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
        line = " ".join(f"{name}={os.environ[name]}" for name in names) + f" threads={torch.get_num_threads()}"
        with open(f"{sys.argv[1]}.{topo.rank}", "w") as out:
            out.write(line)
