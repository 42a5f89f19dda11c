"""A torchrun-style script that fails on purpose on rank 1: argv[1] is raise, exit3, argparse or exit0."""

import argparse
import os
import sys

import torch
import torch.distributed as dist

mode = sys.argv[1]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
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
dist.destroy_process_group()
