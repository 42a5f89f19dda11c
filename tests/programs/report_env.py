"""Run under mpirun: each rank writes the torchrun-style variables mpiddp exported and its thread count."""

import os
import sys

import torch

from mpiddp.job.bootstrap import connect, distributed
from mpiddp.job.failfast import FailFast
from mpiddp.job.flags import DistSettings

with FailFast() as guard:
    dist = connect(guard)
    topo = dist.topology
    with distributed(DistSettings(device="cpu"), dist, guard):
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
        line = " ".join(f"{name}={os.environ[name]}" for name in names) + f" threads={torch.get_num_threads()}"
        with open(f"{sys.argv[1]}.{topo.rank}", "w") as out:
            out.write(line)
        if topo.is_main:  # where the rendezvous store listens: /proc/net/tcp{,6} rows in state 0A (LISTEN)
            port = int(os.environ["MASTER_PORT"])
            listening = []
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                for row in open(table).read().splitlines()[1:]:
                    local, state = row.split()[1], row.split()[3]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        listening.append(local.rsplit(":", 1)[0])
            with open(f"{sys.argv[1]}.listen", "w") as out:
                out.write(" ".join(listening))
