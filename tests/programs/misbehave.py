"""A script that fails on purpose on rank 1: argv[1] is raise, exit3, argparse, exit0, or ok (no failure).
With argv[2] == "api" it starts with `mpiddp.init(finish_timeout_s=3)` (for a plain mpirun) instead of
torchrun's `init_process_group()`."""

import argparse
import os
import sys

import torch
import torch.distributed as dist

mode = sys.argv[1]
if sys.argv[2:] == ["api"]:
    import mpiddp

    mpiddp.init(finish_timeout_s=3)
else:
    dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
if rank == 1:
    if mode == "argparse":
        argparse.ArgumentParser(prog="misbehave.py").parse_args(["--no-such-option"])
    if mode == "raise":
        raise ValueError("bad value on rank 1")
    if mode == "exit3":
        sys.exit(3)
    if mode == "exit0":
        sys.exit(0)  # leaves rank 0 alone in the all_reduce below
total = torch.ones(1)
dist.all_reduce(total)
assert total.item() == dist.get_world_size()
dist.destroy_process_group()
